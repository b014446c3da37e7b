// The bound kernels' bodies, written once over a vector type V and compiled
// once per ISA: each bound_<isa>.cc defines STRATA_BENCH_BOUND_ISA (a
// namespace name), includes this file, then defines V and instantiates
// FusedChunk<V> and Stream<V>. Everything here has internal linkage inside a
// per-ISA namespace, so no inline function compiled with one ISA's flags can
// be picked by the linker for another's caller; for the same reason the
// kernels call no inline function of a shared header (std::min and the like).
//
// V provides R (a register of kVec bytes), Load, Store (regular, unaligned),
// StreamStore (non-temporal, kVec-aligned), LoadPart<kBytes>,
// StorePart<kBytes> and StreamStorePart<kBytes> (the low kBytes of a
// register, kBytes one of kVec, kVec / 2 and kVec / 4; non-temporal where
// p is kBytes-aligned and kBytes is at least 16, a regular store otherwise),
// Keep(R&) and Use(R) (empty asm statements that make a value opaque to the
// compiler, so a store of what was loaded, or a load whose value is never used,
// stays in the code without an arithmetic instruction), Zero and Fence.
#ifndef STRATA_BENCH_BOUND_ISA
#error "define STRATA_BENCH_BOUND_ISA before including bench/bound_impl.h"
#endif

#include <cstddef>
#include <cstdint>
#include <utility>

#include "bench/bound.h"

