// The optimizer kernels, written once over a vector type V and compiled once
// per ISA. Each kernels_<isa>.cc defines STRATA_CPU_ADAM_ISA (a namespace
// name) and its vector types, then includes this file.
//
// Note [One namespace per ISA]: everything here, including plain scalar
// helpers, lives in namespace strata::cpu_adam::STRATA_CPU_ADAM_ISA. Inline
// functions compiled with different -m flags must not share a mangled name:
// the linker would keep one copy, possibly the AVX-512 one, and a scalar
// caller on an older CPU would then fault.
//
// Note [Bitwise agreement]: every variant performs the same IEEE operations
// in the same order (explicit fma where torch fuses, none elsewhere; the
// kernel files are built with -ffp-contract=off), and division and square
// root are correctly rounded on every ISA. So each SIMD variant must equal
// the scalar reference bit for bit, and the tests check exactly that. Tails
// and alignment heads run the scalar code of the same translation unit.
//
// A vector type V provides: F (the register), kN (lanes), Set, Load/Store
// for float, F16 and Bf16 arrays, Stream (non-temporal store of a 16-bit
// array), Fence, Add, Mul, Div, Sqrt, Fma(a, b, c) = a * b + c, Sign, and
// for the gradient statistics D, DZero, SqAcc, DSum, Bad, BadZero, BadOr,
// BadAny; an integer lane type I (fp32 bits) with ISet, IBits, FBits,
// IMin, IMax (signed) and IMaxAll (the largest lane, signed); and for the
// 8-bit state codecs a 16-bit lane type H of kH lanes (kN or 2 kN) with
// HSet, HAnd, HOr, HAdd, HSubSat (unsigned, saturating at 0), HSrl<k>,
// HSll<k> (logical), HMin, HMax (signed), HZeroIfZero(c, t) = c == 0 ? 0 :
// t, HLoad and HStore (kH uint16_t), HLoadU8 (kH bytes, zero-extended),
// HStoreU8 (each lane, in [0, 0x7fff], as a byte saturated at 255), HTop(x)
// (the top 16 bits of the fp32 lanes of x[0], then x[1] when kH = 2 kN) and
// HWiden<k> (lanes k kN to (k + 1) kN - 1 as the top halves of fp32 lanes
// whose low halves are zero). The H lanes may hold their elements in any
// fixed order of the type's choosing (AVX2: Note [Codes in 128-bit
// halves]), provided HLoadU8 and HTop put them in it and HWiden and HStoreU8
// take them out of it; the codecs work lane by lane. Optionally,
// HStoreU8Pair(p, a, q, b) does HStoreU8(p, a) and HStoreU8(q, b) in fewer
// operations (StoreCodes), and kSplitUpdate8 = true makes two sweeps the
// 8-bit update's default (Note [The 8-bit update in two sweeps]).
#ifndef STRATA_CPU_ADAM_ISA
#error "define STRATA_CPU_ADAM_ISA before including cpu_adam/kernel_impl.h"
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cpu_adam/kernels.h"
#include "util/half.h"

// The per-vector helpers are forced inline: a call would pass a register
// pair (Avx2x2's F) through memory, and GCC's size heuristics leave some of
// them out of line otherwise (measured: a quarter of a bf16-moment update).
#ifndef STRATA_CPU_ADAM_INLINE
#define STRATA_CPU_ADAM_INLINE [[gnu::always_inline]] inline
#endif

namespace strata::cpu_adam::STRATA_CPU_ADAM_ISA {

// Element tags for 16-bit arrays. Never dereferenced as structs: loads and
// stores go through uint16_t or intrinsics.
struct F16 {
  uint16_t bits;
};
struct Bf16 {
  uint16_t bits;
};
struct NoWork {};  // no working copy

inline uint32_t FloatBits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
inline float BitsFloat(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// ---- Scalar conversions (the contract of every variant) --------------------

inline float Bf16ToFloat(uint16_t h) { return BitsFloat(uint32_t{h} << 16); }

// Round to nearest even. NaN: quieted, sign and top payload kept. fp32
// denormals flush to signed zero, which is what VCVTNEPS2BF16 does, so that
// the software and the instruction agree on every input.
inline uint16_t FloatToBf16(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  return Bf16FromFloatBits(u);
}

// Exact. NaN: quiet bit set, payload kept (as VCVTPH2PS does).
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t m = h & 0x3ffu;
  if ((h & 0x7c00u) == 0x7c00u) {
    return BitsFloat(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  }
  return BitsFloat(sign | FloatBitsFromHalfMagnitude(h & 0x7fffu));
}

// IEEE round to nearest even, subnormals kept, overflow to inf. NaN:
// quieted, top payload bits kept (as VCVTPS2PH does).
inline uint16_t FloatToF16(float x) {
  const uint32_t u = FloatBits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x1ffu));
  }
  return static_cast<uint16_t>(sign | HalfMagnitudeFromFloatBits(a));
}

// ---- The scalar vector type ------------------------------------------------

struct Scalar {
  using F = float;
  using D = double;
  using Bad = bool;
  static constexpr size_t kN = 1;

  static F Set(float x) { return x; }
  static F Load(const float* p) { return *p; }
  static F Load(const F16* p) {
    return F16ToFloat(*reinterpret_cast<const uint16_t*>(p));
  }
  static F Load(const Bf16* p) {
    return Bf16ToFloat(*reinterpret_cast<const uint16_t*>(p));
  }
  static void Store(float* p, F x) { *p = x; }
  static void Store(F16* p, F x) {
    *reinterpret_cast<uint16_t*>(p) = FloatToF16(x);
  }
  static void Store(Bf16* p, F x) {
    *reinterpret_cast<uint16_t*>(p) = FloatToBf16(x);
  }
  template <class T>
  static void Stream(T* p, F x) {
    Store(p, x);
  }
  static void Fence() {}
  static F Add(F a, F b) { return a + b; }
  static F Mul(F a, F b) { return a * b; }
  static F Div(F a, F b) { return a / b; }
  static F Sqrt(F a) { return std::sqrt(a); }
  static F Fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F Sign(F a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f); }

  // fp32 bits as integers (signed min/max).
  using I = uint32_t;
  static I ISet(uint32_t x) { return x; }
  static I IBits(F x) { return FloatBits(x); }
  static F FBits(I x) { return BitsFloat(x); }
  static I IMin(I a, I b) {
    return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? a : b;
  }
  static I IMax(I a, I b) {
    return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b;
  }
  static uint32_t IMaxAll(I a) { return a; }

  // 16-bit lanes of the 8-bit codecs: one, as wide as F.
  using H = uint16_t;
  static constexpr size_t kH = 1;
  static H HSet(uint16_t x) { return x; }
  static H HAnd(H a, H b) { return a & b; }
  static H HOr(H a, H b) { return a | b; }
  static H HAdd(H a, H b) { return static_cast<H>(a + b); }
  static H HSubSat(H a, H b) { return a > b ? static_cast<H>(a - b) : 0; }
  template <int k>
  static H HSrl(H a) {
    return static_cast<H>(a >> k);
  }
  template <int k>
  static H HSll(H a) {
    return static_cast<H>(a << k);
  }
  static H HMin(H a, H b) {
    return static_cast<int16_t>(a) < static_cast<int16_t>(b) ? a : b;
  }
  static H HMax(H a, H b) {
    return static_cast<int16_t>(a) > static_cast<int16_t>(b) ? a : b;
  }
  static H HZeroIfZero(H c, H t) { return c == 0 ? 0 : t; }
  static H HLoad(const uint16_t* p) { return *p; }
  static void HStore(uint16_t* p, H h) { *p = h; }
  static H HLoadU8(const uint8_t* p) { return *p; }
  static void HStoreU8(uint8_t* p, H c) {
    *p = static_cast<uint8_t>(std::min<H>(c, 255));
  }
  static H HTop(const F* x) { return static_cast<H>(FloatBits(x[0]) >> 16); }
  template <int k>
  static F HWiden(H h) {
    static_assert(k == 0);
    return BitsFloat(static_cast<uint32_t>(h) << 16);
  }

  static void DPut(double* p, F x) { *p = x; }
  static void DAccum(double* p, F x) { *p += static_cast<double>(x); }

  static D DZero() { return 0.0; }
  static D SqAcc(D acc, F x) {
    const double d = x;
    return std::fma(d, d, acc);
  }
  static double DSum(D acc) { return acc; }
  static Bad BadZero() { return false; }
  static Bad BadOr(Bad bad, F x) {
    return bad || (FloatBits(x) & 0x7f800000u) == 0x7f800000u;
  }
  static bool BadAny(Bad bad) { return bad; }
};

// ---- The update ------------------------------------------------------------

// StepParams broadcast into registers once per range.
template <class V>
struct Consts {
  using F = typename V::F;
  explicit Consts(const StepParams& p)
      : gscale(V::Set(p.gscale)),
        beta1(V::Set(p.beta1)),
        beta2(V::Set(p.beta2)),
        omb1(V::Set(p.omb1)),
        omb2(V::Set(p.omb2)),
        eps(V::Set(p.eps)),
        l2(V::Set(p.l2)),
        decay(V::Set(p.decay)),
        neg_step(V::Set(p.neg_step)),
        bc2_sqrt(V::Set(p.bc2_sqrt)),
        inv_bc2_sqrt(V::Set(p.inv_bc2_sqrt)),
        use_l2(p.use_l2),
        use_decay(p.use_decay) {}
  F gscale, beta1, beta2, omb1, omb2, eps, l2, decay, neg_step, bc2_sqrt,
      inv_bc2_sqrt;
  bool use_l2, use_decay;
};

// Note [Software prefetch]: the vector loops prefetch every array they
// stream from kPrefetchElems elements ahead of the element they update. The
// hardware prefetchers keep only so many lines in flight per stream, and a
// loop with as much arithmetic per line as these holds fewer misses in its
// window than a plain copy does, so when memory latency rises (a busy host)
// the step fell behind the bandwidth it could use. Measured on one Zen 4
// core of a shared VM (AVX-512 BF16, 64M parameters from memory, three runs
// each), G params/s without -> with:
//   8-bit AdamW 2.07-2.22 -> 2.80-2.84;  8-bit Lion 3.10-3.21 -> 3.43-3.44;
//   AdamW, bf16 moments 2.51-2.54 -> 2.68-2.73;
//   Lion, fp32 moments 2.59-2.62 -> 2.67-2.71;
//   AdamW, fp32 moments 1.95-1.98 -> 1.94-1.95 (the one loop it costs).
// 256 elements ahead gained about half as much on the 8-bit steps and
// nothing on bf16 AdamW; 1024 and 2048 lost 2-7% on the fp32 rows. A prefetch
// never faults, so the lines past the end of an array (the last kPrefetchElems
// of a range) are harmless; their addresses are formed as integers, never as
// pointers past the array.
//
// Adafactor's statistics and RMS passes read the gradient (and the first
// the weights) once and write nothing: every line they fetch is used once
// and then dead. They prefetch kPrefetchOnceElems ahead with the
// non-temporal hint (prefetchnta), which brings a line close to the core
// without keeping it in the outer caches. One Zen 4 core, 256M parameters
// as 65536 x 4096, three alternating pairs of runs against the update
// loops' prefetch: the statistics pass 66-69 ms against 69-77, the RMS pass
// 31.6-32.5 against 33.6-35.2, the step 1.50-1.52 G params/s against
// 1.41-1.44 (two threads 3.06-3.17 against 2.98-3.05); at 64M on one core
// 1.44-1.47 against 1.29-1.40, on two the same. The same hint on the
// gradient of the one-pass loops (AdamW, 8-bit AdamW) was within the noise
// of three pairs of runs, so they keep theirs; 512 and 2048 ahead with
// the non-temporal hint were within the noise of 1024. A statistics pass
// that reads its rows back from L2 (Note [Adafactor's fused RMS]) keeps
// the gradient's lines for that: prefetcht0, kAfFusedPrefetchBytes ahead
// (with fp32 gradients, 1024 elements ahead with prefetcht0 or
// prefetchnta had run within 5% of 512 with prefetcht0).
constexpr size_t kPrefetchElems = 512;
constexpr size_t kPrefetchOnceElems = 1024;

// Prefetches the kElems elements at i + kAhead of p, one prefetch per 64
// bytes, with __builtin_prefetch's kLocality (3: keep in every cache; 0:
// non-temporal). The scalar reference (V::kN = 1) does not prefetch.
template <class V, size_t kElems, size_t kAhead, int kLocality, class T>
STRATA_CPU_ADAM_INLINE void PrefetchAt(const T* p, size_t i) {
  if constexpr (V::kN > 1) {
    const uintptr_t at =
        reinterpret_cast<uintptr_t>(p) + (i + kAhead) * sizeof(T);
    for (size_t k = 0; k < kElems * sizeof(T); k += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(at + k), 0, kLocality);
    }
  }
}

// Note [Column arrays]: a factored pass adds each row into per-column
// arrays (Adafactor's column sums, a band's worth of doubles) that the
// row's streams push out of L1 before the next row comes back to them.
// Without a prefetch the read-modify-write of those lines waited on L2 in
// the loop and held the statistics pass from memory at about 0.8 of a
// plain read of the same arrays. Prefetched kColPrefetchElems ahead, the
// pass ran as fast as without the column sums at all. One Zen 5 core, 64M
// parameters as 16384 x 4096, the statistics kernel timed alone over all
// tiles (best of 7), six alternating runs: 22.3-22.9 ms against 17.8-18.8
// (64 ahead 17.9-18.1, 1024 ahead 19.0; prefetchw instead of prefetcht0
// the same). The AVX2 variant's pass (19.4-20.0 ms) was not held back and
// the prefetch leaves it as it was. Prefetching SM3's column arrays the
// same way, or the update pass's column factors, gained nothing beyond the
// noise, so only the statistics pass does.
constexpr size_t kColPrefetchElems = 256;

