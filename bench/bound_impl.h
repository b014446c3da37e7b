// The bound kernel's driver, written once over a vector type V and compiled
// once per ISA: each bound_<isa>.cc defines STRATA_BENCH_BOUND_ISA (a
// namespace name), includes this file, then defines V and instantiates
// Bound<V>. Everything here has internal linkage inside a per-ISA namespace,
// so no inline function compiled with one ISA's flags can be picked by the
// linker for another's caller; for the same reason the kernels call no
// inline function of a shared header (std::min and the like).
//
// V provides kN (lanes of 32 bits), Fence(), and
// BoundAt<kGradBytes, kMomentBytes, kWork, kStream>(a, i) for kN elements.
#ifndef STRATA_BENCH_BOUND_ISA
#error "define STRATA_BENCH_BOUND_ISA before including bench/bound_impl.h"
#endif

#include <cstddef>
#include <cstdint>

#include "bench/bound.h"

namespace strata::bench::STRATA_BENCH_BOUND_ISA {
namespace {

// One element: integer adds and xors stand in for the optimizer's
// arithmetic, so the kernel costs only its loads and stores.
template <int kGradBytes, int kMomentBytes, bool kWork>
inline void BoundAtScalar(const BoundArrays& a, size_t i) {
  uint32_t* p = reinterpret_cast<uint32_t*>(a.master);
  uint32_t g;
  if constexpr (kGradBytes == 4) {
    g = static_cast<const uint32_t*>(a.grad)[i];
  } else {
    g = static_cast<const uint16_t*>(a.grad)[i];
  }
  const uint32_t x = p[i] + g;
  p[i] = x;
  if constexpr (kMomentBytes == 4) {
    static_cast<uint32_t*>(a.m)[i] ^= g;
    static_cast<uint32_t*>(a.v)[i] += g;
  } else {
    static_cast<uint16_t*>(a.m)[i] ^= static_cast<uint16_t>(g);
    static_cast<uint16_t*>(a.v)[i] += static_cast<uint16_t>(g);
  }
  if constexpr (kWork) a.working[i] = static_cast<uint16_t>(x >> 16);
}

// Scalar elements before the working copy reaches the alignment of a
// non-temporal store of kN 16-bit lanes; SIZE_MAX when it never does.
template <class V>
inline size_t StreamHead(const void* w) {
  constexpr uintptr_t kAlign = V::kN * 2;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(w);
  if (addr % 2 != 0) return SIZE_MAX;
  return ((kAlign - addr % kAlign) % kAlign) / 2;
}

template <class V, int kGradBytes, int kMomentBytes, bool kWork>
void BoundRange(const BoundArrays& a, size_t begin, size_t end) {
  size_t i = begin;
  bool stream = false;
  if constexpr (kWork && V::kN > 1) {
    const size_t head = StreamHead<V>(a.working + i);
    if (head != SIZE_MAX) {
      const size_t stop = end - i < head ? end : i + head;
      for (; i < stop; ++i) {
        BoundAtScalar<kGradBytes, kMomentBytes, kWork>(a, i);
      }
      stream = true;
    }
  }
  if (stream) {
    for (; i + V::kN <= end; i += V::kN) {
      V::template BoundAt<kGradBytes, kMomentBytes, kWork, true>(a, i);
    }
    V::Fence();
  } else {
    for (; i + V::kN <= end; i += V::kN) {
      V::template BoundAt<kGradBytes, kMomentBytes, kWork, false>(a, i);
    }
  }
  for (; i < end; ++i) BoundAtScalar<kGradBytes, kMomentBytes, kWork>(a, i);
}

template <class V, int kGradBytes, int kMomentBytes>
void BoundW(const BoundArrays& a, size_t b, size_t e) {
  if (a.working != nullptr) {
    BoundRange<V, kGradBytes, kMomentBytes, true>(a, b, e);
  } else {
    BoundRange<V, kGradBytes, kMomentBytes, false>(a, b, e);
  }
}

template <class V>
void Bound(const BoundArrays& a, size_t b, size_t e) {
  if (a.grad_bytes == 4) {
    if (a.moment_bytes == 4) return BoundW<V, 4, 4>(a, b, e);
    return BoundW<V, 4, 2>(a, b, e);
  }
  if (a.moment_bytes == 4) return BoundW<V, 2, 4>(a, b, e);
  return BoundW<V, 2, 2>(a, b, e);
}

}  // namespace
}  // namespace strata::bench::STRATA_BENCH_BOUND_ISA
