#include "gpu/cpu_kernels.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tests/gpu/conversion_reference.h"

namespace strata::internal {
namespace {

using strata::testing::Decode16;
using strata::testing::kBf16;
using strata::testing::kHalf;
using strata::testing::Round16;
using strata::testing::TrickyFloats;

TEST(CpuKernelsTest, FloatToHalfMatchesReference) {
  for (float x : TrickyFloats(kHalf)) {
    const uint16_t want = Round16(x, kHalf);
    ASSERT_EQ(FloatToHalfBits(x), want)
        << "x=" << x << " bits=" << std::hex << std::bit_cast<uint32_t>(x);
  }
}

TEST(CpuKernelsTest, FloatToBFloat16MatchesReference) {
  for (float x : TrickyFloats(kBf16)) {
    const uint16_t want = Round16(x, kBf16);
    ASSERT_EQ(FloatToBFloat16Bits(x), want)
        << "x=" << x << " bits=" << std::hex << std::bit_cast<uint32_t>(x);
  }
}

TEST(CpuKernelsTest, SixteenBitToFloatIsExactForEveryPattern) {
  for (uint32_t p = 0; p <= 0xffff; ++p) {
    const auto h = static_cast<uint16_t>(p);
    const double want_h = Decode16(h, kHalf);
    const double want_b = Decode16(h, kBf16);
    const float got_h = HalfBitsToFloat(h);
    const float got_b = BFloat16BitsToFloat(h);
    if (std::isnan(want_h)) {
      EXPECT_TRUE(std::isnan(got_h)) << p;
    } else {
      ASSERT_EQ(got_h, want_h) << p;
      ASSERT_EQ(std::signbit(got_h), std::signbit(want_h)) << p;
      ASSERT_EQ(FloatToHalfBits(got_h), h) << "round trip " << p;
    }
    if (std::isnan(want_b)) {
      EXPECT_TRUE(std::isnan(got_b)) << p;
    } else {
      ASSERT_EQ(got_b, want_b) << p;
      ASSERT_EQ(FloatToBFloat16Bits(got_b), h) << "round trip " << p;
    }
  }
}

TEST(CpuKernelsTest, GemmArgumentChecks) {
  GemmArgs g;
  g.m = 4;
  g.n = 3;
  g.k = 2;
  g.lda = 4;
  g.ldb = 2;
  g.ldc = 4;
  EXPECT_TRUE(CheckGemmArgs(g).ok());
  g.lda = 3;
  EXPECT_EQ(CheckGemmArgs(g).code(), StatusCode::kInvalidArgument);
  g.lda = 4;
  g.ab_type = ElementType::kFloat16;
  g.c_type = ElementType::kBFloat16;
  EXPECT_EQ(CheckGemmArgs(g).code(), StatusCode::kNotSupported);
  EXPECT_EQ(MatrixSpanBytes(4, 3, 5, 2), (5u * 2 + 4) * 2);
}

}  // namespace
}  // namespace strata::internal