template <class V, class T>
STRATA_CPU_ADAM_INLINE void PrefetchColumns(const T* p, size_t j) {
  PrefetchAt<V, V::kN, kColPrefetchElems, 3>(p, j);
}

// The update loops' prefetch: an array the loop streams through.
template <class V, size_t kElems, class T>
STRATA_CPU_ADAM_INLINE void PrefetchAhead(const T* p, size_t i) {
  PrefetchAt<V, kElems, kPrefetchElems, 3>(p, i);
}

// A read-only pass's prefetch: lines read once and dead after.
template <class V, size_t kElems, class T>
STRATA_CPU_ADAM_INLINE void PrefetchOnce(const T* p, size_t i) {
  PrefetchAt<V, kElems, kPrefetchOnceElems, 0>(p, i);
}

// The updated weights at i, and their working copy if there is one and
// kWork (else the caller streams it: Note [Whole lines of the working copy]).
template <class V, class W, bool kStream, bool kWork = true>
STRATA_CPU_ADAM_INLINE void StoreMaster(float* master, W* w, size_t i,
                                        typename V::F x) {
  V::Store(master + i, x);
  if constexpr (!std::is_same_v<W, NoWork> && kWork) {
    if constexpr (kStream) {
      V::Stream(w + i, x);
    } else {
      V::Store(w + i, x);
    }
  }
}

// Note [The bf16-moment denominator]: with fp32 moments Adam's denominator
// divides by sqrt(bc2) as torch does, since multiplying by its reciprocal
// moves the denominator by an ulp and 100 steps then drifted to 5.7e-6 from
// torch.optim.Adam (docs/cpu_adam.md). bf16 moments have no torch update to
// follow, and each step rounds them to 8 significant bits (2^-9 of the
// value), far more than the ulp (2^-24). So they take the 8-bit path's
// fma(sqrt(v), 1 / sqrt(bc2), eps): two divisions and two square roots per
// 16 elements instead of four and two, on the one divider unit that both
// kinds share. On AVX2 those are the loop's longest operations: llvm-mca's
// Zen 3 model of the bf16-moment AdamW loop (bf16 working copy), 37.2 ->
// 33.6 cycles per 16 elements, and without a working copy 30.8 -> 27.4; a
// Zen 3 core (divider throughput measured here: 5.2 cycles a square root,
// 3.3 a division, 8 lanes each), in `strata-bench adam` at 32M, the
// one-thread in-cache rate 0.729 and 0.731 -> 0.804, 0.820, 0.826 and 0.801
// G params/s.

// Updates the V::kN elements at i. Operation order mirrors torch 1.13's
// _single_tensor_adam / adamw / adagrad and the reference Lion:
//   Adam:    g += wd * p (fma);  m = m * b1, then fma(g, 1 - b1, m);
//            v = v * b2 + ((1 - b2) * g) * g;  d = sqrt(v) / bc2_sqrt + eps
//            (bf16 moments: fma(sqrt(v), 1 / bc2_sqrt, eps), Note [The
//            bf16-moment denominator]);  p = p + (-step_size * m) / d
//   AdamW:   as Adam without the L2 term, and p = p * (1 - lr * wd) first
//   Adagrad: g += wd * p;  v = v + g * g;  p = p + (-lr * g) / (sqrt(v) + eps)
//   Lion:    u = sign(fma(g, 1 - b1, m * b1));  p = p * (1 - lr * wd);
//            p = fma(u, -lr, p);  m = fma(g, 1 - b2, m * b2)
template <class V, CpuOptimizerAlgo A, class G, class M, class W, bool kStream,
          bool kWork = true>
STRATA_CPU_ADAM_INLINE typename V::F UpdateAt(const Consts<V>& c, float* master,
                                              const G* grad, M* m, M* v, W* w,
                                              size_t i) {
  using F = typename V::F;
  const F g0 = V::Mul(V::Load(grad + i), c.gscale);
  F x = V::Load(master + i);
  if constexpr (A == CpuOptimizerAlgo::kAdam || A == CpuOptimizerAlgo::kAdamW) {
    F g = g0;
    if constexpr (A == CpuOptimizerAlgo::kAdam) {
      if (c.use_l2) g = V::Fma(x, c.l2, g);
    }
    const F mm = V::Fma(g, c.omb1, V::Mul(V::Load(m + i), c.beta1));
    const F vv =
        V::Add(V::Mul(V::Load(v + i), c.beta2), V::Mul(V::Mul(c.omb2, g), g));
    F denom;  // Note [The bf16-moment denominator]
    if constexpr (std::is_same_v<M, float>) {
      denom = V::Add(V::Div(V::Sqrt(vv), c.bc2_sqrt), c.eps);
    } else {
      denom = V::Fma(V::Sqrt(vv), c.inv_bc2_sqrt, c.eps);
    }
    if constexpr (A == CpuOptimizerAlgo::kAdamW) {
      if (c.use_decay) x = V::Mul(x, c.decay);
    }
    x = V::Add(x, V::Div(V::Mul(c.neg_step, mm), denom));
    V::Store(m + i, mm);
    V::Store(v + i, vv);
  } else if constexpr (A == CpuOptimizerAlgo::kAdagrad) {
    F g = g0;
    if (c.use_l2) g = V::Fma(x, c.l2, g);
    const F vv = V::Add(V::Load(v + i), V::Mul(g, g));
    const F denom = V::Add(V::Sqrt(vv), c.eps);
    x = V::Add(x, V::Div(V::Mul(c.neg_step, g), denom));
    V::Store(v + i, vv);
  } else {
    static_assert(A == CpuOptimizerAlgo::kLion);
    const F m0 = V::Load(m + i);
    const F u = V::Sign(V::Fma(g0, c.omb1, V::Mul(m0, c.beta1)));
    if (c.use_decay) x = V::Mul(x, c.decay);
    x = V::Fma(u, c.neg_step, x);
    V::Store(m + i, V::Fma(g0, c.omb2, V::Mul(m0, c.beta2)));
  }
  StoreMaster<V, W, kStream, kWork>(master, w, i, x);
  return x;
}

// Note [Whole lines of the working copy]: where V's 16-bit working-copy
// store is half a 64-byte line (16 lanes: AVX2's two registers, AVX-512's
// one), StepRange and SM3's loop (ForSegment with kLines) update two vectors
// an iteration and stream both halves of a line back to back (StreamLines),
// after a single vector (a plain store: Note [Partial lines of the working
// copy]) that brings the copy to a line boundary. One
// half-line store an iteration, the other half one iteration (about 15 ns)
// later, had cost the loop more than the store itself. One Zen 3 core, in
// cache (16 Ki parameters, four alternating pairs): AdamW with fp32 moments
// 0.784 -> 0.818 G params/s on the means, with bf16 moments 0.710 -> 0.739
// (each faster in 3 of 4). `strata-bench adam --params 32M --variants avx2
// --reps 5`, one thread: AdamW with bf16 moments 0.802 -> 0.880 on the means
// (faster in 4 of 5 pairs), with fp32 moments 0.695 -> 0.759 (4 of 5); SM3
// with bf16 momentum 0.768 -> 0.952 (3 of 3), with fp32 0.911 -> 0.977 (2
// of 3); on two threads within the noise but for SM3 with bf16 momentum
// (1.344 -> 1.533, 3 of 3). Adafactor's update pass, at its memory bound
// already, read 0.81-0.91 of it on two threads with the pairs against
// 0.94-1.02 without (worse in 3 of 3), and keeps one vector an iteration. Plain
// stores instead were faster still in cache (up to 40%) but read each line
// before writing it, and from memory lost 10-30%. The same stores in another
// order: the same bits. Not measured on an AVX-512 host.

// Elements before the first one whose 16-bit working-copy address is
// aligned for a V::kN-wide non-temporal store, or SIZE_MAX when the address
// is not even 2-byte aligned (then no streaming).
template <class V>
inline size_t StreamHead(const void* w) {
  constexpr uintptr_t kAlign = V::kN * 2;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(w);
  if (addr % 2 != 0) return SIZE_MAX;
  return ((kAlign - addr % kAlign) % kAlign) / 2;
}

// The arrays UpdateAt reads, for the V::kN elements kPrefetchElems ahead
// of i (Note [Software prefetch]).
template <class V, CpuOptimizerAlgo A, class G, class M>
STRATA_CPU_ADAM_INLINE void PrefetchStep(const float* master, const G* grad,
                                         const M* m, const M* v, size_t i) {
  PrefetchAhead<V, V::kN>(master, i);
  PrefetchAhead<V, V::kN>(grad, i);
  if constexpr (A != CpuOptimizerAlgo::kAdagrad) {
    PrefetchAhead<V, V::kN>(m, i);
  }
  if constexpr (A != CpuOptimizerAlgo::kLion) {
    PrefetchAhead<V, V::kN>(v, i);
  }
}

// Note [Partial lines of the working copy]: a 64-byte line of the working
// copy written partly by non-temporal stores and partly by plain ones costs
// far more than its stores, and a scalar head costs far more than its few
// elements. A factored pass runs ForSegment once a row, and a row whose
// working copy does not start on a line (a matrix whose columns are not a
// multiple of 16, a rank's part cut mid-row) paid both: the head's plain
// stores and the first streamed half line shared a line, and so did the
// row's last streamed half line and the next row's head. So only the whole
// lines between a segment's first and last line boundaries stream, the
// vectors before and after them store plainly, and a segment that does not
// start aligned for V's streaming stores skips the head and stores plainly
// throughout unless it has kStreamHeadMinElems elements or more. The same
// stores in other kinds: the same bits. From memory, one Zen 3 core, 4 Mi
// parameters, every array one element off a line (G params/s, medians of
// eight alternating runs): SM3 with fp32 momentum at 1000 columns 0.764 ->
// 1.216, at 512 columns 0.911 -> 1.070; Adafactor's update pass 1.098 ->
// 1.758 and 1.207 -> 1.730. With rows on lines the loops are the ones they
// were (SM3 at 512 columns 1.144 and 1.224 in the same runs: the host's
// noise). A head cost a row of 1000 columns about 240 ns (1.054 against
// 1.404 G params/s without one), and plain stores instead of streamed ones
// about 0.11 ns a parameter (SM3, 512 columns on lines, 1.33 against 1.55):
// the head pays from about 2200 elements.
//
// That threshold is the Zen 3 core's; a trait may set its own
// (kStreamHeadMinElems). On one core of an Intel Xeon with AVX-512 BF16
// (2 MiB of L2, a shared VM), 128M parameters as 131072 x 1000 from memory,
// two alternating runs each, G params/s with the head on every row (a
// threshold of 0) against 2048: avx512bf16 SM3 with fp32 momentum
// 1.162-1.175 against 0.928-0.931 (0.89-0.90 of its bound against 0.72),
// Adafactor 1.008-1.009 against 0.947-0.948 (its update pass 0.81 against
// 0.74); avx2 on the same core SM3 1.115-1.116 against 1.008-1.012. A row's
// 64-byte vectors that start off a line each load two lines there, which
// costs more than the head's few scalar elements. The AVX-512 trait takes
// the head on every row; AVX2 keeps 2048, as measured on Zen 3. Rows on
// lines (columns a multiple of 16) have no head and are not affected.
constexpr size_t kStreamHeadMinElems = 2048;

template <class V>
constexpr size_t StreamHeadMinElems() {
  if constexpr (requires { V::kStreamHeadMinElems; }) {
    return V::kStreamHeadMinElems;
  } else {
    return kStreamHeadMinElems;
  }
}

// Runs op over [j, end) of the row at `base`, j and end on line boundaries
// of the working copy (Note [Whole lines of the working copy]): two vectors
// an iteration, each line's halves streamed back to back. Only where a
// vector's working copy is half a line. op has Prefetch(j) and At<U,
// kStream, kWork>(j), which returns the new weights.
template <class V, class W, class Op>
STRATA_CPU_ADAM_INLINE void StreamLines(W* w, size_t base, size_t j, size_t end,
                                        Op& op) {
  static_assert(V::kN * sizeof(W) * 2 == 64);
  for (; j < end; j += 2 * V::kN) {
    op.Prefetch(j);
    op.Prefetch(j + V::kN);
    const typename V::F x0 = op.template At<V, true, false>(j);
    const typename V::F x1 = op.template At<V, true, false>(j + V::kN);
    V::Stream(w + (base + j), x0);
    V::Stream(w + (base + j + V::kN), x1);
  }
}

// Calls op.template At<U, kStream>(j) for j in [c0, c1) of row `row`:
// V's body (after op.Prefetch(j), Note [Software prefetch]) and a scalar
// tail; the working copy's whole lines streamed (with kLines two vectors
// an iteration: StreamLines), the rest stored plainly (Note [Partial lines
// of the working copy]), after a scalar head that aligns it for V where
// the segment is long enough to pay for one.
template <class V, bool kLines, class W, class Op>
STRATA_CPU_ADAM_INLINE void ForSegment(W* w, size_t row, size_t c0, size_t c1,
                                       Op& op) {
  size_t j = c0;
  if constexpr (!std::is_same_v<W, NoWork> && V::kN > 1) {
    const size_t head = StreamHead<V>(w + (row + j));
    if (head == 0 || (head != SIZE_MAX && c1 - c0 >= StreamHeadMinElems<V>())) {
      for (const size_t stop = std::min(c1, j + head); j < stop; ++j) {
        op.template At<Scalar, false>(j);
      }
      for (; j + V::kN <= c1 &&
             reinterpret_cast<uintptr_t>(w + (row + j)) % 64 != 0;
           j += V::kN) {
        op.Prefetch(j);
        op.template At<V, false>(j);
      }
      constexpr size_t kLine = 64 / sizeof(W);  // elements of a line
      const size_t lines_end = j + (c1 - j) / kLine * kLine;
      if constexpr (kLines && V::kN * sizeof(W) * 2 == 64) {
        StreamLines<V>(w, row, j, lines_end, op);
        j = lines_end;
      }
      for (; j < lines_end; j += V::kN) {
        op.Prefetch(j);
        op.template At<V, true>(j);
      }
    }
  }
  for (; j + V::kN <= c1; j += V::kN) {
    op.Prefetch(j);
    op.template At<V, false>(j);
  }
  for (; j < c1; ++j) op.template At<Scalar, false>(j);
}

