// Finding a Python interpreter for the comparisons with PyTorch that the
// tests and strata-bench run in a child process. Internal; header-only so
// that neither the library nor its users carry it.
#ifndef STRATA_UTIL_FIND_PYTHON_H_
#define STRATA_UTIL_FIND_PYTHON_H_

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// The first of $STRATA_PYTHON, python3 on PATH and /usr/bin/python3 that can
// `import <modules>` (a comma-separated list, as Python writes it: "torch,
// numpy"); empty when none can. Each candidate costs one interpreter start.
inline std::string FindPythonWith(std::string_view modules) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("STRATA_PYTHON"); env && *env) {
    candidates.emplace_back(env);
  }
  candidates.emplace_back("python3");
  candidates.emplace_back("/usr/bin/python3");
  for (const std::string& py : candidates) {
    const std::string cmd =
        py + " -c 'import " + std::string(modules) + "' > /dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return "";
}

}  // namespace strata

#endif  // STRATA_UTIL_FIND_PYTHON_H_
