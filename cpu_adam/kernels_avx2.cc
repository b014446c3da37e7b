// The AVX2 + FMA + F16C variant: 8 lanes. Built with -mavx2 -mfma -mf16c;
// the driver calls it only after __builtin_cpu_supports says all three.
#include <immintrin.h>

#define STRATA_CPU_ADAM_ISA avx2
#include "cpu_adam/kernel_impl.h"

namespace strata::cpu_adam::avx2 {
namespace {

// fp32 -> bf16 of 8 lanes with FloatToBf16's contract (RNE, NaN quieted,
// denormals to signed zero), each result in the low 16 bits of its 32-bit
// lane (the high 16 zero), ready for packus.
[[gnu::always_inline]] inline __m256i ToBf16Lanes(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  // abs <= 0x7fffffff, so the signed compares are the unsigned ones.
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  // Exponent 0 (zero or denormal): abs < the smallest normal's bits.
  const __m256i den = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), abs);
  const __m256i lsb =
      _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                         nan);
  // A denormal's rounding never carries into the sign: keep only the sign.
  r = _mm256_andnot_si256(_mm256_and_si256(den, _mm256_set1_epi32(0x7fffffff)),
                          r);
  return _mm256_srli_epi32(r, 16);
}

[[gnu::always_inline]] inline __m128i ToBf16(__m256 x) {
  // packus works within 128-bit lanes: gather lanes 0 and 2 afterwards.
  const __m256i r = ToBf16Lanes(x);
  return _mm256_castsi256_si128(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

[[gnu::always_inline]] inline __m128i ToF16(__m256 x) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

inline __m128i Load128(const void* p) {
  return _mm_loadu_si128(static_cast<const __m128i*>(p));
}

// The 16 bytes at p loaded into both 128-bit halves, and each half's bytes
// picked from them by `pick` (index -1: a zero byte): a widening that
// stays within halves (Note [Codes in 128-bit halves]).
[[gnu::always_inline]] inline __m256i PickFromBoth(const void* p,
                                                   __m256i pick) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(Load128(p)), pick);
}

struct Avx2 {
  using F = __m256;
  struct D {
    __m256d lo, hi;
  };
  using Bad = __m256i;
  static constexpr size_t kN = 8;

  static F Set(float x) { return _mm256_set1_ps(x); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static F Load(const F16* p) { return _mm256_cvtph_ps(Load128(p)); }
  static F Load(const Bf16* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(Load128(p)), 16));
  }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void Store(F16* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ToF16(x));
  }
  static void Store(Bf16* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ToBf16(x));
  }
  // REQUIRES: p is 16-byte aligned (StreamHead).
  static void Stream(F16* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), ToF16(x));
  }
  static void Stream(Bf16* p, F x) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), ToBf16(x));
  }
  static void Fence() { _mm_sfence(); }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F Sign(F a) {
    const F zero = _mm256_setzero_ps();
    const F pos =
        _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const F neg = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ),
                                _mm256_set1_ps(-1.0f));
    return _mm256_or_ps(pos, neg);
  }

  using I = __m256i;
  static I ISet(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I IBits(F x) { return _mm256_castps_si256(x); }
  static F FBits(I x) { return _mm256_castsi256_ps(x); }
  static I IMin(I a, I b) { return _mm256_min_epi32(a, b); }
  static I IMax(I a, I b) { return _mm256_max_epi32(a, b); }
  static uint32_t IMaxAll(I a) {
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(a),
                              _mm256_extracti128_si256(a, 1));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  static D DZero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static D SqAcc(D acc, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return {_mm256_fmadd_pd(lo, lo, acc.lo), _mm256_fmadd_pd(hi, hi, acc.hi)};
  }
  static double DSum(D acc) {
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(acc.lo, acc.hi));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  static Bad BadZero() { return _mm256_setzero_si256(); }
  static Bad BadOr(Bad bad, F x) {
    const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), exp_mask);
    return _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, exp_mask));
  }
  static bool BadAny(Bad bad) { return !_mm256_testz_si256(bad, bad); }
};

