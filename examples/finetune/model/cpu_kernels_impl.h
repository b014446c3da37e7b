// The CPU kernels of kernels.h, written once over a vector type and compiled
// once per ISA: each cpu_kernels_<isa>.cc defines FINETUNE_CPU_ISA (the
// namespace) and, for AVX2, FINETUNE_CPU_AVX2, then includes this file.
//
// Note [One namespace per ISA]: everything here, scalar helpers included,
// lives in an anonymous namespace inside finetune::cpu::FINETUNE_CPU_ISA, so
// no inline function compiled with AVX2 flags can be picked by the linker
// for the scalar build (the ODR trap of per-file ISA flags).
//
// Loops run whole vectors and then a scalar tail through the same lambda
// (ForEach), so every size is handled by one body. Rows are spread over
// oneTBB workers; reductions over rows (dw, db) go through fixed chunks of
// rows and per-chunk partial sums, so the result does not depend on the
// number of threads.
#ifndef FINETUNE_CPU_ISA
#error "define FINETUNE_CPU_ISA before including cpu_kernels_impl.h"
#endif

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "examples/finetune/model/kernels.h"

#ifdef FINETUNE_CPU_AVX2
#include <immintrin.h>
#endif

namespace finetune::cpu::FINETUNE_CPU_ISA {
namespace {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline float ToFloat(float v) { return v; }
inline float ToFloat(Bf16 v) {
  return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16);
}
inline float ToFloat(F16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t e = (v.bits >> 10) & 0x1fu;
  const uint32_t m = v.bits & 0x3ffu;
  if (e == 0) {
    const float f = std::ldexp(static_cast<float>(m), -24);
    return sign ? -f : f;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112) << 23) | (m << 13));
}

template <class S>
inline S FromFloat(float v);
template <>
inline float FromFloat<float>(float v) {
  return v;
}
template <>
inline Bf16 FromFloat<Bf16>(float v) {
  const uint32_t x = std::bit_cast<uint32_t>(v);
  if (std::isnan(v)) return {0x7fc0};
  return {static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
template <>
inline F16 FromFloat<F16>(float v) {
  const uint32_t x = std::bit_cast<uint32_t>(v);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {
    return {
        static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u))};
  }
  if (ax >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};
  if (ax < 0x38800000u) {  // a half subnormal (or zero): units of 2^-24
    const float scaled = std::bit_cast<float>(ax) * 16777216.0f;
    return {static_cast<uint16_t>(
        sign | static_cast<uint32_t>(std::nearbyint(scaled)))};
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);
  return {static_cast<uint16_t>(sign | ((r - (112u << 23)) >> 13))};
}

// One lane; the tail of every loop and the whole of the scalar build.
struct ScalarVec {
  using R = float;
  static constexpr int kWidth = 1;
  template <class S>
  static R Load(const S* p) {
    return ToFloat(*p);
  }
  template <class S>
  static void Store(S* p, R v) {
    *p = FromFloat<S>(v);
  }
  static R Set(float v) { return v; }
  static R Add(R a, R b) { return a + b; }
  static R Sub(R a, R b) { return a - b; }
  static R Mul(R a, R b) { return a * b; }
  static R Fma(R a, R b, R c) { return a * b + c; }
  static R Max(R a, R b) { return std::max(a, b); }
  static R Exp(R a) { return std::exp(a); }
  static R Tanh(R a) { return std::tanh(a); }
  static float Sum(R a) { return a; }
  static float HMax(R a) { return a; }
};

