// The rounding cores of fp32 <-> fp16/bf16, shared by the CPU optimizer
// kernels (cpu_adam/) and the host-emulated device (gpu/).
//
// They cover finite values and infinities. NaN and fp32-denormal policy stays
// with each caller, because each must match different hardware: x86's
// conversion instructions keep NaN payloads and VCVTNEPS2BF16 flushes
// denormals, CUDA's intrinsics return a canonical NaN and keep denormals.
//
// Internal linkage (static) on purpose: cpu_adam compiles this header once
// per instruction set, and an inline function with external linkage could be
// merged across those objects, letting scalar code run AVX-512 instructions.
#ifndef STRATA_UTIL_HALF_H_
#define STRATA_UTIL_HALF_H_

#include <cstdint>

namespace strata {

// |x| as fp32 bits (REQUIRES: not NaN) to fp16 magnitude bits: round to
// nearest even, subnormals kept, overflow to infinity.
static constexpr uint16_t HalfMagnitudeFromFloatBits(uint32_t a) {
  // 65520 = 0x477ff000 is halfway between 65504 (odd mantissa) and 2^16,
  // so it and everything above round to infinity.
  if (a >= 0x477ff000u) return 0x7c00u;
  if (a >= 0x38800000u) {  // >= 2^-14: a normal half
    // Rebias the exponent 127 -> 15 and round 13 bits away; a carry out of
    // the mantissa correctly bumps the exponent.
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>((r + 0x0fffu + ((r >> 13) & 1u)) >> 13);
  }
  // At or below 2^-25, half the smallest subnormal (a tie rounds to the even
  // zero): zero.
  if (a <= 0x33000000u) return 0;
  // Subnormal half: the value in units of 2^-24 is mant * 2^(e - 126).
  const uint32_t e = a >> 23;  // 102..112
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return static_cast<uint16_t>(q);
}

// fp16 magnitude bits (REQUIRES: exponent field below 31, i.e. finite) to
// fp32 magnitude bits. Exact.
static constexpr uint32_t FloatBitsFromHalfMagnitude(uint16_t h) {
  uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return 0;
    e = 113;  // 127 - 15 + 1, lowered once per normalizing shift
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    return (e << 23) | ((m & 0x3ffu) << 13);
  }
  return ((e + 112) << 23) | (m << 13);
}

// fp32 bits (REQUIRES: not NaN) to bf16 bits, round to nearest even: adding
// 0x7fff plus the lowest kept bit rounds; a carry into the exponent is the
// correct result, up to infinity.
static constexpr uint16_t Bf16FromFloatBits(uint32_t u) {
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace strata

#endif  // STRATA_UTIL_HALF_H_
