// Runs a test worker under mpirun and collects what it printed: shared by
// the suites that start MPI jobs (comm_mpi_test, memtier_engine_mpi_test,
// cli_bench_mpi_test).
#ifndef STRATA_TESTS_COMM_MPI_RUN_H_
#define STRATA_TESTS_COMM_MPI_RUN_H_

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "tests/util/scratch_dir.h"

namespace strata::testing {

struct MpiRun {
  int exit_code = -1;  // -1: killed by a signal
  std::string out;     // stdout and stderr
  double seconds = 0;
};

// One mpirun job's command line, up to the program: `mpiexec` -np N
// --oversubscribe (no binding, shared memory and TCP on loopback only),
// allowed to run as root, as the test machines do.
//
// Each job has a session directory of its own, removed with this object.
// Open MPI 4 otherwise keeps every job's session files under one
// TMPDIR/ompi.<host>.<uid>, which a job that ends removes when it finds it
// empty: when that happens as another job starts (ctest -j), the starting
// one fails in orte_init ("A call to mkdir was unable to create the desired
// directory"; CI saw it once in 802 tests, Open MPI issue 8510).
class MpiLaunch {
 public:
  MpiLaunch(const std::string& mpiexec, int ranks)
      : mpiexec_(mpiexec), ranks_(ranks) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }

  // To be followed by the program and its arguments; valid while this
  // object lives.
  std::vector<std::string> Argv() const {
    std::vector<std::string> argv = {
        mpiexec_,          "-np",       std::to_string(ranks_),
        "--oversubscribe", "--bind-to", "none",
        "--mca",           "btl",       "self,vader,tcp"};
    if (!session_.path().empty()) {
      argv.insert(argv.end(), {"--mca", "orte_tmpdir_base", session_.path()});
    }
    return argv;
  }

 private:
  std::string mpiexec_;
  int ranks_;
  ScratchDir session_;
};

// Runs `argv` (argv[0] a path), its stdout and stderr collected.
inline MpiRun RunArgv(std::vector<std::string> argv) {
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

// An MpiLaunch, then `worker` `plugin` args..., its output collected.
inline MpiRun RunUnderMpi(const std::string& mpiexec, const std::string& worker,
                          const std::string& plugin, int ranks,
                          const std::vector<std::string>& args) {
  const MpiLaunch launch(mpiexec, ranks);
  std::vector<std::string> argv = launch.Argv();
  argv.push_back(worker);
  argv.push_back(plugin);
  argv.insert(argv.end(), args.begin(), args.end());
  return RunArgv(std::move(argv));
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_COMM_MPI_RUN_H_