#ifdef FINETUNE_CPU_AVX2
struct Avx2Vec {
  using R = __m256;
  static constexpr int kWidth = 8;
  static R Load(const float* p) { return _mm256_loadu_ps(p); }
  static R Load(const Bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static R Load(const F16* p) {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void Store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void Store(Bf16* p, R v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb =
        _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r =
        _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0),
                           _mm256_castps_si256(nan));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r),
                                            _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void Store(F16* p, R v) {
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(p),
        _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static R Set(float v) { return _mm256_set1_ps(v); }
  static R Add(R a, R b) { return _mm256_add_ps(a, b); }
  static R Sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R Mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R Fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R Max(R a, R b) { return _mm256_max_ps(a, b); }
  // Cephes' expf: range reduction by ln 2 and a degree-5 polynomial;
  // relative error about 2e-7 over the clamped range.
  static R Exp(R x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
    R fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                           _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    R y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  // 1 - 2 / (exp(2a) + 1): saturates to +-1 without overflow.
  static R Tanh(R a) {
    const R e = Exp(_mm256_add_ps(a, a));
    return _mm256_sub_ps(_mm256_set1_ps(1.0f),
                         _mm256_div_ps(_mm256_set1_ps(2.0f),
                                       _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
  }
  static float Sum(R v) {
    return Horizontal(v, [](__m128 x, __m128 y) { return _mm_add_ps(x, y); });
  }
  static float HMax(R v) {
    return Horizontal(v, [](__m128 x, __m128 y) { return _mm_max_ps(x, y); });
  }
  // op over the 8 lanes, by halving.
  template <class Op>
  static float Horizontal(R v, Op op) {
    __m128 lo = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = op(lo, _mm_movehl_ps(lo, lo));
    lo = op(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
  }
};
using V = Avx2Vec;
#else
using V = ScalarVec;
#endif

// f.template operator()<U>(i) over [0, n): whole vectors, then scalar lanes.
template <class F>
inline void ForEach(size_t n, F&& f) {
  size_t i = 0;
  if constexpr (V::kWidth > 1) {
    for (; i + V::kWidth <= n; i += V::kWidth) f.template operator()<V>(i);
  }
  for (; i < n; ++i) f.template operator()<ScalarVec>(i);
}

// sum_i f<U>(i), with a vector accumulator and a scalar tail.
template <class F>
inline float SumOf(size_t n, F&& f) {
  size_t i = 0;
  float tail = 0.0f;
  if constexpr (V::kWidth > 1) {
    V::R acc = V::Set(0.0f);
    for (; i + V::kWidth <= n; i += V::kWidth) {
      acc = V::Add(acc, f.template operator()<V>(i));
    }
    tail = V::Sum(acc);
  }
  for (; i < n; ++i) tail += f.template operator()<ScalarVec>(i);
  return tail;
}

inline float Dot(const float* a, const float* b, size_t n) {
  return SumOf(n, [&]<class U>(size_t i) {
    return U::Mul(U::Load(a + i), U::Load(b + i));
  });
}

// y += alpha * x
inline void Axpy(float* y, float alpha, const float* x, size_t n) {
  ForEach(n, [&]<class U>(size_t i) {
    U::Store(y + i, U::Fma(U::Set(alpha), U::Load(x + i), U::Load(y + i)));
  });
}

template <class F>
void WithType(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      f(float{});
      return;
    case DType::kBF16:
      f(Bf16{});
      return;
    case DType::kF16:
      f(F16{});
      return;
  }
}

// Rows per task so that a task touches at least ~16K elements.
inline size_t Grain(size_t row_elems) {
  return std::max<size_t>(1, 16384 / std::max<size_t>(1, row_elems));
}

template <class F>
void ParallelRows(size_t rows, size_t row_elems, F&& f) {
  tbb::parallel_for(tbb::blocked_range<size_t>(0, rows, Grain(row_elems)),
                    [&](const tbb::blocked_range<size_t>& r) {
                      for (size_t i = r.begin(); i != r.end(); ++i) f(i);
                    });
}

// ForEach over [0, n) in chunks spread over oneTBB workers.
template <class F>
void ParallelForEach(size_t n, F&& f) {
  constexpr size_t kChunk = 16384;
  tbb::parallel_for(size_t{0}, (n + kChunk - 1) / kChunk, [&](size_t c) {
    const size_t i0 = c * kChunk;
    ForEach(std::min(kChunk, n - i0),
            [&]<class U>(size_t j) { f.template operator()<U>(i0 + j); });
  });
}

// out[c] = sum over rows of per_row(row, partial) where per_row adds a row's
// contribution to `partial` (n_out floats). Fixed chunks of rows, so the sum
// order is the same for any thread count.
template <class F>
void ReduceRows(size_t rows, size_t n_out, const std::vector<float*>& outs,
                size_t row_elems, F&& per_row) {
  const size_t chunk = std::max<size_t>(Grain(row_elems), 1);
  const size_t chunks = (rows + chunk - 1) / chunk;
  std::vector<float> partial(chunks * n_out, 0.0f);
  tbb::parallel_for(size_t{0}, chunks, [&](size_t c) {
    float* p = partial.data() + c * n_out;
    const size_t end = std::min(rows, (c + 1) * chunk);
    for (size_t r = c * chunk; r < end; ++r) per_row(r, p);
  });
  // Column sums of the partials, split across outputs of n_out / outs.size().
  const size_t per_out = n_out / outs.size();
  tbb::parallel_for(size_t{0}, n_out, size_t{4096}, [&](size_t j0) {
    const size_t j1 = std::min(n_out, j0 + 4096);
    std::vector<float> acc(partial.begin() + j0, partial.begin() + j1);
    for (size_t c = 1; c < chunks; ++c) {
      const float* p = partial.data() + c * n_out;
      float* a = acc.data();
      ForEach(j1 - j0, [&]<class U>(size_t i) {
        U::Store(a + i, U::Add(U::Load(a + i), U::Load(p + j0 + i)));
      });
    }
    for (size_t j = j0; j < j1; ++j)
      outs[j / per_out][j % per_out] = acc[j - j0];
  });
}

// ---- kernels ----

void EncoderForward(float* out, const int32_t* tokens, const void* wte,
                    const void* wpe, DType wt, int B, int T, int C) {
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    const S* te = static_cast<const S*>(wte);
    const S* pe = static_cast<const S*>(wpe);
    ParallelRows(size_t(B) * T, C, [&](size_t n) {
      const S* a = te + size_t(tokens[n]) * C;
      const S* b = pe + (n % T) * C;
      float* o = out + n * C;
      ForEach(C, [&]<class U>(size_t i) {
        U::Store(o + i, U::Add(U::Load(a + i), U::Load(b + i)));
      });
    });
  });
}

void EncoderBackward(float* dwte, float* dwpe, const float* dout,
                     const int32_t* tokens, int B, int T, int C) {
  // wpe: rows are independent.
  ParallelRows(T, size_t(B) * C, [&](size_t t) {
    float* d = dwpe + t * C;
    std::memcpy(d, dout + t * C, sizeof(float) * C);
    for (int b = 1; b < B; ++b)
      Axpy(d, 1.0f, dout + (size_t(b) * T + t) * C, C);
  });
  // wte: tokens repeat, so split by channels instead of rows.
  constexpr size_t kCols = 64;
  const size_t N = size_t(B) * T;
  tbb::parallel_for(size_t{0}, (size_t(C) + kCols - 1) / kCols, [&](size_t j) {
    const size_t c0 = j * kCols;
    const size_t w = std::min<size_t>(kCols, C - c0);
    for (size_t n = 0; n < N; ++n) {
      Axpy(dwte + size_t(tokens[n]) * C + c0, 1.0f, dout + n * C + c0, w);
    }
  });
}

constexpr float kLnEps = 1e-5f;

void LayerNormForward(void* out, float* mean, float* rstd, const float* inp,
                      const void* w, const void* b, DType wt, int N, int C) {
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    const S* ws = static_cast<const S*>(w);
    const S* bs = static_cast<const S*>(b);
    S* os = static_cast<S*>(out);
    ParallelRows(N, C, [&](size_t n) {
      const float* x = inp + n * C;
      const float m =
          SumOf(C, [&]<class U>(size_t i) { return U::Load(x + i); }) / C;
      const float var = SumOf(C,
                              [&]<class U>(size_t i) {
                                const auto d =
                                    U::Sub(U::Load(x + i), U::Set(m));
                                return U::Mul(d, d);
                              }) /
                        C;
      const float s = 1.0f / std::sqrt(var + kLnEps);
      S* o = os + n * C;
      ForEach(C, [&]<class U>(size_t i) {
        const auto xh = U::Mul(U::Sub(U::Load(x + i), U::Set(m)), U::Set(s));
        U::Store(o + i, U::Fma(xh, U::Load(ws + i), U::Load(bs + i)));
      });
      mean[n] = m;
      rstd[n] = s;
    });
  });
}

