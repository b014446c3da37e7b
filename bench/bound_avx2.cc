// The AVX2 bound: 32-byte registers. Built with -mavx2; called only after
// CPUID reports AVX2.
#include <immintrin.h>

#define STRATA_BENCH_BOUND_ISA avx2
#include "bench/bound_impl.h"

namespace strata::bench {
namespace avx2 {
namespace {

struct Avx2 {
  using R = __m256i;
  static constexpr size_t kVec = 32;
  static R Zero() { return _mm256_setzero_si256(); }
  static R Load(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }
  static void Store(void* p, R r) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), r);
  }
  // REQUIRES: p is 32-byte aligned.
  static void StreamStore(void* p, R r) {
    _mm256_stream_si256(static_cast<__m256i*>(p), r);
  }
  template <size_t kBytes>
  static R LoadPart(const void* p) {
    if constexpr (kBytes == 32) {
      return Load(p);
    } else if constexpr (kBytes == 16) {
      return _mm256_castsi128_si256(
          _mm_loadu_si128(static_cast<const __m128i*>(p)));
    } else {
      static_assert(kBytes == 8);
      return _mm256_castsi128_si256(
          _mm_loadl_epi64(static_cast<const __m128i*>(p)));
    }
  }
  template <size_t kBytes>
  static void StorePart(void* p, R r) {
    if constexpr (kBytes == 32) {
      Store(p, r);
    } else if constexpr (kBytes == 16) {
      _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(r));
    } else {
      static_assert(kBytes == 8);
      _mm_storel_epi64(static_cast<__m128i*>(p), _mm256_castsi256_si128(r));
    }
  }
  template <size_t kBytes>
  static void StreamStorePart(void* p, R r) {
    if constexpr (kBytes == 32) {
      StreamStore(p, r);
    } else if constexpr (kBytes == 16) {
      _mm_stream_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(r));
    } else {
      StorePart<kBytes>(p, r);
    }
  }
  static void Keep(R& r) { asm volatile("" : "+x"(r)); }
  static void Use(R r) { asm volatile("" : : "x"(r)); }
  static void Fence() { _mm_sfence(); }
};

}  // namespace
}  // namespace avx2

void BoundAvx2Fused(const BoundArrays& a, size_t begin, size_t end,
                    size_t ahead, size_t chunk) {
  avx2::FusedChunk<avx2::Avx2>(a, begin, end, ahead, chunk);
}
void BoundAvx2Stream(const BoundArrays& a, size_t begin, size_t end) {
  avx2::Stream<avx2::Avx2>(a, begin, end);
}
void BoundAvx2Step(const BoundArrays& a, size_t begin, size_t end, int shape,
                   bool lines) {
  avx2::Step<avx2::Avx2>(a, begin, end, shape, lines);
}

}  // namespace strata::bench
