// Finding a Python interpreter for the comparisons with PyTorch that the
// tests and strata-bench run in a child process. Internal; header-only so
// that neither the library nor its users carry it. No shell: every child
// gets an argument vector, so a path or an environment value with spaces or
// shell metacharacters stays one plain argument.
#ifndef STRATA_UTIL_FIND_PYTHON_H_
#define STRATA_UTIL_FIND_PYTHON_H_

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace strata {

// The interpreters to try, in order: $STRATA_PYTHON, python3 on PATH,
// /usr/bin/python3.
inline std::vector<std::string> PythonCandidates() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("STRATA_PYTHON"); env && *env) {
    candidates.emplace_back(env);
  }
  candidates.emplace_back("python3");
  candidates.emplace_back("/usr/bin/python3");
  return candidates;
}

// The Python statement that imports `modules` (a comma-separated list, as
// Python writes it: "torch, numpy").
inline std::string PythonImport(std::string_view modules) {
  return "import " + std::string(modules);
}

// Runs argv (argv[0] searched on PATH) with stdin, stdout and stderr on
// /dev/null and waits for it. Its exit status, or -1 when it could not run
// or died of a signal.
inline int RunQuietly(const std::vector<std::string>& argv) {
  if (argv.empty()) return -1;
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  pid_t pid = -1;
  const int err =
      posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The first of PythonCandidates() that can `import <modules>`; empty when
// none can. Each candidate costs one interpreter start.
inline std::string FindPythonWith(std::string_view modules) {
  for (const std::string& py : PythonCandidates()) {
    if (RunQuietly({py, "-c", PythonImport(modules)}) == 0) return py;
  }
  return "";
}

}  // namespace strata

#endif  // STRATA_UTIL_FIND_PYTHON_H_
