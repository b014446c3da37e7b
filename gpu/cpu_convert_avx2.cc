// ConvertOnCpu with AVX2 and F16C, eight elements at a time. Compiled with
// -mavx2 -mf16c (gpu/CMakeLists.txt) and called only on CPUs that have both,
// so nothing here may be inlined into code that runs elsewhere: the file
// defines one external function and keeps its helpers in an anonymous
// namespace.
//
// Bit for bit the reference (ConvertOnCpuReference): the product is one fp32
// multiply; fp16 rounding is VCVTPS2PH with round-to-nearest-even, which
// keeps subnormals and overflows to infinity as the reference does; bf16
// rounding is the reference's integer rounding (util/half.h) on eight lanes;
// NaN inputs become the canonical NaN 0x7fff in 16-bit outputs (the
// instruction would keep their payload). Widening is exact either way.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "gpu/cpu_kernels.h"

namespace strata::internal {
namespace {

__m256 Load8(const std::byte* p, ElementType t) {
  switch (t) {
    case ElementType::kFloat32:
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    case ElementType::kFloat16:
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    case ElementType::kBFloat16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          16));
  }
  return _mm256_setzero_ps();
}

// 0xffff in the 16-bit lanes whose fp32 input is NaN.
__m128i NanMask16(__m256 v) {
  const __m256i m = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm_packs_epi32(_mm256_castsi256_si128(m),
                         _mm256_extracti128_si256(m, 1));
}

void Store8(std::byte* p, ElementType t, __m256 v) {
  __m128i h;
  switch (t) {
    case ElementType::kFloat32:
      _mm256_storeu_ps(reinterpret_cast<float*>(p), v);
      return;
    case ElementType::kFloat16:
      h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      break;
    case ElementType::kBFloat16: {
      // Bf16FromFloatBits: (u + 0x7fff + ((u >> 16) & 1)) >> 16.
      const __m256i u = _mm256_castps_si256(v);
      const __m256i odd =
          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      const __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd),
          16);
      h = _mm_packus_epi32(_mm256_castsi256_si128(r),
                           _mm256_extracti128_si256(r, 1));
      break;
    }
    default:
      return;
  }
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7fff), NanMask16(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// Whole blocks of eight with both types fixed at compile time, so that the
// loop neither branches on them nor reloads them (stores through dst could
// alias the arguments otherwise). Returns the elements converted.
template <ElementType kSrc, ElementType kDst>
size_t ConvertBlocks(const std::byte* src, std::byte* dst, size_t count,
                     float scale) {
  constexpr size_t ss = kSrc == ElementType::kFloat32 ? 4 : 2;
  constexpr size_t ds = kDst == ElementType::kFloat32 ? 4 : 2;
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    Store8(dst + i * ds, kDst, _mm256_mul_ps(Load8(src + i * ss, kSrc), s));
  }
  return i;
}

template <ElementType kSrc>
size_t ConvertBlocksFrom(const std::byte* src, std::byte* dst, ElementType d,
                         size_t count, float scale) {
  switch (d) {
    case ElementType::kFloat32:
      return ConvertBlocks<kSrc, ElementType::kFloat32>(src, dst, count, scale);
    case ElementType::kFloat16:
      return ConvertBlocks<kSrc, ElementType::kFloat16>(src, dst, count, scale);
    case ElementType::kBFloat16:
      return ConvertBlocks<kSrc, ElementType::kBFloat16>(src, dst, count,
                                                         scale);
  }
  return 0;
}

}  // namespace

void ConvertOnCpuAvx2(const ConvertArgs& args) {
  const auto* src = static_cast<const std::byte*>(args.src);
  auto* dst = static_cast<std::byte*>(args.dst);
  const size_t ss = ElementSize(args.src_type);
  const size_t ds = ElementSize(args.dst_type);
  // In place between types of one size (the only overlap allowed) is safe:
  // each block is loaded whole before it is stored.
  size_t i = 0;
  switch (args.src_type) {
    case ElementType::kFloat32:
      i = ConvertBlocksFrom<ElementType::kFloat32>(src, dst, args.dst_type,
                                                   args.count, args.scale);
      break;
    case ElementType::kFloat16:
      i = ConvertBlocksFrom<ElementType::kFloat16>(src, dst, args.dst_type,
                                                   args.count, args.scale);
      break;
    case ElementType::kBFloat16:
      i = ConvertBlocksFrom<ElementType::kBFloat16>(src, dst, args.dst_type,
                                                    args.count, args.scale);
      break;
  }
  if (i == args.count) return;
  ConvertArgs tail = args;
  tail.src = src + i * ss;
  tail.dst = dst + i * ds;
  tail.count = args.count - i;
  ConvertOnCpuReference(tail);
}

}  // namespace strata::internal