// The constants of the vector type U an Op is called with: V's or Scalar's.
template <class U, template <class> class C, class V>
STRATA_CPU_ADAM_INLINE const C<U>* PickConsts(const C<V>& cv,
                                              const C<Scalar>& cs) {
  if constexpr (std::is_same_v<U, Scalar>) {
    return &cs;
  } else {
    return &cv;
  }
}

// UpdateAt over StepRange's arrays, as an op of ForSegment.
template <class V, CpuOptimizerAlgo A, class G, class M, class W>
struct StepOp {
  const Consts<V>& cv;
  const Consts<Scalar>& cs;
  float* master;
  const G* grad;
  M* m;
  M* v;
  W* w;

  STRATA_CPU_ADAM_INLINE void Prefetch(size_t i) const {
    PrefetchStep<V, A>(master, grad, m, v, i);
  }
  template <class U, bool kStream, bool kWork = true>
  STRATA_CPU_ADAM_INLINE typename U::F At(size_t i) const {
    return UpdateAt<U, A, G, M, W, kStream, kWork>(*PickConsts<U>(cv, cs),
                                                   master, grad, m, v, w, i);
  }
};

template <class V, CpuOptimizerAlgo A, class G, class M, class W>
void StepRange(const StepParams& p, const StepArrays& a, size_t begin,
               size_t end) {
  const Consts<V> cv(p);
  const Consts<Scalar> cs(p);
  float* master = a.master;
  const G* grad = static_cast<const G*>(a.grad);
  M* m = static_cast<M*>(a.m);
  M* v = static_cast<M*>(a.v);
  W* w = static_cast<W*>(a.working);
  StepOp<V, A, G, M, W> op{cv, cs, master, grad, m, v, w};
  ForSegment<V, true>(w, 0, begin, end, op);
  // NT stores are weakly ordered; see KernelTable::step
  if constexpr (!std::is_same_v<W, NoWork>) V::Fence();
}

// ---- 8-bit block states ----------------------------------------------------
//
// Note [8-bit states]: each block of kCpuBlock8Elems elements has one fp32
// scale per moment, and each element one byte per moment:
//   m: sign and a 7-bit E4M3 float of |m| / s_m, s_m the smallest power of
//      two with trunc(absmax(m)) / s_m <= 1.875 (the largest code; trunc:
//      Note [The absmax of the top halves]);
//   v: stored as r = sqrt(v), an unsigned 8-bit E4M4 float of r / s_r,
//      s_r the smallest power of two with trunc(absmax(r)) / s_r <= 1.9375,
//      and never rounded to code 0 unless r is 0 (a zero denominator would
//      turn a tiny first moment into a huge step).
// The scales' exponents are clamped to [-111, 127]. Dividing by a power of
// two is exact and only moves the exponent, so the encoders need no
// multiply: the scale's exponent is folded into their bias. Decoding takes
// any fp32 scale. Code 0 is zero; no subnormals. Relative error of a code:
// at most 2^-4 (m) and 2^-5 (r) of the value, for values down to 2^-14 of
// the block's absmax (below that m flushes to zero, r to the smallest
// code). The codecs are integer arithmetic on the fp32 bits (round to
// nearest, ties away from zero, on the dropped mantissa bits), the same on
// every variant. The update reads the old codes, computes the new moments
// in fp32 (the weights use them unrounded), keeps the top halves of their fp32
// values (all the encoders need) in a per-block scratch, takes their absmax,
// and then writes the new codes and scales: one pass over memory, two over a
// block in cache. (A scratch of whole fp32 values, twice the size, left the
// step 4% slower from memory on one Zen 4 core: 1.58 against 1.65 G params/s.)
//
// Note [Codecs on 16-bit lanes]: every code is a function of the top 16 bits
// of its fp32 value, and every decoded value has a zero low half, so the
// codecs work on 16-bit lanes, twice as many per register as fp32 lanes:
// the top halves of two fp32 registers are gathered into one, coded, and
// narrowed to bytes (HTop, HStoreU8), and the codes are widened the other
// way (HLoadU8, HWiden). Rounding ties away from zero on the dropped bits
// looks only at the highest of them, which is in the top half: add half a
// code step to the top half and truncate. Measured in cache on one Zen 4
// core (AVX-512): decoding both moments 0.135 -> 0.106 ns per element,
// encoding them 0.178 -> 0.109, against the same codecs on fp32 lanes.
constexpr uint16_t kM8Bias = (127 - 15) << 3;  // exponent 2^-15 -> code 1
constexpr uint16_t kR8Bias = (127 - 15) << 4;
// The largest codes' mantissa bits, as fp32 mantissa bits (1.875, 1.9375).
constexpr uint32_t kM8TopMant = 0x700000;
constexpr uint32_t kR8TopMant = 0x780000;
// The encoders' subtrahends for a scale of 1 (k = 0): the bias, less half a
// code step (bit 3 of the top half for m, bit 2 for r).
constexpr int kM8Sub = (kM8Bias << 4) - (1 << 3);
constexpr int kR8Sub = (kR8Bias << 3) - (1 << 2);

// V::kH / V::kN fp32 registers per 16-bit register: 1 or 2.
template <class V>
constexpr size_t kPerH = V::kH / V::kN;

// Calls f(k) for k = 0, ..., kPerH<V> - 1, unrolled: as a loop GCC kept the
// two iterations and spilled their registers to the stack.
template <class V, class Fn>
STRATA_CPU_ADAM_INLINE void ForEachF(Fn&& f) {
  [&]<size_t... k>(std::index_sequence<k...>) { (f(k), ...); }
  (std::make_index_sequence<kPerH<V>>());
}

template <class V>
STRATA_CPU_ADAM_INLINE void WidenH(typename V::H bits, typename V::F* out) {
  out[0] = V::template HWiden<0>(bits);
  if constexpr (kPerH<V> == 2) out[1] = V::template HWiden<1>(bits);
}

// The top halves of the fp32 values of m / s_m are sign, 8-bit exponent and
// 7 mantissa bits; the code keeps the exponent's low 4 bits and 3 mantissa
// bits: (top - (bias << 4)) >> 4, sign at bit 7.
template <class V>
STRATA_CPU_ADAM_INLINE void DecodeM8(typename V::H c, typename V::F* out) {
  using H = typename V::H;
  const H mag = V::HAnd(c, V::HSet(0x7f));
  const H top =
      V::HZeroIfZero(mag, V::template HSll<4>(V::HAdd(mag, V::HSet(kM8Bias))));
  WidenH<V>(V::HOr(top, V::template HSll<8>(V::HAnd(c, V::HSet(0x80)))), out);
}

template <class V>
STRATA_CPU_ADAM_INLINE void DecodeR8(typename V::H c, typename V::F* out) {
  WidenH<V>(
      V::HZeroIfZero(c, V::template HSll<3>(V::HAdd(c, V::HSet(kR8Bias)))),
      out);
}

// The magnitude code of a moment / 2^k from the moment's top half: sub =
// bias + 128 k - half a code step takes off the codes' bias and the scale's
// exponent (the top half's exponent field starts at bit 7) and rounds, in
// one saturating subtraction that also sends values below the smallest code
// to 0; kShift drops the mantissa bits the code does not keep. Where the
// value lies above the scale's range the result exceeds the largest code
// (it is at most 0x7fff >> kShift): the callers clamp it.
// `mag` is the top half without its sign bit, Magnitude(top).
template <class V, int kShift>
STRATA_CPU_ADAM_INLINE typename V::H MagnitudeCode(typename V::H mag,
                                                   typename V::H sub) {
  return V::template HSrl<kShift>(V::HSubSat(mag, sub));
}

template <class V>
STRATA_CPU_ADAM_INLINE typename V::H Magnitude(typename V::H top) {
  return V::HAnd(top, V::HSet(0x7fff));
}

// m / s_m, sub = kM8Sub + 128 k: 3 mantissa bits, the sign at bit 7.
template <class V>
STRATA_CPU_ADAM_INLINE typename V::H EncodeM8(typename V::H top,
                                              typename V::H mag,
                                              typename V::H sub) {
  return V::HOr(V::HMin(MagnitudeCode<V, 4>(mag, sub), V::HSet(127)),
                V::HAnd(V::template HSrl<8>(top), V::HSet(0x80)));
}

// r / s_r, sub = kR8Sub + 128 k: 4 mantissa bits; r >= 0 (or NaN, of either
// sign: the largest code). Code 0 only where r's top half, read as a signed
// integer, is not positive: r is zero (or denormal, which the square root
// of a fp32 never is) or negative. Lanes above the largest code, 255, are
// left to HStoreU8's saturation.
template <class V>
STRATA_CPU_ADAM_INLINE typename V::H EncodeR8(typename V::H top,
                                              typename V::H mag,
                                              typename V::H sub) {
  return V::HMax(MagnitudeCode<V, 3>(mag, sub), V::HMin(top, V::HSet(1)));
}

// Both moments' codes: with V's HStoreU8Pair where it has one (AVX2 narrows
// the two with one pack), else two HStoreU8.
template <class V>
STRATA_CPU_ADAM_INLINE void StoreCodes(uint8_t* p, typename V::H a, uint8_t* q,
                                       typename V::H b) {
  if constexpr (requires { V::HStoreU8Pair(p, a, q, b); }) {
    V::HStoreU8Pair(p, a, q, b);
  } else {
    V::HStoreU8(p, a);
    V::HStoreU8(q, b);
  }
}

// Per-block state of one Step8 block: the multipliers of the decoded old
// codes and of the gradient (broadcast), and the running absmax of the new
// moments' magnitudes (Note [The absmax of the top halves]).
template <class V>
struct Block8Acc {
  typename V::F m1;  // s_m * beta1
  typename V::F m2;  // Adam: s_r * s_r * beta2; Lion: s_m * beta2
  typename V::F g1;  // gscale * (1 - beta1)
  typename V::F g2;  // Adam: (1 - b2) gscale^2; Lion: gscale * (1 - beta2)
  typename V::H amax_m, amax_r;
  // Adam(W): the gradient's scale is in g1 and g2 (Note [The gradient's
  // scale in the 8-bit update]).
  bool folded;
};

// Note [The gradient's scale in the 8-bit update]: Adam(W) with 8-bit
// states takes the gradient's scale into its two coefficients, g1 =
// gscale (1 - b1) and g2 = (1 - b2) gscale^2, instead of multiplying each
// gradient by it: one multiply fewer per register, as Lion's update
// already had. At gscale 1 the coefficients are 1 - b1 and 1 - b2, and the
// bits are those of the unfolded form. The scale stays on the gradient
// where the fold does not hold or would lose bits: Adam with an L2 term
// (added to the scaled gradient), and a g1 or g2 that is not 0 and not a
// normal float (gscale^2 under- or overflowing, for a scale below about
// 1e-17 or above 1e17 at b2 = 0.999). In cache on one Zen 3 core (AVX2,
// 8192 parameters, bf16 working copy, best of 7 x 8000 steps, six
// alternating pairs at each scale): 1.240 -> 1.270 G params/s at gscale
// 1 and 1.244 -> 1.262 at 0.6, faster in 11 of the 12 pairs.
inline bool Block8Folds(const StepParams& p, double g1, double g2) {
  auto normal_or_zero = [](double x) {
    return x == 0.0 || (std::fabs(x) >= FLT_MIN && std::fabs(x) <= FLT_MAX);
  };
  return !(p.algo == CpuOptimizerAlgo::kAdam && p.use_l2) &&
         normal_or_zero(g1) && normal_or_zero(g2);
}

template <class V, CpuOptimizerAlgo A>
Block8Acc<V> MakeBlock8Acc(const StepParams& p, float sm, float sr) {
  const bool lion = A == CpuOptimizerAlgo::kLion;
  // The scales come from memory (a checkpoint, say). s_r^2 b2 exceeds the
  // fp32 range only for s_r above 2^64, which no fp32 v gives (r = sqrt(v)
  // < 2^64); converting such a double to float would be undefined, so it
  // becomes inf, as an fp32 product would.
  const double sq = static_cast<double>(sr) * sr * p.beta2;
  const float m2 = sq > FLT_MAX ? INFINITY : static_cast<float>(sq);
  const double gs = p.gscale;
  const double g1 = gs * p.omb1;
  const double g2 = lion ? gs * p.omb2 : p.omb2 * gs * gs;
  const bool folded = !lion && Block8Folds(p, g1, g2);
  return {V::Set(sm * p.beta1),
          V::Set(lion ? sm * p.beta2 : m2),
          V::Set(static_cast<float>(g1)),
          V::Set(lion || folded ? static_cast<float>(g2) : 0.0f),
          V::HSet(0),
          V::HSet(0),
          folded};
}

