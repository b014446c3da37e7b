#include "util/checksum.h"

namespace strata {
namespace {

using checksum_internal::Xxh3Fns;

struct Chosen {
  const Xxh3Fns* fns;
  std::string_view name;
};

// AVX-512 needs F (xxhash's AVX-512 path uses only its foundation); the OS's
// saving of the wider state is part of what __builtin_cpu_supports reports.
Chosen Choose() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    return {&checksum_internal::kXxh3Avx512, "avx512"};
  }
  if (__builtin_cpu_supports("avx2")) {
    return {&checksum_internal::kXxh3Avx2, "avx2"};
  }
  return {&checksum_internal::kXxh3Baseline, "baseline"};
}

const Chosen& Fns() {
  static const Chosen chosen = Choose();
  return chosen;
}

}  // namespace

uint64_t Xxh3(std::span<const std::byte> bytes) {
  return Fns().fns->one(bytes.data(), bytes.size());
}

uint64_t Xxh3(std::span<const std::byte> a, std::span<const std::byte> b) {
  return Fns().fns->two(a.data(), a.size(), b.data(), b.size());
}

std::string_view Xxh3Variant() { return Fns().name; }

}  // namespace strata
