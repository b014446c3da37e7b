// An independent reference for fp32 -> fp16/bf16 rounding, used to check the
// backends bit for bit: it decodes every 16-bit pattern from its fields
// into a double and picks the nearest by exact comparison (ties to the even
// pattern), sharing nothing with gpu/cpu_kernels.cc's bit tricks.
#ifndef STRATA_TESTS_GPU_CONVERSION_REFERENCE_H_
#define STRATA_TESTS_GPU_CONVERSION_REFERENCE_H_

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "strata/device.h"

namespace strata::testing {

struct Format16 {
  int mant_bits;        // 10 for fp16, 7 for bf16
  int bias;             // 15, 127
  uint16_t max_finite;  // 0x7bff, 0x7f7f
  uint16_t inf;         // 0x7c00, 0x7f80
};
inline constexpr Format16 kHalf{10, 15, 0x7bff, 0x7c00};
inline constexpr Format16 kBf16{7, 127, 0x7f7f, 0x7f80};

inline const Format16& FormatOf(ElementType t) {
  return t == ElementType::kFloat16 ? kHalf : kBf16;
}

// The value of a 16-bit pattern (NaN for NaN patterns).
inline double Decode16(uint16_t bits, const Format16& f) {
  const int exp_bits = 15 - f.mant_bits;
  const int e = (bits >> f.mant_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << f.mant_bits) - 1);
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (e == (1 << exp_bits) - 1) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - f.bias - f.mant_bits);
  return sign * std::ldexp((1 << f.mant_bits) + m, e - f.bias - f.mant_bits);
}

// Round-to-nearest-even of x to the format; NaN -> 0x7fff.
inline uint16_t Round16(float x, const Format16& f) {
  if (std::isnan(x)) return 0x7fff;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double ax = std::fabs(static_cast<double>(x));
  // Largest pattern p in [0, max_finite] with Decode16(p) <= ax (positive
  // patterns are ordered like their values).
  uint32_t lo = 0, hi = f.max_finite;
  if (ax >= Decode16(f.max_finite, f)) {
    lo = f.max_finite;
  } else {
    while (lo < hi) {
      const uint32_t mid = (lo + hi + 1) / 2;
      if (Decode16(static_cast<uint16_t>(mid), f) <= ax) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
  }
  const double below = Decode16(static_cast<uint16_t>(lo), f);
  // Above the largest finite value the next "pattern" is infinity, placed
  // one ulp further for rounding purposes.
  const double above =
      lo == f.max_finite
          ? below + (below - Decode16(static_cast<uint16_t>(lo - 1), f))
          : Decode16(static_cast<uint16_t>(lo + 1), f);
  if (ax == below) return sign | static_cast<uint16_t>(lo);
  const uint32_t up = lo == f.max_finite ? f.inf : lo + 1;
  if (ax - below < above - ax) return sign | static_cast<uint16_t>(lo);
  if (ax - below > above - ax || std::isinf(x)) {
    return sign | static_cast<uint16_t>(up);
  }
  return sign | static_cast<uint16_t>((lo & 1) ? up : lo);  // tie: even
}

// Inputs that hit every rounding case: each 16-bit value, the midpoints
// between neighbours (exact in fp32) and one fp32 ulp either side, the
// overflow and underflow edges, and random bit patterns.
inline std::vector<float> TrickyFloats(const Format16& f) {
  std::vector<float> v = {0.0f,    -0.0f,         INFINITY,      -INFINITY,
                          NAN,     65504.0f,      65519.99f,     65520.0f,
                          1e-8f,   2.9802322e-8f, 5.9604645e-8f, 3.4028235e38f,
                          1.0e-45f};
  for (uint32_t p = 0; p < 0x7fff; ++p) {
    const double a = Decode16(static_cast<uint16_t>(p), f);
    const double b = Decode16(static_cast<uint16_t>(p + 1), f);
    if (std::isnan(a) || std::isinf(b) || std::isnan(b)) continue;
    const float mid = static_cast<float>((a + b) / 2);
    for (float x : {static_cast<float>(a), mid, std::nextafter(mid, 0.0f),
                    std::nextafter(mid, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 100000; ++i)
    v.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  return v;
}

}  // namespace strata::testing

#endif  // STRATA_TESTS_GPU_CONVERSION_REFERENCE_H_
