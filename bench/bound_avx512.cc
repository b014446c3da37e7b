// The AVX-512 bound: 64-byte registers. Built with -mavx512f -mavx512bw
// -mavx512vl; called only after CPUID reports all three.
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

struct Avx512 {
  using R = __m512i;
  static constexpr size_t kVec = 64;
  static R Zero() { return _mm512_setzero_si512(); }
  static R Load(const void* p) { return _mm512_loadu_si512(p); }
  static void Store(void* p, R r) { _mm512_storeu_si512(p, r); }
  // REQUIRES: p is 64-byte aligned.
  static void StreamStore(void* p, R r) {
    _mm512_stream_si512(static_cast<__m512i*>(p), r);
  }
  template <size_t kBytes>
  static R LoadPart(const void* p) {
    if constexpr (kBytes == 64) {
      return Load(p);
    } else if constexpr (kBytes == 32) {
      return _mm512_castsi256_si512(
          _mm256_loadu_si256(static_cast<const __m256i*>(p)));
    } else {
      static_assert(kBytes == 16);
      return _mm512_castsi128_si512(
          _mm_loadu_si128(static_cast<const __m128i*>(p)));
    }
  }
  template <size_t kBytes>
  static void StorePart(void* p, R r) {
    if constexpr (kBytes == 64) {
      Store(p, r);
    } else if constexpr (kBytes == 32) {
      _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_castsi512_si256(r));
    } else {
      static_assert(kBytes == 16);
      _mm_storeu_si128(static_cast<__m128i*>(p), _mm512_castsi512_si128(r));
    }
  }
  template <size_t kBytes>
  static void StreamStorePart(void* p, R r) {
    if constexpr (kBytes == 64) {
      StreamStore(p, r);
    } else if constexpr (kBytes == 32) {
      _mm256_stream_si256(static_cast<__m256i*>(p), _mm512_castsi512_si256(r));
    } else {
      static_assert(kBytes == 16);
      _mm_stream_si128(static_cast<__m128i*>(p), _mm512_castsi512_si128(r));
    }
  }
  static void Keep(R& r) { asm volatile("" : "+v"(r)); }
  static void Use(R r) { asm volatile("" : : "v"(r)); }
  static void Fence() { _mm_sfence(); }
};

}  // namespace
}  // namespace avx512

void BoundAvx512Fused(const BoundArrays& a, size_t begin, size_t end,
                      size_t ahead, size_t chunk) {
  avx512::FusedChunk<avx512::Avx512>(a, begin, end, ahead, chunk);
}
void BoundAvx512Stream(const BoundArrays& a, size_t begin, size_t end) {
  avx512::Stream<avx512::Avx512>(a, begin, end);
}
void BoundAvx512Step(const BoundArrays& a, size_t begin, size_t end, int shape,
                     bool lines) {
  avx512::Step<avx512::Avx512>(a, begin, end, shape, lines);
}

}  // namespace strata::bench
