// The AVX-512 kernel tables, compiled from cpu_adam/kernels_avx512.cc over
// SIMDe's portable AVX-512 (every _mm512_* call becomes plain C++ over
// AVX2), so that cpu_adam_emulated_test runs the AVX-512 variants' code on
// any AVX2 host and checks it against the scalar reference, as
// cpu_adam_test does on an AVX-512 host. What the emulation cannot check is
// the hardware's own reading of each instruction; it checks everything the
// kernels build from them: lane orders, permute indices, masks, tails.
//
// Linked into that test program ahead of libstrata_cpu_adam.a, this file's
// Avx512Kernels, Avx512Bf16Kernels and ReportCpuAvx512 are the ones the
// program uses, so the archive's kernels_avx512.o and cpu_support.o are
// never pulled in.
//
// SIMDe 0.7 has no portable form of the intrinsics below; each is written
// from the definition in Intel's intrinsics guide, one lane at a time.
#include <cstddef>
#include <cstdint>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#include "tests/cpu_adam/test_util.h"

namespace strata_emulated {

using strata::cpu_adam_test::Bits;

template <class T, class V>
inline void ToLanes(T* out, const V& v) {
  static_assert(sizeof(V) % sizeof(T) == 0);
  std::memcpy(out, &v, sizeof(V));
}

template <class V, class T>
inline V FromLanes(const T* in) {
  V v;
  std::memcpy(&v, in, sizeof(V));
  return v;
}

// Every lane of Out (of type O) from the lane of In (of type I) at the same
// index, by f: the widening and narrowing conversions.
template <class Out, class O, class I, class In, class Fn>
inline Out MapLanes(const In& a, Fn f) {
  constexpr size_t kLanes = sizeof(Out) / sizeof(O);
  static_assert(kLanes <= sizeof(In) / sizeof(I));
  I in[sizeof(In) / sizeof(I)];
  O out[kLanes];
  ToLanes(in, a);
  for (size_t i = 0; i < kLanes; ++i) out[i] = f(in[i]);
  return FromLanes<Out>(out);
}

inline simde__m512i CvtEpu8Epi16(simde__m256i a) {
  return MapLanes<simde__m512i, uint16_t, uint8_t>(
      a, [](uint8_t x) { return uint16_t{x}; });
}

inline simde__m512i CvtEpu16Epi32(simde__m256i a) {
  return MapLanes<simde__m512i, uint32_t, uint16_t>(
      a, [](uint16_t x) { return uint32_t{x}; });
}

// Unsigned saturation of unsigned words to bytes.
inline simde__m256i CvtUsEpi16Epi8(simde__m512i a) {
  return MapLanes<simde__m256i, uint8_t, uint16_t>(
      a, [](uint16_t x) { return static_cast<uint8_t>(x > 255 ? 255 : x); });
}

inline simde__m512d CvtPsPd(simde__m256 a) {
  return MapLanes<simde__m512d, double, float>(
      a, [](float x) { return double{x}; });
}

inline simde__m256 ExtractF32x8(simde__m512 a, int imm) {
  float in[16];
  ToLanes(in, a);
  return FromLanes<simde__m256>(in + 8 * (imm & 1));
}

// In the order GCC's avx512fintrin.h adds them: the high 256 bits onto the
// low, then the high 128 onto the low, then the two lanes.
inline double ReduceAddPd(simde__m512d a) {
  double l[8];
  ToLanes(l, a);
  double t[4];
  for (int i = 0; i < 4; ++i) t[i] = l[4 + i] + l[i];
  const double u0 = t[2] + t[0];
  const double u1 = t[3] + t[1];
  return u0 + u1;
}

inline int ReduceMaxEpi32(simde__m512i a) {
  int32_t l[16];
  ToLanes(l, a);
  int32_t m = l[0];
  for (int i = 1; i < 16; ++i) m = l[i] > m ? l[i] : m;
  return m;
}

inline simde__mmask16 TestnEpi32Mask(simde__m512i a, simde__m512i b) {
  uint32_t x[16], y[16];
  ToLanes(x, a);
  ToLanes(y, b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= ((x[i] & y[i]) == 0 ? 1u : 0u) << i;
  return static_cast<simde__mmask16>(k);
}

// imm8: 0x01 QNaN, 0x02 +0, 0x04 -0, 0x08 +inf, 0x10 -inf, 0x20 denormal,
// 0x40 finite negative, 0x80 SNaN.
inline simde__mmask16 FpclassPsMask(simde__m512 a, int imm) {
  float l[16];
  ToLanes(l, a);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = Bits(l[i]);
    const bool neg = (u >> 31) != 0;
    const uint32_t e = (u >> 23) & 0xff;
    const uint32_t f = u & 0x7fffff;
    const bool qnan = e == 0xff && f != 0 && (f & 0x400000) != 0;
    const bool snan = e == 0xff && f != 0 && (f & 0x400000) == 0;
    const bool zero = e == 0 && f == 0;
    const bool inf = e == 0xff && f == 0;
    const bool den = e == 0 && f != 0;
    const bool finite_neg = neg && e != 0xff;
    const bool hit = ((imm & 0x01) && qnan) || ((imm & 0x02) && zero && !neg) ||
                     ((imm & 0x04) && zero && neg) ||
                     ((imm & 0x08) && inf && !neg) ||
                     ((imm & 0x10) && inf && neg) || ((imm & 0x20) && den) ||
                     ((imm & 0x40) && finite_neg) || ((imm & 0x80) && snan);
    k |= (hit ? 1u : 0u) << i;
  }
  return static_cast<simde__mmask16>(k);
}

// VCVTNEPS2BF16, as Intel defines convert_fp32_to_bfloat16: zeros and
// denormals to a signed zero, infinities truncated, NaNs truncated and
// quieted, normals rounded to nearest even.
inline simde__m256i CvtnePsPbh(simde__m512 a) {
  return MapLanes<simde__m256i, uint16_t, float>(a, [](float x) {
    const uint32_t u = Bits(x);
    const uint32_t e = (u >> 23) & 0xff;
    const uint32_t f = u & 0x7fffff;
    if (e == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);
    if (e == 0xff && f == 0) return static_cast<uint16_t>(u >> 16);
    if (e == 0xff) return static_cast<uint16_t>((u >> 16) | 0x40);
    const uint32_t bias = 0x7fff + ((u >> 16) & 1);
    return static_cast<uint16_t>((u + bias) >> 16);
  });
}

// F16C's conversions, on each 256-bit half.
inline simde__m512 CvtPhPs(simde__m256i a) {
  simde__m128i h[2];
  ToLanes(h, a);
  simde__m256 f[2] = {simde_mm256_cvtph_ps(h[0]), simde_mm256_cvtph_ps(h[1])};
  return FromLanes<simde__m512>(f);
}

template <int kImm>
inline simde__m256i CvtPsPh(simde__m512 a) {
  simde__m256 f[2];
  ToLanes(f, a);
  simde__m128i h[2] = {simde_mm256_cvtps_ph(f[0], kImm),
                       simde_mm256_cvtps_ph(f[1], kImm)};
  return FromLanes<simde__m256i>(h);
}

}  // namespace strata_emulated

