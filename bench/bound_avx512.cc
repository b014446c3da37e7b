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

}  // namespace strata::bench
