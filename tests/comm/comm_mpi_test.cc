// The MPI backend on 1, 2 and 3 ranks, and a rank that dies: each case runs
// comm_mpi_worker under mpirun (paths from CMake) and reads its output.
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

// mpirun -np N [--oversubscribe] worker plugin args..., as root where needed.
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

class MpiCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(MpiCollectivesTest, EveryCollectiveMatchesTheReference) {
  const int ranks = GetParam();
  const MpiRun r = Mpirun(ranks, {"collectives"});
  EXPECT_EQ(r.exit_code, 0) << r.out;
  for (int i = 0; i < ranks; ++i) {
    EXPECT_NE(r.out.find("rank " + std::to_string(i) + ": collectives: "),
              std::string::npos)
        << r.out;
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
