// The bound kernels' bodies, written once over a vector type V and compiled
// once per ISA: each bound_<isa>.cc defines STRATA_BENCH_BOUND_ISA (a
// namespace name), includes this file, then defines V and instantiates
// Fused<V> and Stream<V>. Everything here has internal linkage inside a
// per-ISA namespace, so no inline function compiled with one ISA's flags can
// be picked by the linker for another's caller; for the same reason the
// kernels call no inline function of a shared header (std::min and the like).
//
// V provides R (a register of kVec bytes), Load, Store (regular, unaligned),
// StreamStore (non-temporal, kVec-aligned), Keep(R&) and Use(R) (empty asm
// statements that make a value opaque to the compiler, so a store of what
// was loaded, or a load whose value is never used, stays in the code without
// an arithmetic instruction), Zero and Fence.
#ifndef STRATA_BENCH_BOUND_ISA
#error "define STRATA_BENCH_BOUND_ISA before including bench/bound_impl.h"
#endif

#include <cstddef>
#include <cstdint>

#include "bench/bound.h"

namespace strata::bench::STRATA_BENCH_BOUND_ISA {
namespace {

// Elements per step of the fused kernel: one 64-byte line of a 1-byte
// stream, four of a 4-byte one.
constexpr size_t kChunk = 64;

inline char* Bytes(const BoundStream& s) { return static_cast<char*>(s.data); }

// The bytes [lo, hi) of one stream, one at a time (tails).
inline void TouchBytes(const BoundStream& s, size_t lo, size_t hi) {
  volatile unsigned char* p = reinterpret_cast<unsigned char*>(Bytes(s));
  for (size_t k = lo; k < hi; ++k) {
    if (s.access == BoundAccess::kStreamWrite) {
      p[k] = 0;
    } else if (s.access == BoundAccess::kUpdate) {
      p[k] = p[k];
    } else {
      static_cast<void>(p[k]);
    }
  }
}

// One item of a per-block stream (its scale), loaded and, unless read
// only, stored back.
inline void TouchItem(const BoundStream& s, size_t item) {
  TouchBytes(s, item * s.elem_bytes, (item + 1) * s.elem_bytes);
}

// kVecs registers of one stream at `p`; `carry` is the last register loaded
// (what a stream write stores).
template <class V, BoundAccess kAccess, size_t kVecs>
inline void Vecs(char* p, bool nt, typename V::R& carry) {
  if constexpr (kAccess == BoundAccess::kRead) {
    for (size_t k = 0; k < kVecs; ++k) {
      carry = V::Load(p + k * V::kVec);
      V::Use(carry);
    }
  } else if constexpr (kAccess == BoundAccess::kUpdate) {
    for (size_t k = 0; k < kVecs; ++k) {
      carry = V::Load(p + k * V::kVec);
      V::Keep(carry);
      V::Store(p + k * V::kVec, carry);
    }
  } else {
    if (nt) {
      for (size_t k = 0; k < kVecs; ++k) V::StreamStore(p + k * V::kVec, carry);
    } else {
      for (size_t k = 0; k < kVecs; ++k) V::Store(p + k * V::kVec, carry);
    }
  }
}

template <class V, BoundAccess kAccess>
inline void ChunkOf(const BoundStream& s, size_t i, bool nt,
                    typename V::R& carry) {
  char* p = Bytes(s) + i * static_cast<size_t>(s.elem_bytes);
  switch (s.elem_bytes) {
    case 1:
      return Vecs<V, kAccess, kChunk / V::kVec>(p, nt, carry);
    case 2:
      return Vecs<V, kAccess, 2 * kChunk / V::kVec>(p, nt, carry);
    default:
      return Vecs<V, kAccess, 4 * kChunk / V::kVec>(p, nt, carry);
  }
}

inline bool NtAllowed(const BoundStream& s, size_t begin, size_t vec) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(Bytes(s)) +
                      begin * static_cast<size_t>(s.elem_bytes);
  return s.access == BoundAccess::kStreamWrite && a % vec == 0;
}

// Every stream advanced together, a chunk at a time, in the order given.
template <class V>
void Fused(const BoundArrays& a, size_t begin, size_t end) {
  bool nt[kMaxBoundStreams];
  for (int s = 0; s < a.count; ++s) {
    nt[s] = NtAllowed(a.streams[s], begin, V::kVec);
  }
  typename V::R carry = V::Zero();
  size_t i = begin;
  for (; i + kChunk <= end; i += kChunk) {
    for (int s = 0; s < a.count; ++s) {
      const BoundStream& st = a.streams[s];
      if (st.per_elems > 1) {
        if (i % st.per_elems == 0) TouchItem(st, i / st.per_elems);
        continue;
      }
      switch (st.access) {
        case BoundAccess::kRead:
          ChunkOf<V, BoundAccess::kRead>(st, i, false, carry);
          break;
        case BoundAccess::kUpdate:
          ChunkOf<V, BoundAccess::kUpdate>(st, i, false, carry);
          break;
        case BoundAccess::kStreamWrite:
          ChunkOf<V, BoundAccess::kStreamWrite>(st, i, nt[s], carry);
          break;
      }
    }
  }
  if (i < end) {
    for (int s = 0; s < a.count; ++s) {
      const BoundStream& st = a.streams[s];
      if (st.per_elems > 1) {
        if (i % st.per_elems == 0) TouchItem(st, i / st.per_elems);
        continue;
      }
      TouchBytes(st, i * st.elem_bytes, end * st.elem_bytes);
    }
  }
  V::Fence();
}

// One plain loop per stream over [begin, end), STREAM-style.
template <class V>
void Stream(const BoundArrays& a, size_t begin, size_t end) {
  for (int s = 0; s < a.count; ++s) {
    const BoundStream& st = a.streams[s];
    if (st.per_elems > 1) {
      const size_t first = (begin + st.per_elems - 1) / st.per_elems;
      const size_t last = (end + st.per_elems - 1) / st.per_elems;
      for (size_t k = first; k < last; ++k) TouchItem(st, k);
      continue;
    }
    const bool nt = NtAllowed(st, begin, V::kVec);
    char* p = Bytes(st);
    size_t lo = begin * st.elem_bytes;
    const size_t hi = end * st.elem_bytes;
    typename V::R carry = V::Zero();
    constexpr size_t kStep = 4 * V::kVec;  // four registers per iteration
    switch (st.access) {
      case BoundAccess::kRead:
        for (; lo + kStep <= hi; lo += kStep) {
          Vecs<V, BoundAccess::kRead, 4>(p + lo, false, carry);
        }
        break;
      case BoundAccess::kUpdate:
        for (; lo + kStep <= hi; lo += kStep) {
          Vecs<V, BoundAccess::kUpdate, 4>(p + lo, false, carry);
        }
        break;
      case BoundAccess::kStreamWrite:
        for (; lo + kStep <= hi; lo += kStep) {
          Vecs<V, BoundAccess::kStreamWrite, 4>(p + lo, nt, carry);
        }
        break;
    }
    TouchBytes(st, lo, hi);
  }
  V::Fence();
}

}  // namespace
}  // namespace strata::bench::STRATA_BENCH_BOUND_ISA
