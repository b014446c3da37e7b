// The scalar bound: 8-byte words; the kernel off x86.
#include <cstring>

#define STRATA_BENCH_BOUND_ISA scalar
#include "bench/bound_impl.h"

namespace strata::bench {
namespace scalar {
namespace {

struct Scalar {
  using R = uint64_t;
  static constexpr size_t kVec = 8;
  static R Zero() { return 0; }
  static R Load(const void* p) {
    R r;
    std::memcpy(&r, p, sizeof(r));
    return r;
  }
  static void Store(void* p, R r) { std::memcpy(p, &r, sizeof(r)); }
  static void StreamStore(void* p, R r) { Store(p, r); }
  template <size_t kBytes>
  static R LoadPart(const void* p) {
    R r = 0;
    std::memcpy(&r, p, kBytes);
    return r;
  }
  template <size_t kBytes>
  static void StorePart(void* p, R r) {
    std::memcpy(p, &r, kBytes);
  }
  template <size_t kBytes>
  static void StreamStorePart(void* p, R r) {
    StorePart<kBytes>(p, r);
  }
  static void Keep(R& r) { asm volatile("" : "+r"(r)); }
  static void Use(R r) { asm volatile("" : : "r"(r)); }
  static void Fence() {}
};

}  // namespace
}  // namespace scalar

void BoundScalarFused(const BoundArrays& a, size_t begin, size_t end,
                      size_t ahead, size_t chunk) {
  scalar::FusedChunk<scalar::Scalar>(a, begin, end, ahead, chunk);
}
void BoundScalarStream(const BoundArrays& a, size_t begin, size_t end) {
  scalar::Stream<scalar::Scalar>(a, begin, end);
}
void BoundScalarStep(const BoundArrays& a, size_t begin, size_t end, int shape,
                     bool lines) {
  scalar::Step<scalar::Scalar>(a, begin, end, shape, lines);
}

}  // namespace strata::bench
