// The dispatched XXH3 against libxxhash's own build: every variant the CPU
// can run gives the library's value for every length class XXH3 treats
// differently (0, 1-3, 4-8, 9-16, 17-128, 129-240, long inputs with partial
// stripes and blocks), at every alignment, and in two parts at any split.
#include "util/checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace strata {
namespace {

using checksum_internal::Xxh3Fns;

struct Variant {
  const char* name;
  const Xxh3Fns* fns;
  bool runs;
};

std::vector<Variant> Variants() {
  __builtin_cpu_init();
  return {
      {"baseline", &checksum_internal::kXxh3Baseline, true},
      {"avx2", &checksum_internal::kXxh3Avx2,
       __builtin_cpu_supports("avx2") != 0},
      {"avx512", &checksum_internal::kXxh3Avx512,
       __builtin_cpu_supports("avx512f") != 0},
  };
}

std::vector<std::byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

std::vector<size_t> Lengths() {
  std::vector<size_t> n;
  for (size_t i = 0; i <= 260; ++i) n.push_back(i);
  for (size_t base : {1024u, 4096u, 65536u, 1u << 20}) {
    for (int d : {-65, -1, 0, 1, 63, 64, 193}) n.push_back(base + d);
  }
  return n;
}

TEST(ChecksumTest, EveryVariantGivesTheLibrarysValue) {
  const std::vector<std::byte> data = RandomBytes((1 << 20) + 512, 7);
  int ran = 0;
  for (const Variant& v : Variants()) {
    if (!v.runs) continue;
    ++ran;
    for (size_t n : Lengths()) {
      for (size_t offset : {0u, 1u, 3u, 8u, 33u}) {
        const std::byte* p = data.data() + offset;
        ASSERT_EQ(v.fns->one(p, n), XXH3_64bits(p, n))
            << v.name << " length " << n << " offset " << offset;
      }
    }
  }
  EXPECT_GE(ran, 1);
}

TEST(ChecksumTest, TwoPartsAreTheirConcatenation) {
  const std::vector<std::byte> data = RandomBytes(300000, 11);
  std::mt19937 rng(3);
  for (const Variant& v : Variants()) {
    if (!v.runs) continue;
    for (size_t n :
         {size_t{0}, size_t{17}, size_t{240}, size_t{4096}, size_t{300000}}) {
      for (int k = 0; k < 20; ++k) {
        const size_t split = n == 0 ? 0 : rng() % (n + 1);
        ASSERT_EQ(
            v.fns->two(data.data(), split, data.data() + split, n - split),
            XXH3_64bits(data.data(), n))
            << v.name << " length " << n << " split " << split;
      }
    }
  }
}

TEST(ChecksumTest, ThePublicFunctionsUseTheWidestVariantTheCpuRuns) {
  std::string widest = "baseline";
  for (const Variant& v : Variants()) {
    if (v.runs) widest = v.name;
  }
  EXPECT_EQ(Xxh3Variant(), widest);
  const std::vector<std::byte> data = RandomBytes(5000, 5);
  const std::span<const std::byte> all(data);
  EXPECT_EQ(Xxh3(all), XXH3_64bits(data.data(), data.size()));
  EXPECT_EQ(Xxh3(all.first(1000), all.subspan(1000)),
            XXH3_64bits(data.data(), data.size()));
  EXPECT_EQ(Xxh3({}), XXH3_64bits(nullptr, 0));
}

}  // namespace
}  // namespace strata