// The V::kN elements at i of a block, with their decoded old codes dm and
// dr (scale not applied): the new moments in mm and rr (Adam only), and
// the weights' step returned (q for Adam(W), u for Lion), which Apply8
// applies. The 8-bit states have no torch counterpart to mirror, so the
// scales and betas are folded into one multiplier and products fused where
// that saves an instruction:
//   Adam(W): m = fma(g, gscale (1 - b1), dm * (s_m b1));
//            v = fma(dr, dr * (s_r^2 b2), (((1 - b2) gscale^2) * g) * g)
//            (g unscaled; Note [The gradient's scale in the 8-bit update]);
//            r = sqrt(v);  d = fma(r, 1 / bc2_sqrt, eps);  q = (-step * m) / d
//            p = fma(p, 1 - lr wd, q) (AdamW with decay) or p + q
//   Lion:    u = sign(fma(g, gscale (1 - b1), dm * (s_m b1)));
//            p = fma(u, -lr, p * (1 - lr wd));
//            m = fma(g, gscale (1 - b2), dm * (s_m b2))  (g unscaled)
template <class V, CpuOptimizerAlgo A, class G>
STRATA_CPU_ADAM_INLINE typename V::F Moments8At(
    const Consts<V>& c, const StepArrays& a, const G* grad, typename V::F dm,
    typename V::F dr, size_t i, typename V::F& mm, typename V::F& rr,
    const Block8Acc<V>& acc) {
  using F = typename V::F;
  if constexpr (A == CpuOptimizerAlgo::kAdam || A == CpuOptimizerAlgo::kAdamW) {
    F g = V::Load(grad + i);
    F vg;  // (1 - b2) g^2 of the scaled gradient
    if (acc.folded) {
      mm = V::Fma(g, acc.g1, V::Mul(dm, acc.m1));
      vg = V::Mul(V::Mul(acc.g2, g), g);
    } else {
      g = V::Mul(g, c.gscale);
      if constexpr (A == CpuOptimizerAlgo::kAdam) {
        if (c.use_l2) g = V::Fma(V::Load(a.master + i), c.l2, g);
      }
      mm = V::Fma(g, c.omb1, V::Mul(dm, acc.m1));
      vg = V::Mul(V::Mul(c.omb2, g), g);
    }
    const F vv = V::Fma(dr, V::Mul(dr, acc.m2), vg);
    rr = V::Sqrt(vv);
    return V::Div(V::Mul(c.neg_step, mm), V::Fma(rr, c.inv_bc2_sqrt, c.eps));
  } else {
    static_assert(A == CpuOptimizerAlgo::kLion);
    rr = dr;  // unused: Lion keeps no second moment
    const F g = V::Load(grad + i);
    mm = V::Fma(g, acc.g2, V::Mul(dm, acc.m2));
    return V::Sign(V::Fma(g, acc.g1, V::Mul(dm, acc.m1)));
  }
}

// The weights x after their step d (Moments8At's).
template <class V, CpuOptimizerAlgo A>
STRATA_CPU_ADAM_INLINE typename V::F Apply8(const Consts<V>& c, typename V::F x,
                                            typename V::F d) {
  if constexpr (A == CpuOptimizerAlgo::kLion) {
    if (c.use_decay) x = V::Mul(x, c.decay);
    return V::Fma(d, c.neg_step, x);
  } else {
    if (A == CpuOptimizerAlgo::kAdamW && c.use_decay) {
      return V::Fma(x, c.decay, d);
    }
    return V::Add(x, d);
  }
}

// Note [The 8-bit update in two sweeps]: a trait with kSplitUpdate8 set
// runs a block's update as two sweeps over it: the codecs and the moments
// first, each step d into a per-block scratch (8 KiB, in L1), then the
// weights from d. The first sweep's iterations are then shorter (no weight
// load, no working-copy rounding, no stores of either), so the reorder
// window holds more of them around the square roots and divisions, whose
// latency one iteration of the whole update did not hide. Same operations
// on the same values, so the same bits. On AVX2 (one Zen 3 core, 32 Ki
// parameters in cache, best of 5 x 10000 steps, alternating runs): 8-bit
// AdamW with a bf16 working copy 0.69-0.86 -> 0.73-1.06 G params/s (faster
// in 9 of 10 pairs, means 0.78 -> 0.98), 8-bit Lion 1.19-1.25 -> 1.22-1.54
// (5 of 5), 8-bit AdamW without a working copy 0.99 -> 1.11 on the means
// (3 of 5). llvm-mca's Zen 3 model, which has no such window limit, gives
// the first sweep 30.5 cycles per 16 elements against 41.4 for the single
// one. AVX-512 keeps one sweep: on one core of an Intel Xeon with AVX-512
// BF16 (2 MiB of L2, a shared VM), 64M parameters from memory, two
// alternating runs each, 8-bit AdamW ran at 1.462-1.481 G params/s with one
// sweep against 1.349-1.350 with two (2.867-2.881 against 2.613-2.621 on two
// cores), and 8-bit Lion 1.619-1.631 against 1.587-1.608. Either form runs on
// every variant (StepParams::split8, from CpuOptimizerOptions::block8_sweeps),
// so that a host can time both: the trait only sets what the table offers as
// the variant's own.
template <class V>
constexpr bool SplitsUpdate8() {
  if constexpr (requires { V::kSplitUpdate8; }) {
    return V::kSplitUpdate8;
  } else {
    return false;
  }
}

// The V::kH elements at i of a block starting at b: decode, update each
// V::kN of them, keep the top halves of the new moments in the block
// scratch at j (all the encoders need of them), and write their codes
// against the old scales' subtrahends sub_m and sub_r (Note [Codes against
// the old scale]).
template <class V, CpuOptimizerAlgo A, class G, class W, bool kStream,
          bool kSplit>
STRATA_CPU_ADAM_INLINE void Update8H(const Consts<V>& c, const StepArrays& a,
                                     const G* grad, uint8_t* mc, uint8_t* rc,
                                     W* w, uint16_t* mtop, uint16_t* rtop,
                                     float* steps, size_t i, size_t j,
                                     typename V::H sub_m, typename V::H sub_r,
                                     Block8Acc<V>& acc) {
  typename V::F dm[kPerH<V>], dr[kPerH<V>], mm[kPerH<V>], rr[kPerH<V>];
  DecodeM8<V>(V::HLoadU8(mc + i), dm);
  if constexpr (A == CpuOptimizerAlgo::kLion) {
    ForEachF<V>([&](size_t k) { dr[k] = dm[k]; });  // unused
  } else {
    DecodeR8<V>(V::HLoadU8(rc + i), dr);
  }
  ForEachF<V>([&](size_t k) {
    const size_t at = i + k * V::kN;
    const typename V::F d =
        Moments8At<V, A, G>(c, a, grad, dm[k], dr[k], at, mm[k], rr[k], acc);
    if constexpr (kSplit) {
      V::Store(steps + j + k * V::kN, d);
    } else {
      StoreMaster<V, W, kStream>(a.master, w, at,
                                 Apply8<V, A>(c, V::Load(a.master + at), d));
    }
  });
  const typename V::H tm = V::HTop(mm);
  const typename V::H am = Magnitude<V>(tm);
  acc.amax_m = V::HMax(acc.amax_m, am);
  V::HStore(mtop + j, tm);
  if constexpr (A == CpuOptimizerAlgo::kLion) {
    V::HStoreU8(mc + i, EncodeM8<V>(tm, am, sub_m));
  } else {
    const typename V::H tr = V::HTop(rr);
    const typename V::H ar = Magnitude<V>(tr);
    acc.amax_r = V::HMax(acc.amax_r, ar);
    V::HStore(rtop + j, tr);
    StoreCodes<V>(mc + i, EncodeM8<V>(tm, am, sub_m), rc + i,
                  EncodeR8<V>(tr, ar, sub_r));
  }
}

// Note [The absmax of the top halves]: the encoders read only the top 16
// bits of a moment, so the block's scale is chosen from the largest top
// half too (sign cleared): the fp32 absmax with its low 16 bits dropped. A
// value whose dropped bits would lift it past the largest code at that
// scale still codes as the largest code (the encoders never see those
// bits), within 2^-7 of it. Taking the maximum on the 16-bit lanes the
// encoders already hold, instead of on the fp32 lanes, saves an and and a
// max per fp32 register per moment.
//
// The fp32 bits of the largest magnitude in acc (vector lanes) and sacc
// (the scalar tail), low half zero.
template <class V>
inline uint32_t AmaxBits(typename V::H acc, uint16_t sacc) {
  alignas(64) uint16_t lanes[V::kH];
  V::HStore(lanes, acc);
  uint16_t m = sacc;
  for (const uint16_t x : lanes) m = std::max(m, x);
  return static_cast<uint32_t>(m) << 16;
}

// The scale of a block whose new moments have absmax `bits` (the fp32 bits
// of a non-negative value or a NaN), and the encoders' subtrahend for it
// (`base` + 128 k). A zero or non-finite absmax keeps absmax / top as the
// scale (0, inf or NaN, as a scale of its own kind would) and codes
// everything 0 but r's floor.
inline float Block8Scale(uint32_t bits, uint32_t top_mant, int base,
                         uint16_t* sub) {
  const uint32_t field = bits >> 23;
  if (bits == 0 || field >= 255) {
    *sub = 0xffff;
    const float top = BitsFloat((127u << 23) | top_mant);
    return BitsFloat(bits) / top;
  }
  int k = static_cast<int>(field) - 127 + ((bits & 0x7fffffu) > top_mant);
  k = std::clamp(k, -111, 127);
  *sub = static_cast<uint16_t>(base + 128 * k);
  return BitsFloat(static_cast<uint32_t>(k + 127) << 23);
}

// Note [Codes against the old scale]: a block's scale moves only when its
// absmax crosses a power of two, so most steps keep it. The update loop
// therefore writes each new code at once, against the subtrahend of the
// block's old scale, while the code's line is still in L1, and keeps the
// top halves in the scratch as before. When the new scale's subtrahend
// equals the old one, those codes are exactly what the encoding pass would
// write (a code is a function of the top half and the subtrahend only), and
// the pass is skipped; otherwise it rewrites every code of the block. A
// scale that Block8Scale cannot have written (zero, the first step's; not a
// power of two in [2^-111, 2^127], from outside) never matches. On one Zen
// 4 core from memory the encoding pass had cost 20% of the 8-bit AdamW step
// (2.15-2.20 G params/s against 2.57-2.67 with the pass left out, timing
// only).
//
// The encoders' subtrahend of an old scale `s`, if Block8Scale could have
// chosen it (a power of two 2^k, k in [-111, 127]).
inline bool Block8OldSub(float s, int base, uint16_t* sub) {
  const uint32_t bits = FloatBits(s);
  const uint32_t field = bits >> 23;  // the sign bit included: s > 0 only
  if ((bits & 0x7fffffu) != 0 || field == 0 || field >= 255) return false;
  const int k = static_cast<int>(field) - 127;
  if (k < -111 || k > 127) return false;
  *sub = static_cast<uint16_t>(base + 128 * k);
  return true;
}

// Codes of the V::kH scratch moments at j, written at i.
template <class V, bool kAdam>
STRATA_CPU_ADAM_INLINE void Encode8H(const uint16_t* mtop, const uint16_t* rtop,
                                     typename V::H sub_m, typename V::H sub_r,
                                     uint8_t* mc, uint8_t* rc, size_t i,
                                     size_t j) {
  const typename V::H tm = V::HLoad(mtop + j);
  const typename V::H cm = EncodeM8<V>(tm, Magnitude<V>(tm), sub_m);
  if constexpr (kAdam) {
    const typename V::H tr = V::HLoad(rtop + j);
    StoreCodes<V>(mc + i, cm, rc + i, EncodeR8<V>(tr, Magnitude<V>(tr), sub_r));
  } else {
    V::HStoreU8(mc + i, cm);
  }
}

// Note [Local copies of the arrays]: a vector store may alias any object,
// so through a reference to StepArrays (or FactoredArrays and
// FactoredParams) GCC reloaded the array pointers and the flags after every
// vector store in the loops. The kernels that read them per element work on
// local copies whose addresses never escape, which stay in registers.
// Measured in cache on one Zen 4 core: 8-bit AdamW 2.04 -> 2.21 G params/s
// (with the unrolling of ForEachF), Adafactor 1.77 -> 1.89, SM3 3.09 ->
// 3.29 (512 columns).
template <class V, CpuOptimizerAlgo A, class G, class W, bool kStream,
          bool kSplit>
void Step8Block(const StepParams& p, const StepArrays& arrays, size_t b,
                size_t e, uint16_t* mtop, uint16_t* rtop, float* steps) {
  const StepArrays a = arrays;  // Note [Local copies of the arrays]
  constexpr bool kAdam =
      A == CpuOptimizerAlgo::kAdam || A == CpuOptimizerAlgo::kAdamW;
  const Consts<V> cv(p);
  const Consts<Scalar> cs(p);
  const G* grad = static_cast<const G*>(a.grad);
  W* w = static_cast<W*>(a.working);
  uint8_t* mc = static_cast<uint8_t*>(a.m);
  uint8_t* rc = static_cast<uint8_t*>(a.v);
  float* ms = reinterpret_cast<float*>(mc + Block8ScaleOffset(a.n));
  float* rs =
      kAdam ? reinterpret_cast<float*>(rc + Block8ScaleOffset(a.n)) : nullptr;
  const size_t blk = b / kCpuBlock8Elems;
  const float sm = ms[blk];
  const float sr = kAdam ? rs[blk] : 0.0f;
  Block8Acc<V> acc = MakeBlock8Acc<V, A>(p, sm, sr);
  Block8Acc<Scalar> sacc = MakeBlock8Acc<Scalar, A>(p, sm, sr);
  // Note [Codes against the old scale]. Without a usable old scale the
  // update still writes codes, which the encoding pass then replaces.
  uint16_t old_m = 0xffff, old_r = 0xffff;
  bool keep = Block8OldSub(sm, kM8Sub, &old_m);
  if constexpr (kAdam) keep = Block8OldSub(sr, kR8Sub, &old_r) && keep;
  const typename V::H vold_m = V::HSet(old_m), vold_r = V::HSet(old_r);
  size_t i = b;
  for (; i + V::kH <= e; i += V::kH) {
    PrefetchAhead<V, V::kH>(a.master, i);
    PrefetchAhead<V, V::kH>(grad, i);
    PrefetchAhead<V, V::kH>(mc, i);
    if constexpr (kAdam) PrefetchAhead<V, V::kH>(rc, i);
    Update8H<V, A, G, W, kStream, kSplit>(cv, a, grad, mc, rc, w, mtop, rtop,
                                          steps, i, i - b, vold_m, vold_r, acc);
  }
  if constexpr (kSplit) {  // Note [The 8-bit update in two sweeps]
    for (size_t k = b; k < i; k += V::kN) {
      StoreMaster<V, W, kStream>(
          a.master, w, k,
          Apply8<V, A>(cv, V::Load(a.master + k), V::Load(steps + (k - b))));
    }
  }
  for (; i < e; ++i) {
    Update8H<Scalar, A, G, W, false, false>(cs, a, grad, mc, rc, w, mtop, rtop,
                                            nullptr, i, i - b, old_m, old_r,
                                            sacc);
  }
  uint16_t sub_m = 0, sub_r = 0;
  ms[blk] = Block8Scale(AmaxBits<V>(acc.amax_m, sacc.amax_m), kM8TopMant,
                        kM8Sub, &sub_m);
  if constexpr (kAdam) {
    rs[blk] = Block8Scale(AmaxBits<V>(acc.amax_r, sacc.amax_r), kR8TopMant,
                          kR8Sub, &sub_r);
  }
  if (keep && sub_m == old_m && (!kAdam || sub_r == old_r)) return;
  for (i = b; i + V::kH <= e; i += V::kH) {
    Encode8H<V, kAdam>(mtop, rtop, V::HSet(sub_m), V::HSet(sub_r), mc, rc, i,
                       i - b);
  }
  for (; i < e; ++i) {
    Encode8H<Scalar, kAdam>(mtop, rtop, sub_m, sub_r, mc, rc, i, i - b);
  }
}