namespace strata::bench::STRATA_BENCH_BOUND_ISA {
namespace {

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

// Whether the fused kernel loads a stream's chunks (and prefetches them):
// element streams that are read or updated.
inline bool Loaded(const BoundStream& s) {
  return s.per_elems <= 1 && s.access != BoundAccess::kStreamWrite;
}

inline bool NtAllowed(const BoundStream& s, size_t begin, size_t vec) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(Bytes(s)) +
                      begin * static_cast<size_t>(s.elem_bytes);
  return s.access == BoundAccess::kStreamWrite && a % vec == 0;
}

// Whether every per-element stream's part of a `chunk`-element chunk is a
// whole number of V's registers.
template <class V>
bool FitsChunk(const BoundArrays& a, size_t chunk) {
  for (int s = 0; s < a.count; ++s) {
    const BoundStream& st = a.streams[s];
    if (st.per_elems == 1 && st.elem_bytes * chunk % V::kVec != 0) {
      return false;
    }
  }
  return true;
}

// Runs chunks(i, stop) over [begin, end) cut at the item boundaries of the
// per-block streams: each segment first touches the items whose blocks
// start there, as the optimizer handles a block's scales once per block,
// so no chunk pays for a division. chunks returns where its whole chunks
// ended; the rest of the segment is touched byte by byte (the range's tail).
template <class Chunks>
void Segments(const BoundArrays& a, size_t begin, size_t end, Chunks&& chunks) {
  size_t i = begin;
  while (i < end) {
    size_t stop = end;
    for (int s = 0; s < a.count; ++s) {
      const BoundStream& st = a.streams[s];
      if (st.per_elems <= 1) continue;
      const size_t item = i / st.per_elems;
      if (i % st.per_elems == 0) TouchItem(st, item);
      const size_t next = (item + 1) * st.per_elems;
      if (next < stop) stop = next;
    }
    i = chunks(i, stop);
    if (i < stop) {
      for (int s = 0; s < a.count; ++s) {
        const BoundStream& st = a.streams[s];
        if (st.per_elems <= 1) {
          TouchBytes(st, i * st.elem_bytes, stop * st.elem_bytes);
        }
      }
      i = stop;
    }
  }
}

// Note [Loads before stores]: the fused kernel advances every stream
// together, 64 elements at a time (32 in fused_prefetch_32; a 4-byte
// stream's chunk of 64 is four AVX-512 registers or eight AVX2 ones, a
// 1-byte stream's one or two), and within a chunk it loads every stream before
// it stores any, as the optimizer's loop does: it stores what it computed from
// all its loads. Storing one array's chunk and then loading the next array's
// was slower, likely because the arrays start on 4 KiB boundaries, so each load
// followed a store with the same low 12 address bits, which the core must check
// for aliasing. On one Zen 4 core, the fp32 AdamW arrays: 52-53 GB/s that way
// against 60-61 for the optimizer's own step (a bound beaten by 10%), 36-40
// with one register per stream in that order, and 64 with the loads first.
// Stream writes store zeros.
//
// With `ahead` > 0 (fused_prefetch), each chunk first prefetches every
// loaded stream's lines `ahead` elements further on. Measured on one Zen 4
// core of a shared VM whose memory latency had risen, in GB/s without and
// with (AVX-512, the fp32 AdamW arrays, then the 8-bit AdamW ones):
// 57.2-58.3 -> 60.5-61.7 at 512 elements ahead (59.1-60.1 at 1024), and
// 52.1-53.1 -> 56.2-56.7 at 512, 58.9-61.4 at 1024: about 16 KiB of the
// pass ahead suits both (BoundPrefetchElems). The addresses are formed as
// integers, so those past the arrays' ends are never pointers; a prefetch
// never faults.
//
// kChunk is 64 elements (fused, fused_prefetch) or 32 (fused_prefetch_32);
// each stream's part of a chunk must be a whole number of V's registers,
// which 32 elements of a 1-byte stream are not on AVX-512 (FusedChunk).
// REQUIRES: FitsChunk<V>(a, kChunk).
template <class V, size_t kChunk>
void Fused(const BoundArrays& a, size_t begin, size_t end, size_t ahead) {
  constexpr int kRegs = static_cast<int>(4 * kChunk / V::kVec);  // 4 bytes
  static_assert(kRegs >= 1);
  BoundStream st[kMaxBoundStreams];
  bool nt[kMaxBoundStreams];
  int regs[kMaxBoundStreams];   // registers of the stream's chunk
  int lines[kMaxBoundStreams];  // lines it prefetches per chunk, at least 1
  const int count = a.count;
  for (int s = 0; s < count; ++s) {
    st[s] = a.streams[s];
    nt[s] = NtAllowed(st[s], begin, V::kVec);
    const int bytes = st[s].elem_bytes * static_cast<int>(kChunk);
    regs[s] = bytes / static_cast<int>(V::kVec);
    lines[s] = bytes < 64 ? 1 : bytes / 64;
  }
  Segments(a, begin, end, [&](size_t i, size_t stop) {
    for (; i + kChunk <= stop; i += kChunk) {
      if (ahead > 0) {
        for (int s = 0; s < count; ++s) {
          if (!Loaded(st[s])) continue;
          const uintptr_t at =
              reinterpret_cast<uintptr_t>(Bytes(st[s])) +
              (i + ahead) * static_cast<size_t>(st[s].elem_bytes);
          for (int k = 0; k < lines[s]; ++k) {
            __builtin_prefetch(reinterpret_cast<const void*>(at + 64 * k), 0,
                               3);
          }
        }
      }
      // Unrolled with the bounds known, so that r stays in registers (the
      // pragmas' counts are kMaxBoundStreams and at most kRegs).
      static_assert(kMaxBoundStreams == 10);
      typename V::R r[kMaxBoundStreams][kRegs] = {};
#pragma GCC unroll 10
      for (int s = 0; s < kMaxBoundStreams; ++s) {
        if (s >= count) break;
        if (!Loaded(st[s])) continue;
        const char* p =
            Bytes(st[s]) + i * static_cast<size_t>(st[s].elem_bytes);
#pragma GCC unroll 8
        for (int k = 0; k < kRegs; ++k) {
          if (k >= regs[s]) break;
          r[s][k] = V::Load(p + k * V::kVec);
          V::Keep(r[s][k]);
        }
      }
#pragma GCC unroll 10
      for (int s = 0; s < kMaxBoundStreams; ++s) {
        if (s >= count) break;
        if (st[s].per_elems > 1 || st[s].access == BoundAccess::kRead) {
          continue;
        }
        char* p = Bytes(st[s]) + i * static_cast<size_t>(st[s].elem_bytes);
        const bool write = st[s].access == BoundAccess::kStreamWrite;
#pragma GCC unroll 8
        for (int k = 0; k < kRegs; ++k) {
          if (k >= regs[s]) break;
          if (!write) {
            V::Store(p + k * V::kVec, r[s][k]);
          } else if (nt[s]) {
            V::StreamStore(p + k * V::kVec, V::Zero());
          } else {
            V::Store(p + k * V::kVec, V::Zero());
          }
        }
      }
    }
    return i;
  });
  V::Fence();
}

// Fused<V, chunk> where every stream fits a chunk of `chunk` (32 or 64)
// elements, Fused<V, 64> otherwise (AVX-512 with a 1-byte stream).
template <class V>
void FusedChunk(const BoundArrays& a, size_t begin, size_t end, size_t ahead,
                size_t chunk) {
  if (chunk == 32 && FitsChunk<V>(a, 32)) {
    Fused<V, 32>(a, begin, end, ahead);
  } else {
    Fused<V, 64>(a, begin, end, ahead);
  }
}

// ---- fused_step -------------------------------------------------------------
//
// The per-element streams of a pass grouped by kind (BoundStepShape's
// indices): base pointers, and for stream writes whether non-temporal
// stores are allowed from the range's start.
struct Sorted {
  char* p[3][3][kMaxBoundStreams];
  bool nt[3][kMaxBoundStreams];        // stream writes, by size
  bool nt_lines[3][kMaxBoundStreams];  // the same, for whole lines
  int n[3][3];
};

template <class V>
Sorted SortStreams(const BoundArrays& a, size_t begin) {
  Sorted out{};
  for (int s = 0; s < a.count; ++s) {
    const BoundStream& st = a.streams[s];
    if (st.per_elems > 1) continue;
    const int x = static_cast<int>(st.access);
    const int z = st.elem_bytes == 4 ? 0 : st.elem_bytes == 2 ? 1 : 2;
    const int k = out.n[x][z]++;
    out.p[x][z][k] = Bytes(st);
    if (st.access == BoundAccess::kStreamWrite) {
      out.nt[z][k] = NtAllowed(st, begin, V::kVec >> z);
      out.nt_lines[z][k] = NtAllowed(st, begin, 64);
    }
  }
  return out;
}

// Streams of kind (kX, kZ): kS's count, or the pass's when kS's is negative.
template <BoundStepShape kS, int kX, int kZ>
inline int KindCount(const Sorted& s) {
  if constexpr (kS.count[kX][kZ] >= 0) {
    return kS.count[kX][kZ];
  } else {
    return s.n[kX][kZ];
  }
}

// The loads of kind (kX, kZ) at element i, kept in r[kZ]; and their
// prefetches kBoundStepPrefetchElems ahead, one per stream.
template <class V, BoundStepShape kS, int kX, int kZ>
inline void StepLoads(const Sorted& s, size_t i,
                      typename V::R (&r)[kMaxBoundStreams]) {
  constexpr size_t kBytes = V::kVec >> kZ;
  constexpr size_t kElemBytes = size_t{4} >> kZ;
  const int n = KindCount<kS, kX, kZ>(s);
#pragma GCC unroll 10
  for (int k = 0; k < kMaxBoundStreams; ++k) {
    if (k >= n) break;
    const uintptr_t at = reinterpret_cast<uintptr_t>(s.p[kX][kZ][k]) +
                         (i + kBoundStepPrefetchElems) * kElemBytes;
    __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 3);
  }
#pragma GCC unroll 10
  for (int k = 0; k < kMaxBoundStreams; ++k) {
    if (k >= n) break;
    r[k] = V::template LoadPart<kBytes>(s.p[kX][kZ][k] + i * kElemBytes);
    if constexpr (kX == static_cast<int>(BoundAccess::kRead)) {
      V::Use(r[k]);
    } else {
      V::Keep(r[k]);
    }
  }
}