void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout,
                       const float* inp, const void* w, DType wt,
                       const float* mean, const float* rstd, int N, int C) {
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    const S* ws = static_cast<const S*>(w);
    // dinp, row by row.
    ParallelRows(N, C, [&](size_t n) {
      const float* x = inp + n * C;
      const float* d = dout + n * C;
      const float m = mean[n], s = rstd[n];
      auto xhat = [&]<class U>(size_t i) {
        return U::Mul(U::Sub(U::Load(x + i), U::Set(m)), U::Set(s));
      };
      const float dnorm_mean =
          SumOf(C,
                [&]<class U>(size_t i) {
                  return U::Mul(U::Load(d + i), U::Load(ws + i));
                }) /
          C;
      const float dnorm_xhat_mean =
          SumOf(C,
                [&]<class U>(size_t i) {
                  return U::Mul(U::Mul(U::Load(d + i), U::Load(ws + i)),
                                xhat.template operator()<U>(i));
                }) /
          C;
      float* di = dinp + n * C;
      ForEach(C, [&]<class U>(size_t i) {
        auto g =
            U::Sub(U::Mul(U::Load(d + i), U::Load(ws + i)), U::Set(dnorm_mean));
        g = U::Sub(
            g, U::Mul(xhat.template operator()<U>(i), U::Set(dnorm_xhat_mean)));
        U::Store(di + i, U::Fma(g, U::Set(s), U::Load(di + i)));
      });
    });
  });
  // dw and db: column sums over rows; partial layout [dw | db].
  ReduceRows(N, 2 * size_t(C), {dw, db}, C, [&](size_t n, float* p) {
    const float* x = inp + n * C;
    const float* d = dout + n * C;
    const float m = mean[n], s = rstd[n];
    ForEach(C, [&]<class U>(size_t i) {
      const auto dv = U::Load(d + i);
      const auto xh = U::Mul(U::Sub(U::Load(x + i), U::Set(m)), U::Set(s));
      U::Store(p + i, U::Fma(dv, xh, U::Load(p + i)));
      U::Store(p + C + i, U::Add(dv, U::Load(p + C + i)));
    });
  });
}

