// The AVX-512 variants: 16 lanes. Built with -mavx512f/bw/vl/dq/bf16 (and
// FMA, F16C). Two tables: kAvx512 rounds fp32 -> bf16 in integer arithmetic
// (ToBf16Split); kAvx512Bf16 uses VCVTNEPS2BF16, whose results are the same
// by contract (FloatToBf16 flushes denormals as the instruction does). The
// driver hands out the second only where the CPU reports avx512bf16.
// GCC 12's avx512fintrin.h makes _mm512_undefined_*() from a self-initialized
// variable, which -Wuninitialized then reports at every inlined use (GCC bug
// 105593); the warning is about the header, not this code. Clang has no
// -Wmaybe-uninitialized and warns about the unknown group, so GCC only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

// tests/cpu_adam/avx512_emulated.cc compiles this file again over portable
// code, in a namespace of its own.
#ifndef STRATA_CPU_ADAM_ISA
#define STRATA_CPU_ADAM_ISA avx512
#endif
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam::STRATA_CPU_ADAM_ISA {
namespace {

// The top 16 bits of each 32-bit lane, in order: one word permute, where a
// shift and a narrowing move (two uops) took more.
inline __m256i HighWords(__m512i r) {
  const __m512i odd = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  //
      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, r));
}

// Every lane rounded to nearest even as a normal value (add 0x7fff plus the
// lowest kept bit): FloatToBf16's contract for normals, zeros and
// infinities, the result in each lane's top 16 bits.
inline __m512i RoundAsNormal(__m512i u) {
  const __m512i lsb =
      _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

// The contract for the lanes RoundAsNormal gets wrong, out of line: NaNs
// quieted (their top payload kept), denormals flushed to signed zero; `r`
// is RoundAsNormal of x.
[[gnu::noinline]] __m256i Bf16FixSpecial(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 den =
      _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  r = _mm512_mask_and_epi32(r, den, u,
                            _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return HighWords(r);
}

// FloatToBf16's contract in two steps, as the AVX2 variant does (Note [bf16
// rounding in two steps] in kernels_avx2.cc): every lane rounded as if
// normal, and the NaN and denormal lanes mended only where one fpclass
// finds any (QNaN 0x01, denormal 0x20, SNaN 0x80). Nine operations per 16
// lanes become five, the fpclass and a branch: in cache on one Zen 5 core,
// bf16-moment AdamW 2.97-2.99 -> 3.47-3.50 G params/s, fp32-moment
// 4.13-4.30 -> 4.59-4.71 (docs/cpu_adam.md, "AVX2's bf16 rounding in two
// steps"). On Zen 4, which splits 512-bit operations, a check on the
// packed results had gained nothing.
inline __m256i ToBf16Split(__m512 x) {
  const __m512i r = RoundAsNormal(_mm512_castps_si512(x));
  if (_mm512_fpclass_ps_mask(x, 0xa1) != 0) [[unlikely]] {
    return Bf16FixSpecial(x, r);
  }
  return HighWords(r);
}

inline __m256i ToBf16Hw(__m512 x) {
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}

inline __m256i ToF16(__m512 x) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline __m256i Load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
inline void Store256(void* p, __m256i x) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), x);
}

template <bool kHwBf16>
struct Avx512 {
  using F = __m512;
  struct D {
    __m512d lo, hi;
  };
  using Bad = __mmask16;
  static constexpr size_t kN = 16;
  // Note [Partial lines of the working copy] (kernel_impl.h): every row
  // that does not start on a line takes its scalar head.
  static constexpr size_t kStreamHeadMinElems = 0;

  static __m256i ToBf16(F x) {
    if constexpr (kHwBf16) {
      return ToBf16Hw(x);
    } else {
      return ToBf16Split(x);
    }
  }

