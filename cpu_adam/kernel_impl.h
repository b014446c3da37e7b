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
// BadAny.
#ifndef STRATA_CPU_ADAM_ISA
#error "define STRATA_CPU_ADAM_ISA before including cpu_adam/kernel_impl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_adam/kernels.h"
#include "util/half.h"

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
        use_l2(p.use_l2),
        use_decay(p.use_decay) {}
  F gscale, beta1, beta2, omb1, omb2, eps, l2, decay, neg_step, bc2_sqrt;
  bool use_l2, use_decay;
};

// Updates the V::kN elements at i. Operation order mirrors torch 1.13's
// _single_tensor_adam / adamw / adagrad and the reference Lion:
//   Adam:    g += wd * p (fma);  m = m * b1, then fma(g, 1 - b1, m);
//            v = v * b2 + ((1 - b2) * g) * g;  d = sqrt(v) / bc2_sqrt + eps;
//            p = p + (-step_size * m) / d
//   AdamW:   as Adam without the L2 term, and p = p * (1 - lr * wd) first
//   Adagrad: g += wd * p;  v = v + g * g;  p = p + (-lr * g) / (sqrt(v) + eps)
//   Lion:    u = sign(fma(g, 1 - b1, m * b1));  p = p * (1 - lr * wd);
//            p = fma(u, -lr, p);  m = fma(g, 1 - b2, m * b2)
template <class V, CpuOptimizerAlgo A, class G, class M, class W, bool kStream>
inline void UpdateAt(const Consts<V>& c, float* master, const G* grad, M* m,
                     M* v, W* w, size_t i) {
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
    const F denom = V::Add(V::Div(V::Sqrt(vv), c.bc2_sqrt), c.eps);
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
  V::Store(master + i, x);
  if constexpr (!std::is_same_v<W, NoWork>) {
    if constexpr (kStream) {
      V::Stream(w + i, x);
    } else {
      V::Store(w + i, x);
    }
  }
}

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
  size_t i = begin;
  bool stream = false;
  if constexpr (!std::is_same_v<W, NoWork> && V::kN > 1) {
    const size_t head = StreamHead<V>(w + i);
    if (head != SIZE_MAX) {
      for (const size_t stop = std::min(end, i + head); i < stop; ++i) {
        UpdateAt<Scalar, A, G, M, W, false>(cs, master, grad, m, v, w, i);
      }
      stream = true;
    }
  }
  if (stream) {
    for (; i + V::kN <= end; i += V::kN) {
      UpdateAt<V, A, G, M, W, true>(cv, master, grad, m, v, w, i);
    }
    V::Fence();  // NT stores are weakly ordered; see KernelTable::step
  } else {
    for (; i + V::kN <= end; i += V::kN) {
      UpdateAt<V, A, G, M, W, false>(cv, master, grad, m, v, w, i);
    }
  }
  for (; i < end; ++i) {
    UpdateAt<Scalar, A, G, M, W, false>(cs, master, grad, m, v, w, i);
  }
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
  }
}

template <class V>
KernelTable MakeTable(CpuKernelVariant variant) {
  return KernelTable{variant, &Step<V>, &GradStats<V>, &Convert<V>};
}

}  // namespace strata::cpu_adam::STRATA_CPU_ADAM_ISA