// The updates of size kZ at element i store back r; the stream writes
// store zeros, unless kLines (LineStores stores them).
template <class V, BoundStepShape kS, int kZ, bool kLines>
inline void StepStores(const Sorted& s, size_t i,
                       const typename V::R (&r)[kMaxBoundStreams]) {
  constexpr size_t kBytes = V::kVec >> kZ;
  constexpr size_t kElemBytes = size_t{4} >> kZ;
  constexpr int kU = static_cast<int>(BoundAccess::kUpdate);
  constexpr int kW = static_cast<int>(BoundAccess::kStreamWrite);
  const int nu = KindCount<kS, kU, kZ>(s);
#pragma GCC unroll 10
  for (int k = 0; k < kMaxBoundStreams; ++k) {
    if (k >= nu) break;
    V::template StorePart<kBytes>(s.p[kU][kZ][k] + i * kElemBytes, r[k]);
  }
  if constexpr (kLines) return;
  const int nw = KindCount<kS, kW, kZ>(s);
#pragma GCC unroll 10
  for (int k = 0; k < kMaxBoundStreams; ++k) {
    if (k >= nw) break;
    char* p = s.p[kW][kZ][k] + i * kElemBytes;
    if (s.nt[kZ][k]) {
      V::template StreamStorePart<kBytes>(p, V::Zero());
    } else {
      V::template StorePart<kBytes>(p, V::Zero());
    }
  }
}

// fused_lines' elements an iteration: two of the optimizers' 16-lane
// vectors, whose 2-byte working copy is one whole 64-byte line.
inline constexpr size_t kLineStepElems = 32;

