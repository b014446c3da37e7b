// Helpers shared by the swap tests: scratch directories, offset-stamped data,
// and engines for every backend this machine offers.
#ifndef STRATA_TESTS_SWAP_TEST_UTIL_H_
#define STRATA_TESTS_SWAP_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>

#include "strata/host_buffer.h"
#include "strata/io_engine.h"

namespace strata::testing {

// A fresh directory under TMPDIR (default /tmp), removed at destruction.
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
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Fills buf so that every 8-byte word holds (offset of the word) ^ salt; a
// misplaced or stale block cannot pass for the right one.
inline void Stamp(std::span<std::byte> buf, uint64_t file_offset,
                  uint64_t salt) {
  size_t i = 0;
  for (; i + 8 <= buf.size(); i += 8) {
    const uint64_t v = (file_offset + i) ^ salt;
    std::memcpy(buf.data() + i, &v, 8);
  }
  for (; i < buf.size(); ++i) {
    buf[i] = static_cast<std::byte>(((file_offset + i) ^ salt) & 0xff);
  }
}

// Index of the first byte that differs from Stamp(file_offset, salt), or -1.
inline int64_t FirstMismatch(std::span<const std::byte> buf,
                             uint64_t file_offset, uint64_t salt) {
  std::vector<std::byte> want(buf.size());
  Stamp(want, file_offset, salt);
  for (size_t i = 0; i < buf.size(); ++i) {
    if (buf[i] != want[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

inline HostBuffer MustAllocate(size_t bytes) {
  auto b = HostBuffer::Allocate(bytes);
  EXPECT_TRUE(b.ok()) << b.status().ToString();
  return std::move(b).value();
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_SWAP_TEST_UTIL_H_
