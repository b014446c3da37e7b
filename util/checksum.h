// XXH3-64 checksums at the speed of the widest vector unit the CPU has.
//
// The values are XXH3's (the same as libxxhash's XXH3_64bits), whatever the
// CPU: every checksum strata writes (swap block headers, checkpoint extents
// and manifests) stays readable on any machine. Debian's libxxhash is built
// for baseline x86-64 (SSE2); these functions pick an AVX2 or AVX-512 build of
// the same code at the first call when the CPU has it, which checksums a
// 1 MiB block about 1.6x faster out of cache on an AVX2 machine. Thread-safe.
#ifndef STRATA_UTIL_CHECKSUM_H_
#define STRATA_UTIL_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace strata {

// XXH3-64 (seed 0) of `bytes`.
uint64_t Xxh3(std::span<const std::byte> bytes);

// XXH3-64 of `a` followed by `b`, without joining them in memory.
uint64_t Xxh3(std::span<const std::byte> a, std::span<const std::byte> b);

// The variant the functions above use: "avx512", "avx2" or "baseline".
std::string_view Xxh3Variant();

namespace checksum_internal {

// One build of XXH3 per instruction set (checksum_<isa>.cc).
struct Xxh3Fns {
  uint64_t (*one)(const void* p, size_t n);
  uint64_t (*two)(const void* a, size_t an, const void* b, size_t bn);
};
extern const Xxh3Fns kXxh3Baseline;
extern const Xxh3Fns kXxh3Avx2;
extern const Xxh3Fns kXxh3Avx512;

}  // namespace checksum_internal
}  // namespace strata

#endif  // STRATA_UTIL_CHECKSUM_H_
