// Bit-exactness of every variant's 16-bit conversions against independent
// references: all 65536 patterns for the up-conversions; special values,
// every rounding boundary of every exponent, and random patterns for the
// down-conversions; odd lengths and offsets for the vector tails.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "strata/cpu_adam.h"
#include "tests/cpu_adam/test_util.h"

namespace strata {
namespace {

using cpu_adam_test::Bits;
using cpu_adam_test::FromBits;

std::string Name(CpuKernelVariant v) {
  return std::string(CpuKernelVariantName(v));
}

TEST(ConvertTest, AllHalfAndBf16PatternsUpConvertExactly) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (CpuKernelVariant v : cpu_adam_test::SupportedVariants()) {
    SCOPED_TRACE(Name(v));
    std::vector<float> out(all.size());
    ASSERT_TRUE(ConvertCpuArray(all.data(), CpuDType::kFloat16, out.data(),
                                CpuDType::kFloat32, all.size(), v)
                    .ok());
    for (uint32_t i = 0; i < 65536; ++i) {
      ASSERT_EQ(Bits(out[i]), cpu_adam_test::RefHalfToFloatBits(all[i]))
          << "fp16 pattern " << std::hex << i;
    }
    ASSERT_TRUE(ConvertCpuArray(all.data(), CpuDType::kBFloat16, out.data(),
                                CpuDType::kFloat32, all.size(), v)
                    .ok());
    for (uint32_t i = 0; i < 65536; ++i) {
      ASSERT_EQ(Bits(out[i]), i << 16) << "bf16 pattern " << std::hex << i;
    }
  }
}

// Inputs that exercise each rule: zeros, denormals, the smallest and largest
// normals, infinities, quiet and signalling NaNs, overflow thresholds, and
// for every exponent the patterns just below, at and above each rounding
// midpoint of both 16-bit formats.
std::vector<float> DownConversionInputs() {
  std::vector<uint32_t> bits = {
      0x00000000, 0x80000000, 0x00000001, 0x807fffff, 0x00400000, 0x00800000,
      0x80800000, 0x7f7fffff, 0xff7fffff, 0x7f800000, 0xff800000, 0x7fc00000,
      0xffc00001, 0x7f800001, 0xff80ffff, 0x7fbfffff, 0x477fe000, 0x477fefff,
      0x477ff000, 0x477ff001, 0x477fffff, 0x47800000, 0x38800000, 0x387fffff,
      0x33000000, 0x33000001, 0x32ffffff, 0x33800000, 0x337fffff, 0x33c00000,
      0x7f7f8000, 0x7f7f7fff, 0x7f7f8001, 0x3f808000, 0x3f818000,
  };
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu,
                         0x0fffu, 0x1000u, 0x1001u, 0x3000u, 0x2000u}) {
      for (uint32_t mid : {0x000000u, 0x010000u, 0x7f0000u, 0x3a0000u}) {
        const uint32_t u = (e << 23) | mid | low;
        bits.push_back(u);
        bits.push_back(u | 0x80000000u);
      }
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < (1 << 20); ++i) bits.push_back(rng());
  std::vector<float> out;
  for (uint32_t u : bits) out.push_back(FromBits(u));
  return out;
}

TEST(ConvertTest, DownConversionsRoundToNearestEvenBitExactly) {
  const std::vector<float> in = DownConversionInputs();
  const cpu_adam_test::RefHalfRounder ref_half;
  std::vector<uint16_t> want_half(in.size()), want_bf16(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    want_half[i] = ref_half(in[i]);
    want_bf16[i] = cpu_adam_test::RefBf16(in[i]);
  }
  for (CpuKernelVariant v : cpu_adam_test::SupportedVariants()) {
    SCOPED_TRACE(Name(v));
    std::vector<uint16_t> out(in.size());
    ASSERT_TRUE(ConvertCpuArray(in.data(), CpuDType::kFloat32, out.data(),
                                CpuDType::kFloat16, in.size(), v)
                    .ok());
    for (size_t i = 0; i < in.size(); ++i) {
      ASSERT_EQ(out[i], want_half[i])
          << "fp16 of 0x" << std::hex << Bits(in[i]);
    }
    ASSERT_TRUE(ConvertCpuArray(in.data(), CpuDType::kFloat32, out.data(),
                                CpuDType::kBFloat16, in.size(), v)
                    .ok());
    for (size_t i = 0; i < in.size(); ++i) {
      ASSERT_EQ(out[i], want_bf16[i])
          << "bf16 of 0x" << std::hex << Bits(in[i]);
    }
  }
}

// Every length 0..63 at every offset 0..15: the vector body, the scalar
// tail and unaligned starts must all agree with the reference.
TEST(ConvertTest, TailsAndOffsets) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> src(96);
  for (float& x : src) x = normal(rng);
  const cpu_adam_test::RefHalfRounder ref_half;
  for (CpuKernelVariant v : cpu_adam_test::SupportedVariants()) {
    SCOPED_TRACE(Name(v));
    for (size_t off = 0; off < 16; ++off) {
      for (size_t n = 0; n < 64; ++n) {
        std::vector<uint16_t> h(96, 0xdead), b(96, 0xdead);
        ASSERT_TRUE(ConvertCpuArray(src.data() + off, CpuDType::kFloat32,
                                    h.data() + off, CpuDType::kFloat16, n, v)
                        .ok());
        ASSERT_TRUE(ConvertCpuArray(src.data() + off, CpuDType::kFloat32,
                                    b.data() + off, CpuDType::kBFloat16, n, v)
                        .ok());
        for (size_t i = 0; i < 96; ++i) {
          const bool inside = i >= off && i < off + n;
          ASSERT_EQ(h[i], inside ? ref_half(src[i]) : 0xdead)
              << off << " " << n;
          ASSERT_EQ(b[i], inside ? cpu_adam_test::RefBf16(src[i]) : 0xdead);
        }
      }
    }
  }
}

TEST(ConvertTest, RejectsBadArguments) {
  float f = 1.0f;
  EXPECT_EQ(
      ConvertCpuArray(nullptr, CpuDType::kFloat32, &f, CpuDType::kFloat32, 1)
          .code(),
      StatusCode::kInvalidArgument);
  alignas(4) uint16_t h[4] = {};
  EXPECT_EQ(
      ConvertCpuArray(&f, CpuDType::kFloat32, reinterpret_cast<char*>(h) + 1,
                      CpuDType::kFloat16, 1)
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_TRUE(ConvertCpuArray(nullptr, CpuDType::kFloat32, nullptr,
                              CpuDType::kFloat16, 0)
                  .ok());
}

}  // namespace
}  // namespace strata