  static F Set(float x) { return _mm512_set1_ps(x); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static F Load(const F16* p) { return _mm512_cvtph_ps(Load256(p)); }
  static F Load(const Bf16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(Load256(p)), 16));
  }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void Store(F16* p, F x) { Store256(p, ToF16(x)); }
  static void Store(Bf16* p, F x) { Store256(p, ToBf16(x)); }
  // REQUIRES: p is 32-byte aligned (StreamHead).
  static void Stream(F16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), ToF16(x));
  }
  static void Stream(Bf16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), ToBf16(x));
  }
  static void Fence() { _mm_sfence(); }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F Sign(F a) {
    const F zero = _mm512_setzero_ps();
    const __mmask16 pos = _mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ);
    const __mmask16 neg = _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ);
    const F r = _mm512_mask_mov_ps(zero, pos, _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(r, neg, _mm512_set1_ps(-1.0f));
  }

  using I = __m512i;
  static I ISet(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I IBits(F x) { return _mm512_castps_si512(x); }
  static F FBits(I x) { return _mm512_castsi512_ps(x); }
  static I IMin(I a, I b) { return _mm512_min_epi32(a, b); }
  static I IMax(I a, I b) { return _mm512_max_epi32(a, b); }
  static uint32_t IMaxAll(I a) {
    return static_cast<uint32_t>(_mm512_reduce_max_epi32(a));
  }

  // 32 lanes of 16 bits: two F's worth.
  using H = __m512i;
  static constexpr size_t kH = 32;
  static H HSet(uint16_t x) { return _mm512_set1_epi16(static_cast<short>(x)); }
  static H HAnd(H a, H b) { return _mm512_and_si512(a, b); }
  static H HOr(H a, H b) { return _mm512_or_si512(a, b); }
  static H HAdd(H a, H b) { return _mm512_add_epi16(a, b); }
  static H HSubSat(H a, H b) { return _mm512_subs_epu16(a, b); }
  template <int k>
  static H HSrl(H a) {
    return _mm512_srli_epi16(a, k);
  }
  template <int k>
  static H HSll(H a) {
    return _mm512_slli_epi16(a, k);
  }
  static H HMin(H a, H b) { return _mm512_min_epi16(a, b); }
  static H HMax(H a, H b) { return _mm512_max_epi16(a, b); }
  static H HZeroIfZero(H c, H t) {
    return _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(c, c), t);
  }
  static H HLoad(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static void HStore(uint16_t* p, H h) { _mm512_storeu_si512(p, h); }
  static H HLoadU8(const uint8_t* p) {
    return _mm512_cvtepu8_epi16(Load256(p));
  }
  static void HStoreU8(uint8_t* p, H c) {
    Store256(p, _mm512_cvtusepi16_epi8(c));
  }
  // One two-source word permute (odd words of x[0], then of x[1]); measured
  // faster on Zen 4 than two shifts, a pack and a qword permute.
  static H HTop(const F* x) {
    const __m512i odd = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
        27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(x[0]), odd,
                                     _mm512_castps_si512(x[1]));
  }
  // One zero-masked word permute (each of 16 words under a zero word);
  // measured faster on Zen 4 than a widening move and a shift.
  template <int k>
  static F HWiden(H h) {
    static_assert(k == 0 || k == 1);
    const __m512i idx = _mm512_set_epi16(
        16 * k + 15, 0, 16 * k + 14, 0, 16 * k + 13, 0, 16 * k + 12, 0,
        16 * k + 11, 0, 16 * k + 10, 0, 16 * k + 9, 0, 16 * k + 8, 0,
        16 * k + 7, 0, 16 * k + 6, 0, 16 * k + 5, 0, 16 * k + 4, 0, 16 * k + 3,
        0, 16 * k + 2, 0, 16 * k + 1, 0, 16 * k, 0);
    return _mm512_castsi512_ps(
        _mm512_maskz_permutexvar_epi16(0xaaaaaaaau, idx, h));
  }

  // The 16 lanes widened to double, in lane order.
  struct DL {
    __m512d lo, hi;
  };
  static DL Widen(F x) {
    return {_mm512_cvtps_pd(_mm512_castps512_ps256(x)),
            _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1))};
  }
  static DL DLZero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static DL DLAdd(DL acc, F x) {
    const DL w = Widen(x);
    return {_mm512_add_pd(acc.lo, w.lo), _mm512_add_pd(acc.hi, w.hi)};
  }
  static DL DLSq(DL acc, F x) {
    const DL w = Widen(x);
    return {_mm512_fmadd_pd(w.lo, w.lo, acc.lo),
            _mm512_fmadd_pd(w.hi, w.hi, acc.hi)};
  }
  static DL DLLoad(const double* p) {
    return {_mm512_loadu_pd(p), _mm512_loadu_pd(p + 8)};
  }
  static void DLStore(double* p, DL acc) {
    _mm512_storeu_pd(p, acc.lo);
    _mm512_storeu_pd(p + 8, acc.hi);
  }
  static void DPut(double* p, F x) { DLStore(p, Widen(x)); }
  static void DAccum(double* p, F x) {
    const DL w = Widen(x);
    _mm512_storeu_pd(p, _mm512_add_pd(_mm512_loadu_pd(p), w.lo));
    _mm512_storeu_pd(p + 8, _mm512_add_pd(_mm512_loadu_pd(p + 8), w.hi));
  }

  static D DZero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static D SqAcc(D acc, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    return {_mm512_fmadd_pd(lo, lo, acc.lo), _mm512_fmadd_pd(hi, hi, acc.hi)};
  }
  static double DSum(D acc) {
    return _mm512_reduce_add_pd(_mm512_add_pd(acc.lo, acc.hi));
  }
  static Bad BadZero() { return 0; }
  static Bad BadOr(Bad bad, F x) {
    const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), exp_mask);
    return static_cast<Bad>(bad | _mm512_cmpeq_epi32_mask(e, exp_mask));
  }
  static bool BadAny(Bad bad) { return bad != 0; }
};

}  // namespace
}  // namespace strata::cpu_adam::STRATA_CPU_ADAM_ISA

namespace strata::cpu_adam {

const KernelTable& Avx512Kernels() {
  static const KernelTable table =
      STRATA_CPU_ADAM_ISA::MakeTable<STRATA_CPU_ADAM_ISA::Avx512<false>>(
          CpuKernelVariant::kAvx512);
  return table;
}

const KernelTable& Avx512Bf16Kernels() {
  static const KernelTable table =
      STRATA_CPU_ADAM_ISA::MakeTable<STRATA_CPU_ADAM_ISA::Avx512<true>>(
          CpuKernelVariant::kAvx512Bf16);
  return table;
}

}  // namespace strata::cpu_adam