template <class V, CpuOptimizerAlgo A, class G, class W>
void Step8Range(const StepParams& p, const StepArrays& a, size_t begin,
                size_t end) {
  alignas(64) uint16_t mtop[kCpuBlock8Elems];
  alignas(64) uint16_t rtop[kCpuBlock8Elems];
  alignas(64) float steps[kCpuBlock8Elems];  // with p.split8
  // Blocks start at multiples of kCpuBlock8Elems, so the working copy is
  // aligned for V's non-temporal stores at every block start or at none.
  bool stream = false;
  if constexpr (!std::is_same_v<W, NoWork> && V::kN > 1) {
    stream = StreamHead<V>(static_cast<W*>(a.working) + begin) == 0;
  }
  // The block function for this call's stream and sweeps, chosen once.
  using BlockFn = void (*)(const StepParams&, const StepArrays&, size_t, size_t,
                           uint16_t*, uint16_t*, float*);
  const BlockFn block =
      stream ? (p.split8 ? &Step8Block<V, A, G, W, true, true>
                         : &Step8Block<V, A, G, W, true, false>)
             : (p.split8 ? &Step8Block<V, A, G, W, false, true>
                         : &Step8Block<V, A, G, W, false, false>);
  for (size_t b = begin; b < end; b += kCpuBlock8Elems) {
    block(p, a, b, std::min(end, b + kCpuBlock8Elems), mtop, rtop, steps);
  }
  if (stream) V::Fence();  // see KernelTable::step
}

template <class V, CpuOptimizerAlgo A, class G, class M>
void StepW(const StepParams& p, const StepArrays& a, size_t b, size_t e) {
  if (!p.has_working) {
    StepRange<V, A, G, M, NoWork>(p, a, b, e);
  } else if (p.working_dtype == CpuDType::kFloat16) {
    StepRange<V, A, G, M, F16>(p, a, b, e);
  } else {
    StepRange<V, A, G, M, Bf16>(p, a, b, e);
  }
}

template <class V, CpuOptimizerAlgo A, class G>
void StepM(const StepParams& p, const StepArrays& a, size_t b, size_t e) {
  if constexpr (A != CpuOptimizerAlgo::kAdagrad) {
    if (p.moment_dtype == CpuDType::kBlock8) {
      if (!p.has_working) return Step8Range<V, A, G, NoWork>(p, a, b, e);
      if (p.working_dtype == CpuDType::kFloat16) {
        return Step8Range<V, A, G, F16>(p, a, b, e);
      }
      return Step8Range<V, A, G, Bf16>(p, a, b, e);
    }
  }
  if (p.moment_dtype == CpuDType::kBFloat16) {
    StepW<V, A, G, Bf16>(p, a, b, e);
  } else {
    StepW<V, A, G, float>(p, a, b, e);
  }
}

template <class V, CpuOptimizerAlgo A>
void StepG(const StepParams& p, const StepArrays& a, size_t b, size_t e) {
  switch (p.grad_dtype) {
    case CpuDType::kFloat32:
      return StepM<V, A, float>(p, a, b, e);
    case CpuDType::kFloat16:
      return StepM<V, A, F16>(p, a, b, e);
    case CpuDType::kBFloat16:
      return StepM<V, A, Bf16>(p, a, b, e);
    case CpuDType::kBlock8:  // state only; the driver refuses it here
      return;
  }
}

template <class V>
void Step(const StepParams& p, const StepArrays& a, size_t b, size_t e) {
  switch (p.algo) {
    case CpuOptimizerAlgo::kAdam:
      return StepG<V, CpuOptimizerAlgo::kAdam>(p, a, b, e);
    case CpuOptimizerAlgo::kAdamW:
      return StepG<V, CpuOptimizerAlgo::kAdamW>(p, a, b, e);
    case CpuOptimizerAlgo::kAdagrad:
      return StepG<V, CpuOptimizerAlgo::kAdagrad>(p, a, b, e);
    case CpuOptimizerAlgo::kLion:
      return StepG<V, CpuOptimizerAlgo::kLion>(p, a, b, e);
    case CpuOptimizerAlgo::kAdafactor:  // FactoredArrays kernels instead
    case CpuOptimizerAlgo::kSm3:
      return;
  }
}

// ---- Gradient statistics ---------------------------------------------------

template <class V, class G>
void GradStatsT(const G* g, size_t begin, size_t end, float scale,
                double* sum_sq, bool* finite) {
  const typename V::F s = V::Set(scale);
  typename V::D acc = V::DZero();
  typename V::Bad bad = V::BadZero();
  size_t i = begin;
  for (; i + V::kN <= end; i += V::kN) {
    const typename V::F x = V::Mul(V::Load(g + i), s);
    acc = V::SqAcc(acc, x);
    bad = V::BadOr(bad, x);
  }
  double tail = 0.0;
  bool tail_bad = false;
  for (; i < end; ++i) {
    const float x = Scalar::Mul(Scalar::Load(g + i), scale);
    tail = Scalar::SqAcc(tail, x);
    tail_bad = Scalar::BadOr(tail_bad, x);
  }
  *sum_sq = V::DSum(acc) + tail;
  *finite = !(V::BadAny(bad) || tail_bad);
}

template <class V>
void GradStats(const void* g, CpuDType dtype, size_t begin, size_t end,
               float scale, double* sum_sq, bool* finite) {
  switch (dtype) {
    case CpuDType::kFloat32:
      return GradStatsT<V>(static_cast<const float*>(g), begin, end, scale,
                           sum_sq, finite);
    case CpuDType::kFloat16:
      return GradStatsT<V>(static_cast<const F16*>(g), begin, end, scale,
                           sum_sq, finite);
    case CpuDType::kBFloat16:
      return GradStatsT<V>(static_cast<const Bf16*>(g), begin, end, scale,
                           sum_sq, finite);
    case CpuDType::kBlock8:  // state only; the driver refuses it here
      return;
  }
}

// ---- Conversion ------------------------------------------------------------

template <class V, class S, class T>
void ConvertT(const S* src, T* dst, size_t n) {
  size_t i = 0;
  for (; i + V::kN <= n; i += V::kN) V::Store(dst + i, V::Load(src + i));
  for (; i < n; ++i) Scalar::Store(dst + i, Scalar::Load(src + i));
}

template <class V, class S>
void ConvertTo(const S* src, void* dst, CpuDType dst_dtype, size_t n) {
  switch (dst_dtype) {
    case CpuDType::kFloat32:
      return ConvertT<V>(src, static_cast<float*>(dst), n);
    case CpuDType::kFloat16:
      return ConvertT<V>(src, static_cast<F16*>(dst), n);
    case CpuDType::kBFloat16:
      return ConvertT<V>(src, static_cast<Bf16*>(dst), n);
    case CpuDType::kBlock8:  // state only; the driver refuses it here
      return;
  }
}

template <class V>
void Convert(const void* src, CpuDType src_dtype, void* dst, CpuDType dst_dtype,
             size_t n) {
  switch (src_dtype) {
    case CpuDType::kFloat32:
      return ConvertTo<V>(static_cast<const float*>(src), dst, dst_dtype, n);
    case CpuDType::kFloat16:
      return ConvertTo<V>(static_cast<const F16*>(src), dst, dst_dtype, n);
    case CpuDType::kBFloat16:
      return ConvertTo<V>(static_cast<const Bf16*>(src), dst, dst_dtype, n);
    case CpuDType::kBlock8:  // state only; the driver refuses it here
      return;
  }
}

// ---- Factored optimizers (Adafactor, SM3) ----------------------------------
//
// Note [Reduction order]: a sum over a row segment [c0, c1) of a tile is
// kept in 16 double lanes, element c0 + k adding into lane k % 16 in
// order, and the lanes are then added as a fixed pairwise tree; segment
// sums add in row order, and the driver adds tiles' in tile order. Vector
// types with 16 lanes keep the lanes in registers, the scalar reference in
// an array, so every variant gets the same bits. Column sums add one row
// at a time (lane j is column j), and maxima are exact in any order.
//
// Adafactor's statistics pass first adds each lane's elements in float, a
// block of kSumBlock of them (the segment cut into blocks of kSumLanes *
// kSumBlock elements from c0), and adds each block's float sum into its
// double lane. Widening every vector to double cost that pass more than
// its loads: with bf16 gradients, from cache, one Zen 5 core, 2.2 ns a
// vector of 16 against 1.6. The float sums of 8 terms lose at most about 8
// units in the last place of a float, far below what the statistics'
// moving averages need.
constexpr size_t kSumLanes = 16;
constexpr size_t kSumBlock = 8;

// Adds each lane's float block sum into its double lane, and clears it.
inline void FlushBlock(double* lanes, float* block) {
  for (size_t k = 0; k < kSumLanes; ++k) {
    lanes[k] += static_cast<double>(block[k]);
    block[k] = 0.0f;
  }
}

