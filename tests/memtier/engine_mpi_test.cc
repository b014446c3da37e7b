// The engine over data-parallel ranks (zero_stage 1 and 2): each case runs
// engine_mpi_worker under mpirun (paths from CMake) on 2 and 3 ranks (3
// gives shards that end in padding) and reads its output.
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

// How many lines start with "rank R: " and contain `what`.
int Count(const std::string& out, int rank, const std::string& what) {
  int n = 0;
  const std::string head = "rank " + std::to_string(rank) + ": ";
  size_t at = 0;
  while ((at = out.find(head, at)) != std::string::npos) {
    const size_t end = out.find('\n', at);
    if (out.substr(at, end - at).find(what) != std::string::npos) ++n;
    at = end;
  }
  return n;
}

class EngineRanksTest : public ::testing::TestWithParam<int> {};

// Stages 1 and 2, optimizer states on host and NVMe, stage 2's gradients on
// NVMe and its updates during backward: the same masters as one engine on
// the whole batch.
TEST_P(EngineRanksTest, TrainsAsOneRankOnTheWholeBatch) {
  const int ranks = GetParam();
  const MpiRun r = Mpirun(ranks, {"train"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (int i = 0; i < ranks; ++i)
    EXPECT_EQ(Count(r.out, i, ": ok"), 6) << r.out;
  std::printf("%s(%d ranks, %.1f s)\n", r.out.c_str(), ranks, r.seconds);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EngineRanksTest, ::testing::Values(2, 3));

TEST(EngineRanksErrorsTest, RefusedCombinationsSayWhy) {
  const MpiRun r = Mpirun(2, {"errors"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Count(r.out, i, ": refused: "), 8) << r.out;
  }
}

}  // namespace
