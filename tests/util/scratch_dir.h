// A fresh directory under TMPDIR (default /tmp), removed at destruction:
// for tests and test workers alike (no gtest here).
#ifndef STRATA_TESTS_UTIL_SCRATCH_DIR_H_
#define STRATA_TESTS_UTIL_SCRATCH_DIR_H_

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace strata::testing {

class ScratchDir {
 public:
  ScratchDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl =
        std::string(base ? base : "/tmp") + "/strata-test-XXXXXX";
    char* p = ::mkdtemp(tmpl.data());
    if (p != nullptr) path_ = p;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  // Empty when the directory could not be made.
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace strata::testing

#endif  // STRATA_TESTS_UTIL_SCRATCH_DIR_H_