// fused_lines' stream writes of size kZ for the kLineStepElems elements at
// i: zeros, in whole registers (a 1-byte stream's 32 bytes in part of one
// on AVX-512), back to back.
template <class V, BoundStepShape kS, int kZ>
inline void LineStores(const Sorted& s, size_t i) {
  constexpr size_t kElemBytes = size_t{4} >> kZ;
  constexpr size_t kBytes = kLineStepElems * kElemBytes;
  constexpr size_t kPart = kBytes < V::kVec ? kBytes : V::kVec;
  constexpr int kW = static_cast<int>(BoundAccess::kStreamWrite);
  const int nw = KindCount<kS, kW, kZ>(s);
#pragma GCC unroll 10
  for (int k = 0; k < kMaxBoundStreams; ++k) {
    if (k >= nw) break;
    char* p = s.p[kW][kZ][k] + i * kElemBytes;
#pragma GCC unroll 16
    for (size_t b = 0; b < kBytes; b += kPart) {
      if (s.nt_lines[kZ][k]) {
        V::template StreamStorePart<kPart>(p + b, V::Zero());
      } else {
        V::template StorePart<kPart>(p + b, V::Zero());
      }
    }
  }
}

// fused_step's whole steps of [i, stop) for a pass of shape kS: V::kVec / 4
// elements a step, every stream's part one whole (part of a) register. The
// loads come in the optimizer's order, gradient (read) first, and the
// stores after them (Note [Loads before stores]). With kLines
// (fused_lines), kLineStepElems elements an iteration, and the stream
// writes' whole lines stored after the iteration's steps. Returns where the
// steps ended.
template <class V, BoundStepShape kS, bool kLines>
size_t StepChunks(const Sorted& s, size_t i, size_t stop) {
  constexpr size_t kStep = V::kVec / 4;
  constexpr size_t kIter = kLines ? kLineStepElems : kStep;
  static_assert(kIter % kStep == 0);
  constexpr int kR = static_cast<int>(BoundAccess::kRead);
  constexpr int kU = static_cast<int>(BoundAccess::kUpdate);
  for (; i + kIter <= stop; i += kIter) {
#pragma GCC unroll 16
    for (size_t j = i; j < i + kIter; j += kStep) {
      typename V::R r[3][kMaxBoundStreams] = {};
      typename V::R u[3][kMaxBoundStreams] = {};
      StepLoads<V, kS, kR, 0>(s, j, r[0]);
      StepLoads<V, kS, kR, 1>(s, j, r[1]);
      StepLoads<V, kS, kR, 2>(s, j, r[2]);
      StepLoads<V, kS, kU, 0>(s, j, u[0]);
      StepLoads<V, kS, kU, 1>(s, j, u[1]);
      StepLoads<V, kS, kU, 2>(s, j, u[2]);
      StepStores<V, kS, 0, kLines>(s, j, u[0]);
      StepStores<V, kS, 1, kLines>(s, j, u[1]);
      StepStores<V, kS, 2, kLines>(s, j, u[2]);
    }
    if constexpr (kLines) {
      LineStores<V, kS, 0>(s, i);
      LineStores<V, kS, 1>(s, i);
      LineStores<V, kS, 2>(s, i);
    }
  }
  return i;
}

inline constexpr BoundStepShape kAnyShape = {
    {{-1, -1, -1}, {-1, -1, -1}, {-1, -1, -1}}};

using StepFn = size_t (*)(const Sorted&, size_t, size_t);

// StepChunks for every shape of kBoundStepShapes, in its order.
template <class V, bool kLines, class Seq>
struct StepTable;
template <class V, bool kLines, size_t... kI>
struct StepTable<V, kLines, std::index_sequence<kI...>> {
  static constexpr StepFn kFns[] = {
      &StepChunks<V, kBoundStepShapes[kI], kLines>...};
};

// The step kernel of `shape`: the index of a's shape in kBoundStepShapes,
// or -1 for the kernel that reads the counts at run time.
template <class V, bool kLines>
StepFn StepFor(int shape) {
  using Table =
      StepTable<V, kLines, std::make_index_sequence<kBoundStepShapeCount>>;
  return shape >= 0 ? Table::kFns[shape] : &StepChunks<V, kAnyShape, kLines>;
}

// fused_lines with `lines`, else fused_step.
template <class V>
void Step(const BoundArrays& a, size_t begin, size_t end, int shape,
          bool lines) {
  const StepFn fn = lines ? StepFor<V, true>(shape) : StepFor<V, false>(shape);
  const Sorted s = SortStreams<V>(a, begin);
  Segments(a, begin, end,
           [&](size_t i, size_t stop) { return fn(s, i, stop); });
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
