// The engine over data-parallel ranks (zero_stage 1 and 2): each case runs
// engine_mpi_worker under mpirun (paths from CMake) on 2 and 3 ranks (3
// gives shards that end in padding) and reads its output.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

struct MpiRun {
  int exit_code = -1;  // -1: killed by a signal
  std::string out;     // stdout and stderr
  double seconds = 0;
};

// mpirun -np N --oversubscribe worker plugin args..., as root where needed.
MpiRun Mpirun(int ranks, const std::vector<std::string>& args) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  std::vector<std::string> argv = {
      STRATA_TEST_MPIEXEC, "-np", std::to_string(ranks), "--oversubscribe",
      "--bind-to", "none",
      // Shared memory and TCP on loopback only.
      "--mca", "btl", "self,vader,tcp", STRATA_TEST_MPI_WORKER,
      STRATA_TEST_MPI_PLUGIN};
  argv.insert(argv.end(), args.begin(), args.end());
  int fds[2];
  if (pipe(fds) != 0) return {};
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> a;
    for (auto& s : argv) a.push_back(s.data());
    a.push_back(nullptr);
    execv(a[0], a.data());
    _exit(127);
  }
  close(fds[1]);
  MpiRun r;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof buf)) > 0) r.out.append(buf, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
          .count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
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