void AddBias(float* out, const float* res, const void* bias, DType wt, int N,
             int OC) {
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    const S* bs = static_cast<const S*>(bias);
    ParallelRows(N, OC, [&](size_t n) {
      float* o = out + n * OC;
      if (res == nullptr) {
        ForEach(OC,
                [&]<class U>(size_t i) { U::Store(o + i, U::Load(bs + i)); });
      } else {
        const float* r = res + n * OC;
        ForEach(OC, [&]<class U>(size_t i) {
          U::Store(o + i, U::Add(U::Load(r + i), U::Load(bs + i)));
        });
      }
    });
  });
}

void BiasGrad(float* db, const float* dout, int N, int OC) {
  ReduceRows(N, OC, {db}, OC, [&](size_t n, float* p) {
    const float* d = dout + n * OC;
    ForEach(OC, [&]<class U>(size_t i) {
      U::Store(p + i, U::Add(U::Load(p + i), U::Load(d + i)));
    });
  });
}

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

void GeluForward(void* out, const float* inp, DType wt, size_t n) {
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    S* o = static_cast<S*>(out);
    ParallelForEach(n, [&]<class U>(size_t i) {
      const auto x = U::Load(inp + i);
      const auto x3 = U::Mul(U::Mul(x, x), x);
      const auto u =
          U::Mul(U::Set(kGeluScale), U::Fma(U::Set(kGeluCubic), x3, x));
      const auto half_x = U::Mul(U::Set(0.5f), x);
      U::Store(o + i, U::Fma(half_x, U::Tanh(u), half_x));
    });
  });
}

