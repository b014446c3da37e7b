// The scalar bound: the reference, and the kernel off x86.
#define STRATA_BENCH_BOUND_ISA scalar
#include "bench/bound_impl.h"

namespace strata::bench {
namespace scalar {
namespace {

struct Scalar {
  static constexpr size_t kN = 1;
  static void Fence() {}
  template <int kGradBytes, int kMomentBytes, bool kWork, bool kStream>
  static void BoundAt(const BoundArrays& a, size_t i) {
    BoundAtScalar<kGradBytes, kMomentBytes, kWork>(a, i);
  }
};

}  // namespace
}  // namespace scalar

void BoundScalar(const BoundArrays& a, size_t begin, size_t end) {
  scalar::Bound<scalar::Scalar>(a, begin, end);
}

}  // namespace strata::bench
