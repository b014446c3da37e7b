// The AVX2 bound: 8 lanes. Built with -mavx2; called only after CPUID
// reports AVX2.
#include <immintrin.h>

#define STRATA_BENCH_BOUND_ISA avx2
#include "bench/bound_impl.h"

namespace strata::bench {
namespace avx2 {
namespace {

inline __m128i Load128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}

struct Avx2 {
  static constexpr size_t kN = 8;
  static void Fence() { _mm_sfence(); }

  template <int kGradBytes, int kMomentBytes, bool kWork, bool kStream>
  static void BoundAt(const BoundArrays& a, size_t i) {
    __m256i* p = reinterpret_cast<__m256i*>(a.master + i);
    __m256i g;
    if constexpr (kGradBytes == 4) {
      g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const uint32_t*>(a.grad) + i));
    } else {
      g = _mm256_cvtepu16_epi32(
          Load128(static_cast<const uint16_t*>(a.grad) + i));
    }
    const __m256i x = _mm256_add_epi32(_mm256_loadu_si256(p), g);
    _mm256_storeu_si256(p, x);
    if constexpr (kMomentBytes == 4) {
      __m256i* m = reinterpret_cast<__m256i*>(static_cast<uint32_t*>(a.m) + i);
      __m256i* v = reinterpret_cast<__m256i*>(static_cast<uint32_t*>(a.v) + i);
      _mm256_storeu_si256(m, _mm256_xor_si256(_mm256_loadu_si256(m), g));
      _mm256_storeu_si256(v, _mm256_add_epi32(_mm256_loadu_si256(v), g));
    } else {
      __m128i* m = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.m) + i);
      __m128i* v = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.v) + i);
      const __m128i g16 = _mm256_castsi256_si128(g);
      _mm_storeu_si128(m, _mm_xor_si128(_mm_loadu_si128(m), g16));
      _mm_storeu_si128(v, _mm_add_epi16(_mm_loadu_si128(v), g16));
    }
    if constexpr (kWork) {
      __m256i h = _mm256_packus_epi32(_mm256_srli_epi32(x, 16),
                                      _mm256_srli_epi32(x, 16));
      h = _mm256_permute4x64_epi64(h, 0x08);
      __m128i* w = reinterpret_cast<__m128i*>(a.working + i);
      if constexpr (kStream) {
        _mm_stream_si128(w, _mm256_castsi256_si128(h));
      } else {
        _mm_storeu_si128(w, _mm256_castsi256_si128(h));
      }
    }
  }
};

}  // namespace
}  // namespace avx2

void BoundAvx2(const BoundArrays& a, size_t begin, size_t end) {
  avx2::Bound<avx2::Avx2>(a, begin, end);
}

}  // namespace strata::bench