// Everything here is forced inline: a call would pass the two-register
// struct through memory, and GCC's size heuristics otherwise leave the
// bf16 packing out of line (measured: 40% of the bf16-moment update).
//
// Two AVX2 registers per operation (16 lanes): the update's loops run half
// as many iterations with two independent dependency chains through the
// divisions and square roots, and 16 bf16 lanes are packed with one
// pack/permute pair into one 32-byte (or non-temporal) store instead of two
// half-width ones. Lane for lane the same operations as Avx2, so the
// results are the same bits.
struct Avx2x2 {
  struct F {
    __m256 lo, hi;
  };
  struct I {
    __m256i lo, hi;
  };
  static constexpr size_t kN = 16;

  template <class Op>
  [[gnu::always_inline]] static F Map(F a, F b, Op op) {
    return {op(a.lo, b.lo), op(a.hi, b.hi)};
  }
  template <class Op>
  [[gnu::always_inline]] static I IMap(I a, I b, Op op) {
    return {op(a.lo, b.lo), op(a.hi, b.hi)};
  }

  [[gnu::always_inline]] static F Set(float x) {
    return {Avx2::Set(x), Avx2::Set(x)};
  }
  template <class T>
  [[gnu::always_inline]] static F Load(const T* p) {
    return {Avx2::Load(p), Avx2::Load(p + 8)};
  }
  // 16 bf16 values as the top halves of 16 fp32 lanes: each 8 loaded into
  // both 128-bit halves, and each half's 4 picked by a byte shuffle (index
  // -1: a zero byte), all within halves. A qword permute and two unpacks
  // had one lane-crossing op, which Zen 3 runs on one port only: llvm-mca's
  // Zen 3 model of the bf16-moment AdamW loop, 42.7 -> 37.5 cycles per 16
  // elements; in cache on one Zen 5 core within 1-2% (Lion with bf16
  // moments 2.52-2.67 -> 2.77-2.80 G params/s). (Two zero-extensions, an
  // extract and two shifts had been 2-4% slower than the permute on Zen 4.)
  [[gnu::always_inline]] static F Load(const Bf16* p) {
    const __m256i top = _mm256_setr_epi8(
        -1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,  //
        -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return {_mm256_castsi256_ps(PickFromBoth(p, top)),
            _mm256_castsi256_ps(PickFromBoth(p + 8, top))};
  }
  // The low 16 bits of 16 dword lanes (each at most 0xffff), in order:
  // packus works within 128-bit halves, [lo 0-3, hi 0-3 | lo 4-7, hi 4-7],
  // and the qword permute puts them in order.
  [[gnu::always_inline]] static __m256i PackLow16(__m256i lo, __m256i hi) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
  }
  [[gnu::always_inline]] static void Store(float* p, F x) {
    Avx2::Store(p, x.lo);
    Avx2::Store(p + 8, x.hi);
  }
  [[gnu::always_inline]] static __m256i PackF16(F x) {
    return _mm256_set_m128i(ToF16(x.hi), ToF16(x.lo));
  }
  // Note [bf16 rounding in two steps]: FloatToBf16's contract takes 12
  // integer operations per 8 lanes, 6 of them for NaNs and denormals, and
  // those roundings were most of the AVX2 update (in cache on one Zen 4
  // core, truncating instead took fp32-moment AdamW from 1.8 to 2.8 G
  // params/s). So 16 lanes are first rounded as if normal (add 0x7fff plus
  // the lowest kept bit, keep the top half: the contract for every normal
  // input, a carry into the exponent included), and the result's exponent
  // decides whether that was right:
  //   - a normal input gives exponent 1..255, and the plain rounding is its
  //     contracted result;
  //   - a zero or denormal input gives exponent 0 or 1 (it is below 2^-126,
  //     and rounding adds at most 2^-133);
  //   - an infinity or NaN gives exponent 255, or 0 where a NaN's payload
  //     carried through the sign bit (0x7fff8001 and up, either sign).
  // So a result whose exponent is 2..254 is the contract's, and any other
  // sends the 16 lanes through the exact rounding (zeros too: telling +0
  // from a NaN that wrapped to it would cost what it saves). An and, an add
  // and a compare of the 16-bit exponents and a branch per 16 lanes replace
  // the 6 operations per 8 lanes.
  [[gnu::noinline]] static __m256i PackBf16Exact(__m256 lo, __m256 hi) {
    return PackLow16(ToBf16Lanes(lo), ToBf16Lanes(hi));
  }
  // fp32 -> bf16 of 8 normal lanes (see above), in the low 16 bits.
  [[gnu::always_inline]] static __m256i RoundNormal(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb =
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
        16);
  }
  // One pack and one permute for 16 lanes, and the check above.
  [[gnu::always_inline]] static __m256i PackBf16(F x) {
    const __m256i h = PackLow16(RoundNormal(x.lo), RoundNormal(x.hi));
    // exponent field e = k << 7; e + 0x7f00 read as int16 is at most -512
    // exactly for k in 2..254 (0x8000 at k = 2, 0xfe00 at k = 254).
    const __m256i e = _mm256_and_si256(h, _mm256_set1_epi16(0x7f80));
    const __m256i other =
        _mm256_cmpgt_epi16(_mm256_add_epi16(e, _mm256_set1_epi16(0x7f00)),
                           _mm256_set1_epi16(static_cast<int16_t>(0xfe00)));
    if (_mm256_movemask_epi8(other) != 0) [[unlikely]] {
      return PackBf16Exact(x.lo, x.hi);
    }
    return h;
  }
  [[gnu::always_inline]] static void Store(F16* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), PackF16(x));
  }
  [[gnu::always_inline]] static void Store(Bf16* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), PackBf16(x));
  }
  // REQUIRES: p is 32-byte aligned (StreamHead).
  [[gnu::always_inline]] static void Stream(F16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), PackF16(x));
  }
  [[gnu::always_inline]] static void Stream(Bf16* p, F x) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), PackBf16(x));
  }
  [[gnu::always_inline]] static void Fence() { _mm_sfence(); }
  [[gnu::always_inline]] static F Add(F a, F b) { return Map(a, b, Avx2::Add); }
  [[gnu::always_inline]] static F Mul(F a, F b) { return Map(a, b, Avx2::Mul); }
  [[gnu::always_inline]] static F Div(F a, F b) { return Map(a, b, Avx2::Div); }
  [[gnu::always_inline]] static F Sqrt(F a) {
    return {Avx2::Sqrt(a.lo), Avx2::Sqrt(a.hi)};
  }
  [[gnu::always_inline]] static F Fma(F a, F b, F c) {
    return {Avx2::Fma(a.lo, b.lo, c.lo), Avx2::Fma(a.hi, b.hi, c.hi)};
  }
  [[gnu::always_inline]] static F Sign(F a) {
    return {Avx2::Sign(a.lo), Avx2::Sign(a.hi)};
  }

  [[gnu::always_inline]] static I ISet(uint32_t x) {
    return {Avx2::ISet(x), Avx2::ISet(x)};
  }
  [[gnu::always_inline]] static I IBits(F x) {
    return {Avx2::IBits(x.lo), Avx2::IBits(x.hi)};
  }
  [[gnu::always_inline]] static F FBits(I x) {
    return {Avx2::FBits(x.lo), Avx2::FBits(x.hi)};
  }
  [[gnu::always_inline]] static I IMin(I a, I b) {
    return IMap(a, b, Avx2::IMin);
  }
  [[gnu::always_inline]] static I IMax(I a, I b) {
    return IMap(a, b, Avx2::IMax);
  }
  [[gnu::always_inline]] static uint32_t IMaxAll(I a) {
    return Avx2::IMaxAll(Avx2::IMax(a.lo, a.hi));
  }

  // Note [The 8-bit update in two sweeps] (kernel_impl.h).
  static constexpr bool kSplitUpdate8 = true;

  // 16 lanes of 16 bits, one register: as many lanes as F.
  using H = __m256i;
  static constexpr size_t kH = 16;
  [[gnu::always_inline]] static H HSet(uint16_t x) {
    return _mm256_set1_epi16(static_cast<short>(x));
  }
  [[gnu::always_inline]] static H HAnd(H a, H b) {
    return _mm256_and_si256(a, b);
  }
  [[gnu::always_inline]] static H HOr(H a, H b) {
    return _mm256_or_si256(a, b);
  }
  [[gnu::always_inline]] static H HAdd(H a, H b) {
    return _mm256_add_epi16(a, b);
  }
  [[gnu::always_inline]] static H HSubSat(H a, H b) {
    return _mm256_subs_epu16(a, b);
  }
  template <int k>
  [[gnu::always_inline]] static H HSrl(H a) {
    return _mm256_srli_epi16(a, k);
  }
  template <int k>
  [[gnu::always_inline]] static H HSll(H a) {
    return _mm256_slli_epi16(a, k);
  }
  [[gnu::always_inline]] static H HMin(H a, H b) {
    return _mm256_min_epi16(a, b);
  }
  [[gnu::always_inline]] static H HMax(H a, H b) {
    return _mm256_max_epi16(a, b);
  }
  [[gnu::always_inline]] static H HZeroIfZero(H c, H t) {
    return _mm256_andnot_si256(_mm256_cmpeq_epi16(c, _mm256_setzero_si256()),
                               t);
  }
  [[gnu::always_inline]] static H HLoad(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  [[gnu::always_inline]] static void HStore(uint16_t* p, H h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  // Note [Codes in 128-bit halves]: the 16-bit lanes of a code vector hold
  // elements 0-3, 8-11 | 4-7, 12-15, the order in which the in-half unpacks
  // and packs of AVX2 meet them, so no lane-crossing permute (one port on
  // Zen 3) is needed: HLoadU8 broadcasts the 16 code bytes to both halves
  // and picks each half's 8 with a byte shuffle (a zero-extending move
  // would cross halves), HStoreU8 packs and shuffles dwords back within a
  // half, HTop's pack yields the order by itself, and HLoad and HStore keep
  // it for the block scratch. llvm-mca's Zen 3 model of the 8-bit AdamW
  // loop: 50.7 cycles per 16 elements with the permutes, 45.7 without, 43.9
  // with the byte shuffle for the zero-extension.
  [[gnu::always_inline]] static H HLoadU8(const uint8_t* p) {
    const __m256i pick = _mm256_setr_epi8(
        0, -1, 1, -1, 2, -1, 3, -1, 8, -1, 9, -1, 10, -1, 11, -1,  //
        4, -1, 5, -1, 6, -1, 7, -1, 12, -1, 13, -1, 14, -1, 15, -1);
    return PickFromBoth(p, pick);
  }
  // packus saturates each lane at 255.
  [[gnu::always_inline]] static void HStoreU8(uint8_t* p, H c) {
    const __m128i bytes = _mm_packus_epi16(_mm256_castsi256_si128(c),
                                           _mm256_extracti128_si256(c, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_shuffle_epi32(bytes, 0xd8));
  }
  // Both code vectors with one pack: its halves hold a's and b's bytes of
  // their half, [a 0-3, 8-11; b 0-3, 8-11 | a 4-7, 12-15; b 4-7, 12-15],
  // the qword permute gathers a into the low half and b into the high, and
  // the dword shuffle orders each: three shuffles for both instead of three
  // for each.
  [[gnu::always_inline]] static void HStoreU8Pair(uint8_t* p, H a, uint8_t* q,
                                                  H b) {
    const __m256i bytes = _mm256_shuffle_epi32(
        _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xd8), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q),
                     _mm256_extracti128_si256(bytes, 1));
  }
  [[gnu::always_inline]] static H HTop(const F* x) {
    return _mm256_packus_epi32(
        _mm256_srli_epi32(_mm256_castps_si256(x->lo), 16),
        _mm256_srli_epi32(_mm256_castps_si256(x->hi), 16));
  }
  template <int k>
  [[gnu::always_inline]] static F HWiden(H h) {
    static_assert(k == 0);
    const __m256i z = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h))};
  }
  // The 16 lanes widened to double, in lane order. Four named registers,
  // not an array: GCC kept an array member (and the loops over it) on the
  // stack, a store and a reload per register per step: AVX2 Adafactor ran at
  // 0.73 G params/s in cache on one Zen 5 core, against 1.53 with these.
  struct DL {
    __m256d d0, d1, d2, d3;
  };
  [[gnu::always_inline]] static DL Widen(F x) {
    return {_mm256_cvtps_pd(_mm256_castps256_ps128(x.lo)),
            _mm256_cvtps_pd(_mm256_extractf128_ps(x.lo, 1)),
            _mm256_cvtps_pd(_mm256_castps256_ps128(x.hi)),
            _mm256_cvtps_pd(_mm256_extractf128_ps(x.hi, 1))};
  }
  [[gnu::always_inline]] static DL DLZero() {
    const __m256d z = _mm256_setzero_pd();
    return {z, z, z, z};
  }
  [[gnu::always_inline]] static DL DLAdd(DL acc, F x) {
    const DL w = Widen(x);
    return {_mm256_add_pd(acc.d0, w.d0), _mm256_add_pd(acc.d1, w.d1),
            _mm256_add_pd(acc.d2, w.d2), _mm256_add_pd(acc.d3, w.d3)};
  }
  [[gnu::always_inline]] static DL DLSq(DL acc, F x) {
    const DL w = Widen(x);
    return {_mm256_fmadd_pd(w.d0, w.d0, acc.d0),
            _mm256_fmadd_pd(w.d1, w.d1, acc.d1),
            _mm256_fmadd_pd(w.d2, w.d2, acc.d2),
            _mm256_fmadd_pd(w.d3, w.d3, acc.d3)};
  }
  [[gnu::always_inline]] static DL DLLoad(const double* p) {
    return {_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4), _mm256_loadu_pd(p + 8),
            _mm256_loadu_pd(p + 12)};
  }
  [[gnu::always_inline]] static void DLStore(double* p, DL acc) {
    _mm256_storeu_pd(p, acc.d0);
    _mm256_storeu_pd(p + 4, acc.d1);
    _mm256_storeu_pd(p + 8, acc.d2);
    _mm256_storeu_pd(p + 12, acc.d3);
  }
  [[gnu::always_inline]] static void DPut(double* p, F x) {
    DLStore(p, Widen(x));
  }
  [[gnu::always_inline]] static void DAccum(double* p, F x) {
    const DL w = Widen(x);
    _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), w.d0));
    _mm256_storeu_pd(p + 4, _mm256_add_pd(_mm256_loadu_pd(p + 4), w.d1));
    _mm256_storeu_pd(p + 8, _mm256_add_pd(_mm256_loadu_pd(p + 8), w.d2));
    _mm256_storeu_pd(p + 12, _mm256_add_pd(_mm256_loadu_pd(p + 12), w.d3));
  }
};

}  // namespace
}  // namespace strata::cpu_adam::avx2

namespace strata::cpu_adam {

const KernelTable& Avx2Kernels() {
  // The update and conversions 16 lanes wide; the gradient statistics 8
  // wide (their double accumulators are already two registers).
  static const KernelTable table =
      avx2::MakeTable<avx2::Avx2x2, avx2::Avx2>(CpuKernelVariant::kAvx2);
  return table;
}

}  // namespace strata::cpu_adam
