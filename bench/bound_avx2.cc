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

}  // namespace strata::bench
