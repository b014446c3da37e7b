// Helpers shared by the swap tests: scratch directories, offset-stamped data,
// and engines for every backend this machine offers.
#ifndef STRATA_TESTS_SWAP_TEST_UTIL_H_
#define STRATA_TESTS_SWAP_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>

#include "strata/host_buffer.h"
#include "strata/io_engine.h"
#include "strata/swap_space.h"
#include "tests/util/scratch_dir.h"

namespace strata::testing {

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

// The two ways of moving a tensor through a SwapSpace: the synchronous
// wrappers, and the asynchronous calls straight from an aligned buffer.
enum class SwapPath { kSync, kAsync };

inline std::string SwapPathName(SwapPath p) {
  return p == SwapPath::kSync ? "sync" : "async";
}

// A buffer that the asynchronous calls accept for all of `h`.
inline HostBuffer SwapBuffer(const SwapSpace& s, const SwapHandle& h) {
  return MustAllocate(
      std::max<uint64_t>(s.BufferBytes(h, 0, h.blocks()), 4096));
}

inline StatusOr<SwapHandle> WriteVia(SwapPath path, SwapSpace& s,
                                     uint64_t tensor_id,
                                     std::span<const std::byte> data) {
  if (path == SwapPath::kSync) return s.Write(tensor_id, data);
  STRATA_ASSIGN_OR_RETURN(SwapHandle h, s.Allocate(tensor_id, data.size()));
  HostBuffer buf = SwapBuffer(s, h);
  if (!data.empty()) std::memcpy(buf.data(), data.data(), data.size());
  IoTicket done;
  STRATA_RETURN_IF_ERROR(s.WriteAsync(h, 0, h.blocks(), buf.span(),
                                      IoPriority::kBackground, done.Setter()));
  STRATA_RETURN_IF_ERROR(done.Wait());
  return h;
}

// The asynchronous read leaves its buffer unspecified on failure; like the
// synchronous one, `out` is written only on success.
inline Status ReadVia(SwapPath path, SwapSpace& s, const SwapHandle& h,
                      std::span<std::byte> out) {
  if (path == SwapPath::kSync) return s.Read(h, out);
  if (out.size() != h.bytes()) return Status::InvalidArgument("size");
  HostBuffer buf = SwapBuffer(s, h);
  IoTicket done;
  STRATA_RETURN_IF_ERROR(s.ReadAsync(h, 0, h.blocks(), buf.span(),
                                     IoPriority::kUrgent, done.Setter()));
  STRATA_RETURN_IF_ERROR(done.Wait());
  if (!out.empty()) std::memcpy(out.data(), buf.data(), out.size());
  return Status::Ok();
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_SWAP_TEST_UTIL_H_