void GeluBackward(float* dinout, const float* inp, size_t n) {
  ParallelForEach(n, [&]<class U>(size_t i) {
    const auto x = U::Load(inp + i);
    const auto x2 = U::Mul(x, x);
    const auto u = U::Mul(U::Set(kGeluScale),
                          U::Fma(U::Set(kGeluCubic), U::Mul(x2, x), x));
    const auto th = U::Tanh(u);
    const auto one = U::Set(1.0f);
    const auto sech2 = U::Sub(one, U::Mul(th, th));
    const auto du =
        U::Mul(U::Set(kGeluScale), U::Fma(U::Set(3.0f * kGeluCubic), x2, one));
    // 0.5 (1 + th) + 0.5 x sech2 du
    const auto g =
        U::Mul(U::Set(0.5f), U::Fma(U::Mul(x, sech2), du, U::Add(one, th)));
    U::Store(dinout + i, U::Mul(U::Load(dinout + i), g));
  });
}

inline size_t RoundUp(size_t n, size_t m) { return (n + m - 1) / m * m; }

// Keys (or values) of one head, transposed to [hs][ld] (columns n..ld-1
// zero) so that the scores of a query against every key are FMAs over
// contiguous keys.
inline void TransposeHead(float* dst, const float* base, size_t C3, size_t n,
                          size_t ld, size_t hs) {
  for (size_t s = 0; s < n; ++s) {
    const float* k = base + s * C3;
    for (size_t i = 0; i < hs; ++i) dst[i * ld + s] = k[i];
  }
  for (size_t i = 0; i < hs; ++i)
    std::fill(dst + i * ld + n, dst + (i + 1) * ld, 0.0f);
}

// out[0..nv) = sum_i x[i] * scale * kt[i * ld + 0..nv), accumulated in
// registers two vectors of keys at a time. REQUIRES: nv a multiple of the
// vector width and kt's rows readable to nv.
inline void ScoresRow(float* out, const float* x, float scale, const float* kt,
                      size_t ld, size_t nv, size_t hs) {
  constexpr size_t W = V::kWidth;
  size_t s = 0;
  for (; s + 2 * W <= nv; s += 2 * W) {
    auto a0 = V::Set(0.0f), a1 = V::Set(0.0f);
    for (size_t i = 0; i < hs; ++i) {
      const auto xi = V::Set(x[i] * scale);
      const float* k = kt + i * ld + s;
      a0 = V::Fma(xi, V::Load(k), a0);
      a1 = V::Fma(xi, V::Load(k + W), a1);
    }
    V::Store(out + s, a0);
    V::Store(out + s + W, a1);
  }
  for (; s < nv; s += W) {
    auto a0 = V::Set(0.0f);
    for (size_t i = 0; i < hs; ++i) {
      a0 = V::Fma(V::Set(x[i] * scale), V::Load(kt + i * ld + s), a0);
    }
    V::Store(out + s, a0);
  }
}