inline double LaneTree(const double* l) {
  double a[8];
  for (size_t k = 0; k < 8; ++k) a[k] = l[2 * k] + l[2 * k + 1];
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// FactoredParams broadcast into registers once per tile.
template <class V>
struct FConsts {
  using F = typename V::F;
  explicit FConsts(const FactoredParams& p)
      : gscale(V::Set(p.gscale)),
        eps(V::Set(p.eps)),
        beta2(V::Set(p.beta2)),
        omb2(V::Set(p.omb2)),
        beta1(V::Set(p.beta1)),
        omb1(V::Set(p.omb1)),
        coef(V::Set(p.coef)),
        decay(V::Set(p.decay)),
        l2(V::Set(p.l2)),
        neg_lr(V::Set(p.neg_lr)),
        one(V::Set(1.0f)),
        minus_one(V::Set(-1.0f)) {}
  F gscale, eps, beta2, omb2, beta1, omb1, coef, decay, l2, neg_lr, one,
      minus_one;
};

// The row-major arrays a factored update reads (the gradient, the weights
// and, when there is one, the first moment), V::kN elements kPrefetchElems
// ahead of element i (Note [Software prefetch]). The per-column state stays
// in cache and is not prefetched.
template <class V, class G, class M>
STRATA_CPU_ADAM_INLINE void PrefetchFactored(const FactoredParams& p,
                                             const FactoredArrays& a,
                                             size_t i) {
  PrefetchAhead<V, V::kN>(static_cast<const G*>(a.grad), i);
  PrefetchAhead<V, V::kN>(a.master, i);
  if (p.use_m) PrefetchAhead<V, V::kN>(static_cast<const M*>(a.m), i);
}

// The gradient at i times gscale, or as loaded when kUnit (gscale == 1: x
// * 1 is x, and a signaling NaN's quiet bit is lost to the square that
// follows either way). Adafactor's statistics pass is bound by its
// arithmetic with bf16 gradients (see Note [Reduction order]); the kernel
// alone, one Zen 5 core, 16384 x 4096, bf16 gradient without the weights,
// three alternating runs (with AfGroupAt's first row peeled, which gave
// one build's loop a branch per row less): avx512bf16 7.6-7.8 ms against
// 8.3-8.4, avx2 11.9-12.2 against 13.1-13.4; fp32 with the weights within
// the noise.
template <class V, bool kUnit, class G>
STRATA_CPU_ADAM_INLINE typename V::F ScaledGrad(const FConsts<V>& c,
                                                const G* grad, size_t i) {
  if constexpr (kUnit) {
    return V::Load(grad + i);
  } else {
    return V::Mul(V::Load(grad + i), c.gscale);
  }
}

// x into a band's double partials at p: its first term (put) or added.
template <class U>
STRATA_CPU_ADAM_INLINE void DPutOrAccum(double* p, typename U::F x, bool put) {
  if (put) {
    U::DPut(p, x);
  } else {
    U::DAccum(p, x);
  }
}

// Adafactor pass 1 at j of row `row`: s = g^2 + eps1 (and a vector's
// statistic in place, its factor, and its update g / sqrt(v) into *u; a
// matrix's column sums); *x the weight when kParam.
template <class V, class G, bool kVec, bool kParam, bool kUnit>
STRATA_CPU_ADAM_INLINE typename V::F AfStatsAt(
    const FConsts<V>& c, const FactoredArrays& a, const G* grad, double* colp,
    bool first, size_t row, size_t j, typename V::F* x, typename V::F* u) {
  using F = typename V::F;
  const F g = ScaledGrad<V, kUnit>(c, grad, row + j);
  const F s = V::Add(V::Mul(g, g), c.eps);
  if constexpr (kVec) {
    const F col =
        V::Add(V::Mul(V::Load(a.col_state + j), c.beta2), V::Mul(c.omb2, s));
    V::Store(a.col_state + j, col);
    const F f = V::Div(c.one, V::Sqrt(col));
    V::Store(a.col_factor + j, f);
    *u = V::Mul(f, g);
  } else {
    DPutOrAccum<V>(colp + j, s, first);
  }
  if constexpr (kParam) *x = V::Load(a.master + (row + j));
  return s;
}

// Note [Adafactor's fused RMS] (kernels.h): each row's sum is known once
// the row has been read, and with it the row's factor w_i = 1 / R_i. With
// 2-byte gradients, and fp32 rows of up to kAfLagRowBytes
// (AdafactorLagsRows), the statistics pass reads row i
// from memory for its sums and, in the same loop, the row before it (still in
// L1 or L2) for g^2 w_{i-1}: a group's column sums of g^2 and of g^2 w_i add,
// in float and in row order, in the band's float accumulators (group_part), and
// when the group's last row has been added they go into the band's double
// partials (col_part: plus eps1 once for each of the group's rows;
// rms_part), in the same loop over the next row. A group is kAfGroupRows
// rows (the float sums of at most that many terms, the order of the bits
// the tests pin; AfGroupRows); groups restart at each tile's first row,
// and the tile's last row takes a pass of its own from cache.
//
// Wider fp32 rows keep the groups (AfStatsGroupedT): a group's rows (as
// many as fit in kAfGroupBytes, at most kAfGroupRows), read once from
// memory for their sums, are read again from L2 together, a column vector
// of each at a time, after the group's last row, into the same partials in
// the same order. Measured before the lagged loop (one Zen 5
// core, 16384 x 4096, the statistics kernel alone, best of 9): groups of 4 rows
// 33-35 ms, of 8 28-30, of 16 23-25, against 30-32 for unfused statistics and
// RMS passes. No line streamed in while a group was read again, and the
// gradient alone ran at 3.2-3.3 ns per 16 elements, where a plain read runs
// at 1.8. Two ways of filling that wait had lost: the previous group's columns
// read a slice at a time while the next group streams in (35-38 ms
// against 24-26: two groups in L2 and the back-and-forth between them),
// and prefetching the next group's rows during the read-back (16.4-18.1
// ms against 12.9-13.8 without the weights).
//
// Note [The next group's first rows]: what does fill part of that wait is
// a prefetch of the next group's first lines only, kAfNextGroupLines for
// each column vector read back: with 16 lanes the next group's first two
// rows of an fp32 gradient (a group of 4096 columns holds 16; AVX2's 8
// lanes make it four), so the row pass starts on lines already on their way and
// memory is not idle all through the read-back. One and two cores of an Intel
// Xeon with AVX-512 BF16 and 2 MiB of L2 a core (a shared VM), 128M parameters
// as 32768 x 4096 from memory, best of 5, alternating runs; the statistics pass
// against its bound, and the step:
//   avx512bf16, 1 thread: 0.741-0.750 against 0.711-0.713; 1.228-1.230
//     G params/s against 1.197-1.214;
//   avx2, 1 thread: 0.679-0.693 against 0.652-0.656; 1.227-1.235 against
//     1.170-1.173;
//   avx512bf16, 2 threads: 0.725-0.731 against 0.691-0.705; 2.351-2.373
//     against 2.314-2.334 (avx2 2.295-2.312 against 2.271-2.273).
// On one thread one line a vector gained nothing, three no more than two,
// four lost (0.703), and eight lost more (0.626); the same two lines with
// prefetcht1 ran as prefetcht0, and with the non-temporal hint lost (0.60).
// Not measured on an AMD core, where the whole group's prefetch lost.
//
// Note [Groups of 32 rows]: the row that starts a group (kFlushPut) adds
// the last group's float sums into the band's double partials, two
// read-modify-writes of doubles for each column vector besides the row's
// own work, so with 2-byte gradients it cost about four rows that do not:
// one Intel Xeon core (AVX-512 BF16, 2 MiB of L2; a shared VM), the bf16
// statistics kernel alone over 32768 x 4096, that row made a plain one
// (its sums wrong, for the timing only): 21.9-22.7 ms against 25.9-27.2.
// Groups of 32 rows halve those rows, and the lagged pass takes 32 at any
// width (it was as many as fit kAfGroupBytes: 8 at 16384 columns; then
// only 2-byte gradients lagged). The
// same kernel over 128M parameters, best of 5, the two forms in one
// process, three alternating runs, ms:
//   bf16, 4096 columns: 23.7-24.0 against 25.8-26.1 (0.67-0.70 of a plain
//     read of the gradient in the same process, against 0.62-0.64);
//   bf16, 1024 columns: 23.1-23.5 against 23.7-24.3;
//   bf16, 8192 columns: 29.1-29.4 against 29.7-30.1;
//   bf16, 16384 columns (32 rows against 8): 30.9-31.1 against 32.6-33.0.
// fp32 gradients over 2048 columns or fewer take groups of 32 too (their
// rows, read back from L2, still fit kAfGroupBytes): 1024 columns
// 41.7-43.4 against 42.6-43.5, but 2048 columns 43.4-44.2 against
// 42.4-43.1, 2-3% slower, kept so that the tests can hold both forms to
// the same bits (below); at 4096 columns they keep 16. (fp32 rows of up to
// 1024 columns now take the lagged pass: AdafactorLagsRows.) The float
// sums of 32 terms lose at most about 32 units in the last place of a
// float, still far below what the moving averages need. The lagged and
// the grouped pass give the same bits wherever they take the same groups:
// the tests check both between 1025 and 2048 columns, where fp32 takes the
// grouped pass and both take 32 rows.
constexpr size_t kAfGroupBytes = size_t{256} << 10;
constexpr size_t kAfGroupRows = 32;
constexpr size_t kAfNextGroupLines = 2;

// How far ahead the fused statistics pass prefetches its gradient, in
// bytes (2048 elements of a bf16 gradient, 1024 of fp32): with bf16
// gradients, as far ahead in elements as the update loops (kPrefetchElems)
// was half as far in bytes. The kernel alone, 16384 x 4096, four
// alternating runs on one Zen 5 core: bf16 without the weights 8.2-8.4 ms
// against 9.8-11.9, fp32 with the weights 19.5-20.4 against 20.4-22.3,
// the other shapes within 4% either way.
constexpr size_t kAfFusedPrefetchBytes = 4096;

// The rows of a group: the lagged pass keeps none of them in cache beyond
// the row before, so it takes kAfGroupRows whatever the width (Note
// [Groups of 32 rows]); the grouped pass as many as fit kAfGroupBytes.
template <class G>
size_t AfGroupRows(size_t cols) {
  if (AdafactorLagsRows(sizeof(G), cols)) return kAfGroupRows;
  return std::clamp<size_t>(kAfGroupBytes / (cols * sizeof(G)), 1,
                            kAfGroupRows);
}

// The fused statistics pass's prefetch at element i of its gradient (and
// of the weights when kParam): the gradient's lines are read again from
// cache, so no non-temporal hint.
template <class V, bool kParam, class G>
STRATA_CPU_ADAM_INLINE void AfFusedPrefetch(const G* grad, const float* master,
                                            size_t i) {
  PrefetchAt<V, V::kN, kAfFusedPrefetchBytes / sizeof(G), 3>(grad, i);
  if constexpr (kParam) PrefetchOnce<V, V::kN>(master, i);
}

// group_part of column j: the float sum of g^2 at AfGroupAcc(j), of g^2 w
// 16 floats after it (blocks of 16 columns, one block of each in turn).
inline size_t AfGroupAcc(size_t j) { return 2 * j - j % kSumLanes; }

// What a row of the fused statistics pass adds into the group accumulators
// besides its sums: its own g^2 (kPut: a group's first row; kFlushPut:
// the same, after the previous group's sums go into col_part; kAdd), and
// the previous row's g^2 w (kNone: the tile's first row; kPut, kAdd), then
// into rms_part when that row ends its group (kQFlush).
enum class AfCol { kNone, kPut, kFlushPut, kAdd };

struct AfFusedRowArgs {
  size_t row;        // the row's first element
  size_t cols;       // elements a row
  float w_prev;      // 1 / R of the row before
  float e_rows;      // rows of the group kFlushPut ends
  bool first_group;  // that group (and a flushed g^2 w's) is the tile's first
};

// The row before's g^2 w at j: the first term of its group's sum (put), or
// added to the sum at qa.
template <class U, bool kUnit, class G>
STRATA_CPU_ADAM_INLINE typename U::F AfLagTerm(const FConsts<U>& c,
                                               const G* grad, const float* qa,
                                               bool put,
                                               const AfFusedRowArgs& r,
                                               size_t j) {
  using F = typename U::F;
  const F h = ScaledGrad<U, kUnit>(c, grad, r.row - r.cols + j);
  const F h2 = U::Mul(h, h);
  const F w = U::Set(r.w_prev);
  return put ? U::Mul(h2, w) : U::Fma(h2, w, U::Load(qa));
}

template <class U, bool kUnit, AfCol kE, AfCol kQ, bool kQFlush, class G>
STRATA_CPU_ADAM_INLINE typename U::F AfFusedAt(const FConsts<U>& c,
                                               const G* grad, float* acc,
                                               double* colp, double* rmsp,
                                               const AfFusedRowArgs& r,
                                               size_t j) {
  using F = typename U::F;
  float* ea = acc + AfGroupAcc(j);
  float* qa = ea + kSumLanes;
  const F g = ScaledGrad<U, kUnit>(c, grad, r.row + j);
  const F g2 = U::Mul(g, g);
  if constexpr (kE == AfCol::kFlushPut) {
    const F s = U::Fma(c.eps, U::Set(r.e_rows), U::Load(ea));
    DPutOrAccum<U>(colp + j, s, r.first_group);
  }
  U::Store(ea, kE == AfCol::kAdd ? U::Add(U::Load(ea), g2) : g2);
  if constexpr (kQ != AfCol::kNone) {
    const F q = AfLagTerm<U, kUnit>(c, grad, qa, kQ == AfCol::kPut, r, j);
    if constexpr (kQFlush) {
      DPutOrAccum<U>(rmsp + j, q, r.first_group);
    } else {
      U::Store(qa, q);
    }
  }
  return U::Add(g2, c.eps);
}

// The sums of one row [c0, c1) in the order of Note [Reduction order]: of
// s = op.At<U>(j, &x, &u) (U is V, after op.Prefetch(j), or Scalar), of
// x^2 (kParam) and of u^2 (kVec). The op is a struct, not a lambda: GCC 12
// dropped the calls of a lambda made of prefetches alone, in a template,
// as calls without effects.
struct AfRowSums {
  double s = 0.0, x_sq = 0.0, u_sq = 0.0;
};

template <class V, bool kParam, bool kVec, class Op>
STRATA_CPU_ADAM_INLINE AfRowSums AfRowPass(size_t c0, size_t c1, Op& op) {
  double rl[kSumLanes] = {}, pl[kSumLanes] = {}, ul[kSumLanes] = {};
  float rf[kSumLanes] = {}, pf[kSumLanes] = {}, uf[kSumLanes] = {};
  size_t j = c0;
  if constexpr (V::kN == kSumLanes) {
    using F = typename V::F;
    typename V::DL racc = V::DLZero(), pacc = V::DLZero(), uacc = V::DLZero();
    const F zero = V::Set(0.0f);
    F rb = zero, pb = zero, ub = zero;
    size_t in_block = 0;
    for (; j + V::kN <= c1; j += V::kN) {
      op.Prefetch(j);
      F x, u;
      const F s = op.template At<V>(j, &x, &u);
      rb = V::Add(rb, s);
      if constexpr (kParam) pb = V::Fma(x, x, pb);
      if constexpr (kVec) ub = V::Fma(u, u, ub);
      if (++in_block == kSumBlock) {
        in_block = 0;
        racc = V::DLAdd(racc, rb);
        rb = zero;
        if constexpr (kParam) {
          pacc = V::DLAdd(pacc, pb);
          pb = zero;
        }
        if constexpr (kVec) {
          uacc = V::DLAdd(uacc, ub);
          ub = zero;
        }
      }
    }
    V::DLStore(rl, racc);
    V::DLStore(pl, pacc);
    V::DLStore(ul, uacc);
    V::Store(rf, rb);
    V::Store(pf, pb);
    V::Store(uf, ub);
  }
  for (; j < c1; ++j) {
    float x = 0.0f, u = 0.0f;
    const float s = op.template At<Scalar>(j, &x, &u);
    const size_t k = j - c0, lane = k % kSumLanes;
    rf[lane] += s;
    if constexpr (kParam) pf[lane] = std::fma(x, x, pf[lane]);
    if constexpr (kVec) uf[lane] = std::fma(u, u, uf[lane]);
    if ((k + 1) % (kSumLanes * kSumBlock) == 0) {
      FlushBlock(rl, rf);
      FlushBlock(pl, pf);
      FlushBlock(ul, uf);
    }
  }
  FlushBlock(rl, rf);
  FlushBlock(pl, pf);
  FlushBlock(ul, uf);
  AfRowSums out;
  out.s = LaneTree(rl);
  if constexpr (kParam) out.x_sq = LaneTree(pl);
  if constexpr (kVec) out.u_sq = LaneTree(ul);
  return out;
}

// One row of the fused statistics pass: its sums, and its and the row
// before's terms into the group accumulators (AfCol).
template <class V, class G, bool kParam, bool kUnit, AfCol kE, AfCol kQ,
          bool kQFlush>
struct AfFusedOp {
  const FConsts<V>& cv;
  const FConsts<Scalar>& cs;
  const G* grad;
  const float* master;
  float* acc;
  double* colp;
  double* rmsp;
  AfFusedRowArgs r;

  STRATA_CPU_ADAM_INLINE void Prefetch(size_t j) const {
    AfFusedPrefetch<V, kParam>(grad, master, r.row + j);
  }
  template <class U>
  STRATA_CPU_ADAM_INLINE typename U::F At(size_t j, typename U::F* x,
                                          typename U::F*) const {
    if constexpr (kParam) *x = U::Load(master + r.row + j);
    return AfFusedAt<U, kUnit, kE, kQ, kQFlush>(*PickConsts<U>(cv, cs), grad,
                                                acc, colp, rmsp, r, j);
  }
};

template <class V, class G, bool kParam, bool kUnit, AfCol kE, AfCol kQ,
          bool kQFlush>
AfRowSums AfFusedRow(const FConsts<V>& cv, const FConsts<Scalar>& cs,
                     const G* grad, const float* master, float* acc,
                     double* colp, double* rmsp, const AfFusedRowArgs& r) {
  AfFusedOp<V, G, kParam, kUnit, kE, kQ, kQFlush> op{cv,  cs,   grad, master,
                                                     acc, colp, rmsp, r};
  return AfRowPass<V, kParam, false>(0, r.cols, op);
}

// The tile's last row's g^2 w into its group's sums, and the group's sums
// into col_part and rms_part (r.row is the row after it).
template <class U, bool kUnit, class G>
STRATA_CPU_ADAM_INLINE void AfFusedTailAt(const FConsts<U>& c, const G* grad,
                                          const float* acc, double* colp,
                                          double* rmsp, bool q_put,
                                          const AfFusedRowArgs& r, size_t j) {
  using F = typename U::F;
  const float* ea = acc + AfGroupAcc(j);
  const F q = AfLagTerm<U, kUnit>(c, grad, ea + kSumLanes, q_put, r, j);
  const F s = U::Fma(c.eps, U::Set(r.e_rows), U::Load(ea));
  DPutOrAccum<U>(colp + j, s, r.first_group);
  DPutOrAccum<U>(rmsp + j, q, r.first_group);
}

template <class V, class G, bool kParam, bool kUnit>
AfTileSums AfStatsLaggedT(const FactoredParams& params,
                          const FactoredArrays& arrays, const TileRect& t) {
  // See Note [Local copies of the arrays].
  const FactoredParams p = params;
  const FactoredArrays a = arrays;
  const FConsts<V> cv(p);
  const FConsts<Scalar> cs(p);
  const G* grad = static_cast<const G*>(a.grad);
  const size_t cols = a.cols;
  double* colp = a.col_part + t.band * cols;
  double* rmsp = a.rms_part + t.band * cols;
  float* acc = a.group_part + t.band * AfGroupStride(cols);
  // Groups of at least 2 rows: a row that ends its group is never its
  // first (the row kinds below).
  static_assert(kAfGroupRows >= 2);
  const size_t group = AfGroupRows<G>(cols);
  AfTileSums sums;
  AfFusedRowArgs r{};
  r.cols = cols;
  r.e_rows = static_cast<float>(group);  // a whole group, until the tail
  for (size_t i = t.r0; i < t.r1; ++i) {
    r.row = i * cols;
    const size_t k = (i - t.r0) % group;
    r.first_group = i - t.r0 == group;
    AfRowSums rs;
#define STRATA_AF_ROW(kE, kQ, kQFlush)                            \
  AfFusedRow<V, G, kParam, kUnit, AfCol::kE, AfCol::kQ, kQFlush>( \
      cv, cs, grad, a.master, acc, colp, rmsp, r)
    if (i == t.r0) {
      rs = STRATA_AF_ROW(kPut, kNone, false);
    } else if (k == 0) {
      rs = STRATA_AF_ROW(kFlushPut, kAdd, true);
    } else if (k == 1) {
      rs = STRATA_AF_ROW(kAdd, kPut, false);
    } else {
      rs = STRATA_AF_ROW(kAdd, kAdd, false);
    }
#undef STRATA_AF_ROW
    a.row_part[i * a.strips + t.strip] = rs.s;
    if constexpr (kParam) sums.p_sq += rs.x_sq;
    r.w_prev =
        1.0f / AdafactorStat(a.row_state[i], p.beta2, p.omb2, rs.s, cols);
  }
  // The tile's last row and its group.
  const size_t last = (t.r1 - 1 - t.r0) % group;
  r.row = t.r1 * cols;
  r.e_rows = static_cast<float>(last + 1);
  r.first_group = t.r1 - 1 - last == t.r0;
  size_t j = 0;
  if constexpr (V::kN > 1) {
    for (; j + V::kN <= cols; j += V::kN) {
      AfFusedTailAt<V, kUnit>(cv, grad, acc, colp, rmsp, last == 0, r, j);
    }
  }
  for (; j < cols; ++j) {
    AfFusedTailAt<Scalar, kUnit>(cs, grad, acc, colp, rmsp, last == 0, r, j);
  }
  return sums;
}

// The fused statistics pass over fp32 rows too wide to lag
// (AdafactorLagsRows): the rows of a group, each read once from memory for its
// sums, read again from L2 together after the group's last row, a column vector
// of each at a time, into the band's double partials (Note [Adafactor's fused
// RMS]).
template <class V, bool kUnit, class G>
STRATA_CPU_ADAM_INLINE void AfGroupAt(const FConsts<V>& c, const G* grad,
                                      size_t row0, size_t rows, size_t cols,
                                      const typename V::F* w, double* colp,
                                      double* rmsp, bool first, size_t j) {
  using F = typename V::F;
  const F g0 = ScaledGrad<V, kUnit>(c, grad, row0 + j);
  F e = V::Mul(g0, g0);
  F q = V::Mul(e, w[0]);
  for (size_t r = 1; r < rows; ++r) {
    const F g = ScaledGrad<V, kUnit>(c, grad, row0 + r * cols + j);
    const F g2 = V::Mul(g, g);
    e = V::Add(e, g2);
    q = V::Fma(g2, w[r], q);
  }
  const F s = V::Fma(c.eps, V::Set(static_cast<float>(rows)), e);
  DPutOrAccum<V>(colp + j, s, first);
  DPutOrAccum<V>(rmsp + j, q, first);
}

// Reads a group's rows back (AfGroupAt), prefetching the first lines of
// what follows it up to `end`, the tile's end (Note [The next group's first
// rows]).
template <class V, bool kUnit, class G>
void AfGroupColumns(const FConsts<V>& cv, const FConsts<Scalar>& cs,
                    const G* grad, size_t row0, size_t rows, size_t cols,
                    size_t end, const float* w, double* colp, double* rmsp,
                    bool first) {
  size_t j = 0;
  if constexpr (V::kN > 1) {
    typename V::F vw[kAfGroupRows];
    for (size_t r = 0; r < rows; ++r) vw[r] = V::Set(w[r]);
    const uintptr_t next =
        reinterpret_cast<uintptr_t>(grad) + (row0 + rows * cols) * sizeof(G);
    const uintptr_t next_end =
        reinterpret_cast<uintptr_t>(grad) + end * sizeof(G);
    for (uintptr_t at = next; j + V::kN <= cols; j += V::kN) {
      for (size_t k = 0; k < kAfNextGroupLines && at < next_end; ++k) {
        __builtin_prefetch(reinterpret_cast<const void*>(at), 0, 3);
        at += 64;
      }
      if (!first) {
        PrefetchColumns<V>(colp, j);
        PrefetchColumns<V>(rmsp, j);
      }
      AfGroupAt<V, kUnit>(cv, grad, row0, rows, cols, vw, colp, rmsp, first, j);
    }
  }
  for (; j < cols; ++j) {
    AfGroupAt<Scalar, kUnit>(cs, grad, row0, rows, cols, w, colp, rmsp, first,
                             j);
  }
}

template <class V, class G, bool kParam, bool kUnit>
struct AfGroupRowOp {
  const FConsts<V>& cv;
  const FConsts<Scalar>& cs;
  const G* grad;
  const float* master;
  size_t row;

  STRATA_CPU_ADAM_INLINE void Prefetch(size_t j) const {
    AfFusedPrefetch<V, kParam>(grad, master, row + j);
  }
  template <class U>
  STRATA_CPU_ADAM_INLINE typename U::F At(size_t j, typename U::F* x,
                                          typename U::F*) const {
    const FConsts<U>& c = *PickConsts<U>(cv, cs);
    const typename U::F g = ScaledGrad<U, kUnit>(c, grad, row + j);
    if constexpr (kParam) *x = U::Load(master + (row + j));
    return U::Add(U::Mul(g, g), c.eps);
  }
};

template <class V, class G, bool kParam, bool kUnit>
AfTileSums AfStatsGroupedT(const FactoredParams& params,
                           const FactoredArrays& arrays, const TileRect& t) {
  // See Note [Local copies of the arrays].
  const FactoredParams p = params;
  const FactoredArrays a = arrays;
  const FConsts<V> cv(p);
  const FConsts<Scalar> cs(p);
  const G* grad = static_cast<const G*>(a.grad);
  double* colp = a.col_part + t.band * a.cols;
  double* rmsp = a.rms_part + t.band * a.cols;
  float w[kAfGroupRows];  // 1 / R_i of the group's rows
  const size_t group = AfGroupRows<G>(a.cols);
  AfTileSums sums;
  for (size_t i = t.r0; i < t.r1; ++i) {
    const size_t row = i * a.cols;
    AfGroupRowOp<V, G, kParam, kUnit> op{cv, cs, grad, a.master, row};
    const AfRowSums rs = AfRowPass<V, kParam, false>(0, a.cols, op);
    a.row_part[i * a.strips + t.strip] = rs.s;
    if constexpr (kParam) sums.p_sq += rs.x_sq;
    const size_t in_group = (i - t.r0) % group;
    w[in_group] =
        1.0f / AdafactorStat(a.row_state[i], p.beta2, p.omb2, rs.s, a.cols);
    if (in_group + 1 == group || i + 1 == t.r1) {
      const size_t row0 = i - in_group;
      AfGroupColumns<V, kUnit>(cv, cs, grad, row0 * a.cols, in_group + 1,
                               a.cols, t.r1 * a.cols, w, colp, rmsp,
                               row0 == t.r0);
    }
  }
  return sums;
}

// Adafactor's statistics pass over a tile when not fused (a vector, or
// rows cut into strips).
template <class V, class G, bool kVec, bool kParam, bool kUnit>
struct AfStatsOp {
  const FConsts<V>& cv;
  const FConsts<Scalar>& cs;
  const FactoredArrays& a;
  const G* grad;
  double* colp;
  bool first;
  size_t row;

  STRATA_CPU_ADAM_INLINE void Prefetch(size_t j) const {
    PrefetchOnce<V, V::kN>(grad, row + j);
    if constexpr (kParam) PrefetchOnce<V, V::kN>(a.master, row + j);
    if constexpr (kVec) {
      PrefetchAhead<V, V::kN>(a.col_state, j);
    } else {
      PrefetchColumns<V>(colp, j);
    }
  }
  template <class U>
  STRATA_CPU_ADAM_INLINE typename U::F At(size_t j, typename U::F* x,
                                          typename U::F* u) const {
    return AfStatsAt<U, G, kVec, kParam, kUnit>(*PickConsts<U>(cv, cs), a, grad,
                                                colp, first, row, j, x, u);
  }
};

template <class V, class G, bool kVec, bool kParam, bool kUnit>
AfTileSums AfStatsT(const FactoredParams& params, const FactoredArrays& arrays,
                    const TileRect& t) {
  // See Note [Local copies of the arrays].
  const FactoredParams p = params;
  const FactoredArrays a = arrays;
  const FConsts<V> cv(p);
  const FConsts<Scalar> cs(p);
  const G* grad = static_cast<const G*>(a.grad);
  double* colp = kVec ? nullptr : a.col_part + t.band * a.cols;
  AfTileSums sums;
  for (size_t i = t.r0; i < t.r1; ++i) {
    const size_t row = RowStart(a, i);
    const bool first = i == t.r0;
    AfStatsOp<V, G, kVec, kParam, kUnit> op{cv, cs, a, grad, colp, first, row};
    const AfRowSums rs = AfRowPass<V, kParam, kVec>(t.c0, t.c1, op);
    a.row_part[i * a.strips + t.strip] = rs.s;
    if constexpr (kParam) sums.p_sq += rs.x_sq;
    if constexpr (kVec) sums.u_sq += rs.u_sq;
  }
  return sums;
}

template <class V, class G, bool kUnit>
AfTileSums AfStatsU(const FactoredParams& p, const FactoredArrays& a,
                    const TileRect& t) {
  if (a.rows == 1) {
    return p.scale_p ? AfStatsT<V, G, true, true, kUnit>(p, a, t)
                     : AfStatsT<V, G, true, false, kUnit>(p, a, t);
  }
  if (p.fuse_rms) {
    if (AdafactorLagsRows(sizeof(G), a.cols)) {
      return p.scale_p ? AfStatsLaggedT<V, G, true, kUnit>(p, a, t)
                       : AfStatsLaggedT<V, G, false, kUnit>(p, a, t);
    }
    return p.scale_p ? AfStatsGroupedT<V, G, true, kUnit>(p, a, t)
                     : AfStatsGroupedT<V, G, false, kUnit>(p, a, t);
  }
  return p.scale_p ? AfStatsT<V, G, false, true, kUnit>(p, a, t)
                   : AfStatsT<V, G, false, false, kUnit>(p, a, t);
}

template <class V, class G>
AfTileSums AfStatsG(const FactoredParams& p, const FactoredArrays& a,
                    const TileRect& t) {
  return p.gscale == 1.0f ? AfStatsU<V, G, true>(p, a, t)
                          : AfStatsU<V, G, false>(p, a, t);
}

// u = (row_factor * col_factor) * g at j of row i.
template <class V, class G>
STRATA_CPU_ADAM_INLINE typename V::F AfUpdateAt(const FConsts<V>& c,
                                                const FactoredArrays& a,
                                                const G* grad, typename V::F rf,
                                                size_t row, size_t j) {
  const typename V::F f = V::Mul(rf, V::Load(a.col_factor + j));
  return V::Mul(f, V::Mul(V::Load(grad + (row + j)), c.gscale));
}

template <class V, class G>
double AfSumsqT(const FactoredParams& params, const FactoredArrays& arrays,
                const TileRect& t) {
  // See Note [Local copies of the arrays].
  const FactoredParams p = params;
  const FactoredArrays a = arrays;
  const FConsts<V> cv(p);
  const FConsts<Scalar> cs(p);
  const G* grad = static_cast<const G*>(a.grad);
  double sum = 0.0;
  for (size_t i = t.r0; i < t.r1; ++i) {
    const size_t row = RowStart(a, i);
    const float rf = a.row_factor[i];
    double l[kSumLanes] = {};
    size_t j = t.c0;
    if constexpr (V::kN == kSumLanes) {
      const typename V::F vrf = V::Set(rf);
      typename V::DL acc = V::DLZero();
      for (; j + V::kN <= t.c1; j += V::kN) {
        PrefetchOnce<V, V::kN>(grad, row + j);
        if (a.rows == 1) {
          PrefetchAhead<V, V::kN>(a.col_factor, j);
        }
        acc = V::DLSq(acc, AfUpdateAt<V>(cv, a, grad, vrf, row, j));
      }
      V::DLStore(l, acc);
    }
    for (; j < t.c1; ++j) {
      const double u = AfUpdateAt<Scalar>(cs, a, grad, rf, row, j);
      double& lane = l[(j - t.c0) % kSumLanes];
      lane = std::fma(u, u, lane);
    }
    sum += LaneTree(l);
  }
  return sum;
}

// Note [The new weights' squares]: with sum_new_sq Adafactor's update pass
// also sums the squares of the weights it writes, for the next step's
// scale_parameter (CpuStepArgs::param_sq), in the order of Note [Reduction
// order] in double: element c0 + k of a row segment into lane k % 16, the
// lanes as LaneTree, the rows in order. A float's square is exact in
// double, so a vector's fused multiply-add and the scalar reference add the
// same values; and ForSegment's scalar head (as long as the working copy's
// alignment asks, which depends on its address) puts its elements in their
// lanes, the vectors after it continuing those lanes rotated by the head's
// length. So the sum is the same bits on every variant, thread count and
// address, as the statistics pass's sums are.
template <class V, bool = V::kN == kSumLanes>
struct SqLanes {  // Scalar: no vector lanes
  struct T {};
  static void Load(T&, const double*, size_t) {}
  static void Store(const T&, double*, size_t) {}
  static T Sq(T acc, typename V::F) { return acc; }
};
template <class V>
struct SqLanes<V, true> {
  using T = typename V::DL;
  // acc lane k <- lanes[(h + k) % 16], and back.
  static void Load(T& acc, const double* lanes, size_t h) {
    double l[kSumLanes];
    for (size_t k = 0; k < kSumLanes; ++k) l[k] = lanes[(h + k) % kSumLanes];
    acc = V::DLLoad(l);
  }
  static void Store(const T& acc, double* lanes, size_t h) {
    double l[kSumLanes];
    V::DLStore(l, acc);
    for (size_t k = 0; k < kSumLanes; ++k) lanes[(h + k) % kSumLanes] = l[k];
  }
  static T Sq(T acc, typename V::F x) { return V::DLSq(acc, x); }
};

// Adafactor pass 3 over one row segment (Op of ForSegment), and with
// sum_new_sq the new weights' squares into the row's lanes (Note [The new
// weights' squares]): the scalar head and tail directly, V's vectors in
// vsq, which holds lanes[(h + k) % 16] while in_vec.
template <class V, class G, class M, class W>
struct AfApplyOp {
  const FConsts<V>& cv;
  const FConsts<Scalar>& cs;
  const FactoredParams& p;
  const FactoredArrays& a;
  size_t row;
  size_t c0;
  float rf;
  // The row's lanes: outside the op, whose members (vsq) then stay in
  // registers; an array member indexed by j kept the op on the stack.
  double* lanes;
  typename SqLanes<V>::T vsq;
  size_t h;
  bool in_vec;

  STRATA_CPU_ADAM_INLINE void Prefetch(size_t j) {
    PrefetchFactored<V, G, M>(p, a, row + j);
    // A vector's factor is per element (Note [Software prefetch]).
    if (a.rows == 1) PrefetchAhead<V, V::kN>(a.col_factor, j);
  }

  // The row's lanes, the vectors' included (at the end of the row).
  void FlushVectors() {
    if (in_vec) SqLanes<V>::Store(vsq, lanes, h);
    in_vec = false;
  }

  template <class U, bool kStream>
  STRATA_CPU_ADAM_INLINE void At(size_t j) {
    const FConsts<U>* c = PickConsts<U>(cv, cs);
    using F = typename U::F;
    const G* grad = static_cast<const G*>(a.grad);
    const size_t i = row + j;
    F u = U::Mul(AfUpdateAt<U>(*c, a, grad, U::Set(rf), row, j), c->coef);
    if (p.use_m) {
      M* m = static_cast<M*>(a.m);
      u = U::Fma(u, c->omb1, U::Mul(U::Load(m + i), c->beta1));
      U::Store(m + i, u);
    }
    F x = U::Load(a.master + i);
    if (p.use_decay) x = U::Fma(x, c->decay, x);
    x = U::Fma(u, c->minus_one, x);
    StoreMaster<U, W, kStream>(a.master, static_cast<W*>(a.working), i, x);
    if (p.sum_new_sq) {
      if constexpr (std::is_same_v<U, Scalar>) {
        FlushVectors();
        double& l = lanes[(j - c0) % kSumLanes];
        l = Scalar::SqAcc(l, x);
      } else {
        if (!in_vec) {
          h = (j - c0) % kSumLanes;
          SqLanes<V>::Load(vsq, lanes, h);
          in_vec = true;
        }
        vsq = SqLanes<V>::Sq(vsq, x);
      }
    }
  }
};

template <class V, class G, class M, class W>
double AfApplyT(const FactoredParams& params, const FactoredArrays& arrays,
                const TileRect& t) {
  // See Note [Local copies of the arrays].
  const FactoredParams p = params;
  const FactoredArrays a = arrays;
  const FConsts<V> cv(p);
  const FConsts<Scalar> cs(p);
  double lanes[kSumLanes];
  AfApplyOp<V, G, M, W> op{cv, cs, p, a, 0, t.c0, 0.0f, lanes, {}, 0, false};
  double sum = 0.0;
  for (size_t i = t.r0; i < t.r1; ++i) {
    op.row = RowStart(a, i);
    op.rf = a.row_factor[i];
    if (p.sum_new_sq) std::fill(std::begin(lanes), std::end(lanes), 0.0);
    // Note [Whole lines of the working copy]: not for this pass.
    ForSegment<V, false>(static_cast<W*>(a.working), op.row, t.c0, t.c1, op);
    if (p.sum_new_sq) {
      op.FlushVectors();
      sum += LaneTree(lanes);
    }
  }
  if constexpr (!std::is_same_v<W, NoWork>) V::Fence();
  return sum;
}

// SM3 over one row segment (Op of ForSegment): nu = min(row, col) + g^2
// (a vector: its own accumulator + g^2), the row's running max, the
// columns' maxima (a vector: the new accumulators), the weight update.
template <class V, class G, class M, class W, bool kVec>
struct Sm3Op {
  const FConsts<V>& cv;
  const FConsts<Scalar>& cs;
  const FactoredParams& p;
  const FactoredArrays& a;
  float* colf;  // this band's column maxima
  size_t row;
  bool first;
  float row_acc;
  typename V::I vmax;
  uint32_t smax;

  STRATA_CPU_ADAM_INLINE void Prefetch(size_t j) {
    PrefetchFactored<V, G, M>(p, a, row + j);
    // A vector's accumulators are per element (Note [Software prefetch]).
    if constexpr (kVec) PrefetchAhead<V, V::kN>(a.col_state, j);
  }

  template <class U, bool kStream, bool kWork = true>
  STRATA_CPU_ADAM_INLINE typename U::F At(size_t j) {
    const FConsts<U>* c = PickConsts<U>(cv, cs);
    using F = typename U::F;
    const G* grad = static_cast<const G*>(a.grad);
    const size_t i = row + j;
    F g = U::Mul(U::Load(grad + i), c->gscale);
    F x = U::Load(a.master + i);
    if (p.use_l2) g = U::Fma(x, c->l2, g);
    F acc = U::Load(a.col_state + j);
    if constexpr (!kVec) {  // accumulators are >= 0: min/max of the bits
      acc = U::FBits(U::IMin(U::IBits(U::Set(row_acc)), U::IBits(acc)));
    }
    const F nu = U::Add(acc, U::Mul(g, g));
    const typename U::I bits = U::IBits(nu);
    if constexpr (std::is_same_v<U, Scalar>) {
      smax = U::IMax(smax, bits);
    } else {
      vmax = U::IMax(vmax, bits);
    }
    if constexpr (kVec) {
      U::Store(a.col_state + j, nu);
    } else if (first) {
      U::Store(colf + j, nu);
    } else {
      U::Store(colf + j, U::FBits(U::IMax(U::IBits(U::Load(colf + j)), bits)));
    }
    const F denom = U::Add(U::Sqrt(nu), c->eps);
    if (p.use_m) {
      M* m = static_cast<M*>(a.m);
      const F mm =
          U::Fma(U::Div(g, denom), c->omb1, U::Mul(U::Load(m + i), c->beta1));
      U::Store(m + i, mm);
      x = U::Add(x, U::Mul(c->neg_lr, mm));
    } else {  // Adagrad's order: a vector's SM3 is Adagrad
      x = U::Add(x, U::Div(U::Mul(c->neg_lr, g), denom));
    }
    StoreMaster<U, W, kStream, kWork>(a.master, static_cast<W*>(a.working), i,
                                      x);
    return x;
  }
};

template <class V, class G, class M, class W, bool kVec>
void Sm3T(const FactoredParams& params, const FactoredArrays& arrays,
          const TileRect& t) {
  // See Note [Local copies of the arrays].
  const FactoredParams p = params;
  const FactoredArrays a = arrays;
  const FConsts<V> cv(p);
  const FConsts<Scalar> cs(p);
  float* colf = kVec ? nullptr : a.col_fpart + t.band * a.cols;
  for (size_t i = t.r0; i < t.r1; ++i) {
    const size_t row = RowStart(a, i);
    Sm3Op<V, G, M, W, kVec> op{
        cv, cs, p, a, colf, row, i == t.r0, a.row_state[i], V::ISet(0), 0u};
    ForSegment<V, true>(static_cast<W*>(a.working), row, t.c0, t.c1, op);
    a.row_fpart[i * a.strips + t.strip] =
        BitsFloat(std::max(V::IMaxAll(op.vmax), op.smax));
  }
  if constexpr (!std::is_same_v<W, NoWork>) V::Fence();
}

// Dispatch of the factored kernels over the gradient, moment and working
// copy types.
template <class V, template <class, class, class, class> class K>
struct FactoredDispatch {
  // What the kernels return (every instantiation of K alike).
  using R = decltype(K<V, float, float, NoWork>::Run(
      std::declval<const FactoredParams&>(),
      std::declval<const FactoredArrays&>(), std::declval<const TileRect&>()));
  template <class G, class M>
  static R ByW(const FactoredParams& p, const FactoredArrays& a,
               const TileRect& t) {
    if (!p.has_working) return K<V, G, M, NoWork>::Run(p, a, t);
    if (p.working_dtype == CpuDType::kFloat16) {
      return K<V, G, M, F16>::Run(p, a, t);
    }
    return K<V, G, M, Bf16>::Run(p, a, t);
  }
  template <class G>
  static R ByM(const FactoredParams& p, const FactoredArrays& a,
               const TileRect& t) {
    if (p.moment_dtype == CpuDType::kBFloat16) return ByW<G, Bf16>(p, a, t);
    return ByW<G, float>(p, a, t);
  }
  static R Run(const FactoredParams& p, const FactoredArrays& a,
               const TileRect& t) {
    switch (p.grad_dtype) {
      case CpuDType::kFloat32:
        return ByM<float>(p, a, t);
      case CpuDType::kFloat16:
        return ByM<F16>(p, a, t);
      case CpuDType::kBFloat16:
        return ByM<Bf16>(p, a, t);
      case CpuDType::kBlock8:  // the driver refuses it
        break;
    }
    return R();
  }
};

template <class V, class G, class M, class W>
struct AfApplyK {
  static double Run(const FactoredParams& p, const FactoredArrays& a,
                    const TileRect& t) {
    return AfApplyT<V, G, M, W>(p, a, t);
  }
};

template <class V, class G, class M, class W>
struct Sm3K {
  static void Run(const FactoredParams& p, const FactoredArrays& a,
                  const TileRect& t) {
    if (a.rows == 1) return Sm3T<V, G, M, W, true>(p, a, t);
    Sm3T<V, G, M, W, false>(p, a, t);
  }
};

template <class V>
AfTileSums AdafactorStats(const FactoredParams& p, const FactoredArrays& a,
                          const TileRect& t) {
  switch (p.grad_dtype) {
    case CpuDType::kFloat16:
      return AfStatsG<V, F16>(p, a, t);
    case CpuDType::kBFloat16:
      return AfStatsG<V, Bf16>(p, a, t);
    default:
      return AfStatsG<V, float>(p, a, t);
  }
}

template <class V>
double AdafactorSumsq(const FactoredParams& p, const FactoredArrays& a,
                      const TileRect& t) {
  switch (p.grad_dtype) {
    case CpuDType::kFloat16:
      return AfSumsqT<V, F16>(p, a, t);
    case CpuDType::kBFloat16:
      return AfSumsqT<V, Bf16>(p, a, t);
    default:
      return AfSumsqT<V, float>(p, a, t);
  }
}

// VS: the vector type of the gradient statistics (AVX2 keeps them 8 wide).
template <class V, class VS = V>
KernelTable MakeTable(CpuKernelVariant variant) {
  return KernelTable{variant,
                     SplitsUpdate8<V>() ? 2 : 1,
                     &Step<V>,
                     &GradStats<VS>,
                     &Convert<V>,
                     &AdafactorStats<V>,
                     &AdafactorSumsq<V>,
                     &FactoredDispatch<V, AfApplyK>::Run,
                     &FactoredDispatch<V, Sm3K>::Run};
}

}  // namespace strata::cpu_adam::STRATA_CPU_ADAM_ISA
