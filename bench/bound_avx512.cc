// The AVX-512 bound: 16 lanes. Built with -mavx512f -mavx512bw -mavx512vl;
// called only after CPUID reports all three.
// GCC 12's avx512fintrin.h makes _mm512_undefined_*() from a self-initialized
// variable, which -Wuninitialized then reports at every inlined use (GCC bug
// 105593); the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#define STRATA_BENCH_BOUND_ISA avx512
#include "bench/bound_impl.h"

namespace strata::bench {
namespace avx512 {
namespace {

inline __m256i Load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
inline void Store256(void* p, __m256i x) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), x);
}
inline __m512i Load512(const void* p) { return _mm512_loadu_si512(p); }
inline void Store512(void* p, __m512i x) { _mm512_storeu_si512(p, x); }

struct Avx512 {
  static constexpr size_t kN = 16;
  static void Fence() { _mm_sfence(); }

  template <int kGradBytes, int kMomentBytes, bool kWork, bool kStream>
  static void BoundAt(const BoundArrays& a, size_t i) {
    uint32_t* p = reinterpret_cast<uint32_t*>(a.master) + i;
    __m512i g;
    if constexpr (kGradBytes == 4) {
      g = Load512(static_cast<const uint32_t*>(a.grad) + i);
    } else {
      g = _mm512_cvtepu16_epi32(
          Load256(static_cast<const uint16_t*>(a.grad) + i));
    }
    const __m512i x = _mm512_add_epi32(Load512(p), g);
    Store512(p, x);
    if constexpr (kMomentBytes == 4) {
      uint32_t* m = static_cast<uint32_t*>(a.m) + i;
      uint32_t* v = static_cast<uint32_t*>(a.v) + i;
      Store512(m, _mm512_xor_si512(Load512(m), g));
      Store512(v, _mm512_add_epi32(Load512(v), g));
    } else {
      uint16_t* m = static_cast<uint16_t*>(a.m) + i;
      uint16_t* v = static_cast<uint16_t*>(a.v) + i;
      const __m256i g16 = _mm512_castsi512_si256(g);
      Store256(m, _mm256_xor_si256(Load256(m), g16));
      Store256(v, _mm256_add_epi16(Load256(v), g16));
    }
    if constexpr (kWork) {
      const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16));
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(a.working + i), h);
      } else {
        Store256(a.working + i, h);
      }
    }
  }
};

}  // namespace
}  // namespace avx512

void BoundAvx512(const BoundArrays& a, size_t begin, size_t end) {
  avx512::Bound<avx512::Avx512>(a, begin, end);
}

}  // namespace strata::bench