// out[0..hs) = sum_{k < n} w[k * w_stride] * rows[k * stride + 0..hs), with
// up to four vectors of out held in registers over the whole sum.
inline void WeightedRows(float* out, const float* w, size_t w_stride, size_t n,
                         const float* rows, size_t stride, size_t hs) {
  constexpr size_t W = V::kWidth;
  size_t i = 0;
  for (; i + 4 * W <= hs; i += 4 * W) {
    auto r0 = V::Set(0.0f), r1 = r0, r2 = r0, r3 = r0;
    for (size_t k = 0; k < n; ++k) {
      const auto wk = V::Set(w[k * w_stride]);
      const float* r = rows + k * stride + i;
      r0 = V::Fma(wk, V::Load(r), r0);
      r1 = V::Fma(wk, V::Load(r + W), r1);
      r2 = V::Fma(wk, V::Load(r + 2 * W), r2);
      r3 = V::Fma(wk, V::Load(r + 3 * W), r3);
    }
    V::Store(out + i, r0);
    V::Store(out + i + W, r1);
    V::Store(out + i + 2 * W, r2);
    V::Store(out + i + 3 * W, r3);
  }
  for (; i + W <= hs; i += W) {
    auto r0 = V::Set(0.0f);
    for (size_t k = 0; k < n; ++k) {
      r0 = V::Fma(V::Set(w[k * w_stride]), V::Load(rows + k * stride + i), r0);
    }
    V::Store(out + i, r0);
  }
  for (; i < hs; ++i) {
    float r = 0.0f;
    for (size_t k = 0; k < n; ++k) r += w[k * w_stride] * rows[k * stride + i];
    out[i] = r;
  }
}

// Softmax of sc[0..n) in place, sc[n..nv) set to 0; nv = RoundUp(n, width).
inline void CausalSoftmax(float* sc, size_t n, size_t nv) {
  constexpr size_t W = V::kWidth;
  auto m = V::Set(-INFINITY);
  size_t s = 0;
  for (; s + W <= n; s += W) m = V::Max(m, V::Load(sc + s));
  float mx = V::HMax(m);
  for (; s < n; ++s) mx = std::max(mx, sc[s]);
  for (s = 0; s < nv; s += W) {
    V::Store(sc + s, V::Exp(V::Sub(V::Load(sc + s), V::Set(mx))));
  }
  std::fill(sc + n, sc + nv, 0.0f);
  auto acc = V::Set(0.0f);
  for (s = 0; s < nv; s += W) acc = V::Add(acc, V::Load(sc + s));
  const auto inv = V::Set(1.0f / V::Sum(acc));
  for (s = 0; s < nv; s += W) V::Store(sc + s, V::Mul(V::Load(sc + s), inv));
}

constexpr size_t kAttnRows = 32;  // queries per task

