// The MPI backend on 1, 2 and 3 ranks, and a rank that dies: each case runs
// comm_mpi_worker under mpirun (paths from CMake) and reads its output.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/comm/mpi_run.h"

namespace {

using strata::testing::MpiRun;

MpiRun Mpirun(int ranks, const std::vector<std::string>& args) {
  return strata::testing::RunUnderMpi(STRATA_TEST_MPIEXEC,
                                      STRATA_TEST_MPI_WORKER,
                                      STRATA_TEST_MPI_PLUGIN, ranks, args);
}

class MpiCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(MpiCollectivesTest, EveryCollectiveMatchesTheReference) {
  const int ranks = GetParam();
  const MpiRun r = Mpirun(ranks, {"collectives"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  for (int i = 0; i < ranks; ++i) {
    for (const char* what : {": collectives: ", ": duplicate: "}) {
      EXPECT_NE(r.out.find("rank " + std::to_string(i) + what),
                std::string::npos)
          << r.out;
    }
  }
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
}

INSTANTIATE_TEST_SUITE_P(Ranks, MpiCollectivesTest, ::testing::Values(1, 2, 3));

// The survivors of a rank that stops answering fail with an error naming
// the operation and the timeout, within the timeout plus start-up.
TEST(MpiDeadRankTest, HungRankMakesTheOthersFailWithinTheTimeout) {
  const MpiRun r = Mpirun(3, {"dead-rank", "hang", "3"});
  EXPECT_NE(r.exit_code, 0) << r.out;
  for (int i = 0; i < 2; ++i) {
    const std::string rank = "rank " + std::to_string(i) + ": failed after";
    const size_t at = r.out.find(rank);
    ASSERT_NE(at, std::string::npos) << r.out;
    const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_NE(line.find("all-reduce (sum, float32, 1 elements) on rank"),
              std::string::npos)
        << line;
    EXPECT_NE(line.find("timeout of 3 s"), std::string::npos) << line;
  }
  EXPECT_LT(r.seconds, 60) << r.out;
}

// A rank that exits or is killed: whether MPI reports the lost peer, the
// timeout fires, or mpirun ends the job, nobody waits forever and the job
// fails.
class MpiLostRankTest : public ::testing::TestWithParam<const char*> {};

TEST_P(MpiLostRankTest, JobFailsWithinTheTimeout) {
  const MpiRun r = Mpirun(3, {"dead-rank", GetParam(), "3"});
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 60) << r.out;
}

INSTANTIATE_TEST_SUITE_P(How, MpiLostRankTest,
                         ::testing::Values("exit", "kill"));

}  // namespace
