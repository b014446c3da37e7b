// Shared helpers of the cpu_adam tests: the variants this CPU can run, bit
// views of floats, and references for the 16-bit formats built by a method
// independent of cpu_adam's (value arithmetic in double, not bit tricks).
#ifndef STRATA_TESTS_CPU_ADAM_TEST_UTIL_H_
#define STRATA_TESTS_CPU_ADAM_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>

#include "strata/cpu_adam.h"

namespace strata::cpu_adam_test {

inline std::vector<CpuKernelVariant> SupportedVariants() {
  std::vector<CpuKernelVariant> out;
  for (CpuKernelVariant v :
       {CpuKernelVariant::kScalar, CpuKernelVariant::kAvx2,
        CpuKernelVariant::kAvx512, CpuKernelVariant::kAvx512Bf16}) {
    if (CpuKernelVariantSupported(v)) out.push_back(v);
  }
  return out;
}

inline uint32_t Bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float FromBits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The value of a binary16 pattern, from its definition.
inline double HalfValue(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  if (e == 31) return m ? NAN : sign * INFINITY;
  return sign * std::ldexp(1.0 + m / 1024.0, e - 15);
}

// Reference fp16 -> fp32: the value, and NaNs quieted with payload kept.
inline uint32_t RefHalfToFloatBits(uint16_t h) {
  if (((h >> 10) & 0x1f) == 31 && (h & 0x3ff) != 0) {
    return (uint32_t{h & 0x8000u} << 16) | 0x7fc00000u |
           (uint32_t{h & 0x3ffu} << 13);
  }
  return Bits(static_cast<float>(HalfValue(h)));
}

// Reference fp32 -> fp16 by nearest-value search over all finite halves,
// ties to the even pattern; overflow past 65520 to inf; NaN quieted with the
// top 9 payload bits kept.
class RefHalfRounder {
 public:
  RefHalfRounder() {
    for (uint32_t h = 0; h < 0x7c00; ++h) values_.push_back(HalfValue(h));
  }
  uint16_t operator()(float x) const {
    const uint32_t u = Bits(x);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    if (std::isnan(x)) {
      return static_cast<uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x1ffu));
    }
    const double a = std::fabs(static_cast<double>(x));
    if (a >= 65520.0) return sign | 0x7c00u;
    auto it = std::lower_bound(values_.begin(), values_.end(), a);
    size_t hi = static_cast<size_t>(it - values_.begin());
    if (hi < values_.size() && values_[hi] == a) {
      return static_cast<uint16_t>(sign | hi);
    }
    if (hi == values_.size()) return static_cast<uint16_t>(sign | (hi - 1));
    const size_t lo = hi - 1;
    const double dl = a - values_[lo], dh = values_[hi] - a;
    size_t pick = dl < dh ? lo : (dh < dl ? hi : ((lo & 1) ? hi : lo));
    return static_cast<uint16_t>(sign | pick);
  }

 private:
  std::vector<double> values_;  // index = pattern, increasing
};

// Reference fp32 -> bf16: nearest of the two neighbouring bf16 values
// (compared in double), ties to even; denormals to signed zero; NaN quieted.
inline uint16_t RefBf16(float x) {
  const uint32_t u = Bits(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  if (std::isinf(x)) return static_cast<uint16_t>(u >> 16);
  if (std::fpclassify(x) == FP_SUBNORMAL || x == 0.0f) {
    return static_cast<uint16_t>((u >> 16) & 0x8000u);
  }
  const uint32_t lo = u & 0xffff0000u;  // toward zero
  const uint32_t hi = lo + 0x10000u;    // away from zero (may be inf)
  const double a = std::fabs(static_cast<double>(x));
  const double dl = a - std::fabs(static_cast<double>(FromBits(lo)));
  const double vh = std::fabs(static_cast<double>(FromBits(hi)));
  // The value one bf16 step above the largest finite one is 2^128.
  const double dh = (std::isinf(vh) ? std::ldexp(1.0, 128) : vh) - a;
  const uint32_t pick =
      dl < dh ? lo : (dh < dl ? hi : (((lo >> 16) & 1) ? hi : lo));
  return static_cast<uint16_t>(pick >> 16);
}

// Raw float32 files exchanged with the Python references.
inline void WriteFloats(const std::filesystem::path& path,
                        const std::vector<float>& v) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(v.data()),
            static_cast<std::streamsize>(v.size() * sizeof(float)));
  ASSERT_TRUE(out.good()) << path;
}

inline std::vector<float> ReadFloats(const std::filesystem::path& path,
                                     size_t n) {
  std::vector<float> v(n);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()),
          static_cast<std::streamsize>(n * sizeof(float)));
  EXPECT_TRUE(in.good()) << path;
  return v;
}

}  // namespace strata::cpu_adam_test

#endif  // STRATA_TESTS_CPU_ADAM_TEST_UTIL_H_