void AttentionForward(void* out, float* att, const float* qkv, DType wt, int B,
                      int T, int C, int NH) {
  const size_t hs = C / NH, C3 = 3 * size_t(C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const size_t chunks = (size_t(T) + kAttnRows - 1) / kAttnRows;
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    S* os = static_cast<S*>(out);
    tbb::parallel_for(size_t{0}, size_t(B) * NH * chunks, [&](size_t task) {
      const size_t bh = task / chunks, b = bh / NH, h = bh % NH;
      const size_t t0 = (task % chunks) * kAttnRows;
      const size_t t1 = std::min<size_t>(T, t0 + kAttnRows);
      const size_t ld = RoundUp(t1, V::kWidth);
      const float* base = qkv + b * T * C3 + h * hs;
      std::vector<float> kt(hs * ld), sc(ld), acc(hs);
      TransposeHead(kt.data(), base + C, C3, t1, ld, hs);
      for (size_t t = t0; t < t1; ++t) {
        const size_t nv = RoundUp(t + 1, V::kWidth);
        ScoresRow(sc.data(), base + t * C3, scale, kt.data(), ld, nv, hs);
        CausalSoftmax(sc.data(), t + 1, nv);
        float* a = att + (bh * T + t) * T;
        std::copy(sc.data(), sc.data() + t + 1, a);
        std::fill(a + t + 1, a + T, 0.0f);
        WeightedRows(acc.data(), a, 1, t + 1, base + 2 * size_t(C), C3, hs);
        S* o = os + (b * T + t) * C + h * hs;
        ForEach(hs, [&]<class U>(size_t i) {
          U::Store(o + i, U::Load(acc.data() + i));
        });
      }
    });
  });
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv,
                       const float* att, int B, int T, int C, int NH) {
  const size_t hs = C / NH, C3 = 3 * size_t(C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const size_t ld = RoundUp(T, V::kWidth);
  // One task per (b, h): heads own disjoint columns. First, row by row,
  // ds[t][s] = p_ts (dp_ts - sum_s' p_ts' dp_ts') scale with dp_ts = dout_t
  // . v_s, and dq_t = sum_s ds[t][s] k_s; then, key by key, dk_s = sum_t
  // ds[t][s] q_t and dv_s = sum_t p_ts dout_t (t >= s: p and ds are 0 above
  // the diagonal).
  tbb::parallel_for(size_t{0}, size_t(B) * NH, [&](size_t bh) {
    const size_t b = bh / NH, h = bh % NH;
    std::vector<float> ds(size_t(T) * ld), vt(hs * ld);
    const float* base = qkv + b * T * C3 + h * hs;
    const float* dbase_out = dout + b * T * size_t(C) + h * hs;
    float* dbase = dqkv + b * T * C3 + h * hs;
    const float* arows = att + bh * T * T;
    TransposeHead(vt.data(), base + 2 * C, C3, T, ld, hs);
    for (size_t t = 0; t < size_t(T); ++t) {
      const size_t nv = RoundUp(t + 1, V::kWidth);
      float* row = ds.data() + t * ld;
      ScoresRow(row, dbase_out + t * C, 1.0f, vt.data(), ld, nv, hs);
      const float* a = arows + t * T;
      const float pdp = Dot(a, row, t + 1);
      ForEach(t + 1, [&]<class U>(size_t s) {
        U::Store(row + s, U::Mul(U::Mul(U::Load(a + s),
                                        U::Sub(U::Load(row + s), U::Set(pdp))),
                                 U::Set(scale)));
      });
      WeightedRows(dbase + t * C3, row, 1, t + 1, base + C, C3, hs);
    }
    for (size_t s = 0; s < size_t(T); ++s) {
      const size_t n = T - s;
      WeightedRows(dbase + s * C3 + C, ds.data() + s * ld + s, ld, n,
                   base + s * C3, C3, hs);
      WeightedRows(dbase + s * C3 + 2 * C, arows + s * T + s, T, n,
                   dbase_out + s * C, C, hs);
    }
  });
}

void CrossEntropy(float* losses, void* dlogits, const float* logits,
                  const int32_t* targets, DType wt, int N, int vocab,
                  float dscale) {
  WithType(wt, [&](auto tag) {
    using S = decltype(tag);
    S* ds = static_cast<S*>(dlogits);
    ParallelRows(N, vocab, [&](size_t n) {
      const float* l = logits + n * vocab;
      float mx = -INFINITY;
      {
        size_t i = 0;
        if constexpr (V::kWidth > 1) {
          auto m = V::Set(-INFINITY);
          for (; i + V::kWidth <= size_t(vocab); i += V::kWidth)
            m = V::Max(m, V::Load(l + i));
          mx = V::HMax(m);
        }
        for (; i < size_t(vocab); ++i) mx = std::max(mx, l[i]);
      }
      const float sum = SumOf(vocab, [&]<class U>(size_t i) {
        return U::Exp(U::Sub(U::Load(l + i), U::Set(mx)));
      });
      const int32_t tgt = targets[n];
      losses[n] = std::log(sum) - (l[tgt] - mx);
      if (ds == nullptr) return;
      const float k = dscale / sum;
      S* d = ds + n * vocab;
      ForEach(vocab, [&]<class U>(size_t i) {
        U::Store(d + i,
                 U::Mul(U::Exp(U::Sub(U::Load(l + i), U::Set(mx))), U::Set(k)));
      });
      d[tgt] = FromFloat<S>((std::exp(l[tgt] - mx) / sum - 1.0f) * dscale);
    });
  });
}

constexpr CpuKernels kTable = {
    EncoderForward,   EncoderBackward,   LayerNormForward, LayerNormBackward,
    AddBias,          BiasGrad,          GeluForward,      GeluBackward,
    AttentionForward, AttentionBackward, CrossEntropy};

}  // namespace

const CpuKernels& Table() { return kTable; }

}  // namespace finetune::cpu::FINETUNE_CPU_ISA