#define _mm512_cvtepu8_epi16 strata_emulated::CvtEpu8Epi16
#define _mm512_cvtepu16_epi32 strata_emulated::CvtEpu16Epi32
#define _mm512_cvtusepi16_epi8 strata_emulated::CvtUsEpi16Epi8
#define _mm512_cvtps_pd strata_emulated::CvtPsPd
#define _mm512_extractf32x8_ps strata_emulated::ExtractF32x8
#define _mm512_reduce_add_pd strata_emulated::ReduceAddPd
#define _mm512_reduce_max_epi32 strata_emulated::ReduceMaxEpi32
#define _mm512_testn_epi32_mask strata_emulated::TestnEpi32Mask
#define _mm512_fpclass_ps_mask strata_emulated::FpclassPsMask
#define _mm512_cvtneps_pbh strata_emulated::CvtnePsPbh
#define _mm512_cvtph_ps strata_emulated::CvtPhPs
#define _mm512_cvtps_ph(a, imm) strata_emulated::CvtPsPh<(imm)>(a)

#define STRATA_CPU_ADAM_ISA avx512_emulated
#include "cpu_adam/kernels_avx512.cc"

namespace strata::cpu_adam {

// Both AVX-512 variants, whatever the CPU: their tables above run over
// SIMDe. CpuKernelVariantSupported still asks for AVX2, FMA and F16C, which
// the emulation itself is built with (-mavx2 -mfma -mf16c).
CpuAvx512Report ReportCpuAvx512() { return {true, true}; }

}  // namespace strata::cpu_adam
