// The engine over data-parallel ranks (zero_stage 1, 2 and 3): each case runs
// engine_mpi_worker under mpirun (paths from CMake) on 2 and 3 ranks (3
// gives shards that end in padding) and reads its output.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "tests/comm/mpi_run.h"
#include "tests/util/scratch_dir.h"

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

// Stages 1, 2 and 3, optimizer states on host and NVMe, gradients on NVMe,
// stage 2's updates during backward, stage 3's parameters on host and NVMe
// under a device budget that evicts: the same masters as one engine on the
// whole batch; and Adafactor's shards cut mid-row read from the drive
// twice a step and their edges.
TEST_P(EngineRanksTest, TrainsAsOneRankOnTheWholeBatch) {
  const int ranks = GetParam();
  const MpiRun r = Mpirun(ranks, {"train"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (int i = 0; i < ranks; ++i)
    EXPECT_EQ(Count(r.out, i, ": ok"), 25) << r.out;
  std::printf("%s(%d ranks, %.1f s)\n", r.out.c_str(), ranks, r.seconds);
}

// BeginStep over ranks (zero_stage 2 and 3): each rank's stepper takes its
// shard's gradient statistics during backward, to Step alone's bits.
TEST_P(EngineRanksTest, StatisticsDuringBackwardChangeNothing) {
  const int ranks = GetParam();
  const MpiRun r = Mpirun(ranks, {"statistics"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (int i = 0; i < ranks; ++i)
    EXPECT_EQ(Count(r.out, i, ": ok"), 8) << r.out;
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

// The worker's fault `mode` on 2 and 3 ranks: each of its `cases` is refused
// on every rank, none fails.
void ExpectRefusedOnEveryRank(const std::string& mode, int cases) {
  for (int ranks : {2, 3}) {
    const MpiRun r = Mpirun(ranks, {mode});
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
    for (int i = 0; i < ranks; ++i) {
      EXPECT_EQ(Count(r.out, i, ": refused in "), cases) << r.out;
    }
    std::printf("%s", r.out.c_str());
  }
}

// A write-back or a gradient write that fails on one rank fails the step on
// every rank at once, naming that rank, rather than after the
// communicator's timeout; so does a hand-over refused on one rank, with
// and without BeginStep.
TEST(EngineRanksErrorsTest, AFailedWriteBackOnOneRankFailsEveryRankAtOnce) {
  ExpectRefusedOnEveryRank("step-fault", 8);
}

// A shard of stage 3's parameters that one rank cannot read from NVMe fails
// the fetch on every rank at once, naming that rank, on host and on device
// memory.
TEST(EngineRanksErrorsTest, AFailedShardReadOnOneRankFailsEveryFetch) {
  ExpectRefusedOnEveryRank("gather-fault", 2);
}

// Checkpoints over ranks (Note [Checkpoints over ranks]), stages 1 to 3:
// saved on 2 ranks, resumed on 2 bit for bit, loaded on 1 and 3; saved on
// 1, loaded on 2.
TEST(EngineRanksCheckpointTest, SavesOnNLoadsOnM) {
  strata::testing::ScratchDir dir;
  const MpiRun s2 = Mpirun(2, {"ckpt-save", dir.path()});
  ASSERT_EQ(s2.exit_code, 0) << s2.out;
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Count(s2.out, i, ": ok"), 10) << s2.out;
  std::printf("%s", s2.out.c_str());
  const MpiRun s1 = Mpirun(1, {"ckpt-save", dir.path()});
  ASSERT_EQ(s1.exit_code, 0) << s1.out;
  EXPECT_EQ(Count(s1.out, 0, ": ok"), 10) << s1.out;
  // Loads: {ranks, saved on}; int8 moments only at the saving world size.
  for (const auto& [ranks, saved] :
       std::vector<std::pair<int, int>>{{1, 2}, {3, 2}, {2, 1}}) {
    const MpiRun l =
        Mpirun(ranks, {"ckpt-load", dir.path(), std::to_string(saved)});
    EXPECT_EQ(l.exit_code, 0) << l.out;
    EXPECT_EQ(l.out.find("FAIL"), std::string::npos) << l.out;
    for (int i = 0; i < ranks; ++i) {
      EXPECT_EQ(Count(l.out, i, ": ok"), 9) << l.out;
      EXPECT_EQ(Count(l.out, i, ": refused: "), 1) << l.out;
    }
    std::printf("%s", l.out.c_str());
  }
}

// A failure on the writer rank reaches every rank, and nothing is
// published.
TEST(EngineRanksCheckpointTest, WriterFailuresReachEveryRank) {
  strata::testing::ScratchDir dir;
  const MpiRun r = Mpirun(2, {"ckpt-fail", dir.path()});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out.find("FAIL"), std::string::npos) << r.out;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Count(r.out, i, ": refused: "), 3) << r.out;
  }
  std::printf("%s", r.out.c_str());
}

}  // namespace
