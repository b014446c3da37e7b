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

namespace strata::testing {

struct MpiRun {
  int exit_code = -1;  // -1: killed by a signal
  std::string out;     // stdout and stderr
  double seconds = 0;
};

// `mpiexec` -np N --oversubscribe (no binding, shared memory and TCP on
// loopback only), to be followed by the program and its arguments; allows
// running as root, as the test machines do.
inline std::vector<std::string> MpiExecArgv(const std::string& mpiexec,
                                            int ranks) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  return {mpiexec,           "-np",       std::to_string(ranks),
          "--oversubscribe", "--bind-to", "none",
          "--mca",           "btl",       "self,vader,tcp"};
}

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

// MpiExecArgv, then `worker` `plugin` args..., its output collected.
inline MpiRun RunUnderMpi(const std::string& mpiexec, const std::string& worker,
                          const std::string& plugin, int ranks,
                          const std::vector<std::string>& args) {
  std::vector<std::string> argv = MpiExecArgv(mpiexec, ranks);
  argv.push_back(worker);
  argv.push_back(plugin);
  argv.insert(argv.end(), args.begin(), args.end());
  return RunArgv(std::move(argv));
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_COMM_MPI_RUN_H_
