#include "gpu/cpu_kernels.h"

#include <cpuid.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "util/half.h"

namespace strata::internal {

// gpu/cpu_convert_avx2.cc, compiled with -mavx2 -mf16c; called only when the
// CPU has both.
void ConvertOnCpuAvx2(const ConvertArgs& args);

namespace {

float LoadElement(const void* base, size_t i, ElementType type) {
  switch (type) {
    case ElementType::kFloat32: {
      float f;
      std::memcpy(&f, static_cast<const std::byte*>(base) + 4 * i, 4);
      return f;
    }
    case ElementType::kFloat16:
    case ElementType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, static_cast<const std::byte*>(base) + 2 * i, 2);
      return type == ElementType::kFloat16 ? HalfBitsToFloat(h)
                                           : BFloat16BitsToFloat(h);
    }
  }
  return 0;
}

void StoreElement(void* base, size_t i, ElementType type, float v) {
  switch (type) {
    case ElementType::kFloat32:
      std::memcpy(static_cast<std::byte*>(base) + 4 * i, &v, 4);
      return;
    case ElementType::kFloat16:
    case ElementType::kBFloat16: {
      const uint16_t h = type == ElementType::kFloat16 ? FloatToHalfBits(v)
                                                       : FloatToBFloat16Bits(v);
      std::memcpy(static_cast<std::byte*>(base) + 2 * i, &h, 2);
      return;
    }
  }
}

constexpr uint16_t kCanonicalNaN = 0x7fff;

}  // namespace

uint16_t FloatToHalfBits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return kCanonicalNaN;
  return static_cast<uint16_t>(((x >> 16) & 0x8000u) |
                               HalfMagnitudeFromFloatBits(abs));
}

float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  if ((h & 0x7c00u) == 0x7c00u) {  // inf or NaN, payload kept
    return std::bit_cast<float>(sign | 0x7f800000u | ((h & 0x3ffu) << 13));
  }
  return std::bit_cast<float>(sign | FloatBitsFromHalfMagnitude(h & 0x7fffu));
}

uint16_t FloatToBFloat16Bits(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return kCanonicalNaN;
  return Bf16FromFloatBits(x);
}

float BFloat16BitsToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

void ConvertOnCpuReference(const ConvertArgs& args) {
  for (size_t i = 0; i < args.count; ++i) {
    const float v = LoadElement(args.src, i, args.src_type) * args.scale;
    StoreElement(args.dst, i, args.dst_type, v);
  }
}

namespace {
// F16C is CPUID leaf 1, ECX bit 29 (clang before 15 rejects
// __builtin_cpu_supports("f16c")); the avx2 check beside it establishes
// that the OS saves the AVX state.
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
}  // namespace

void ConvertOnCpu(const ConvertArgs& args) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && CpuHasF16c();
  if (avx2) {
    ConvertOnCpuAvx2(args);
  } else {
    ConvertOnCpuReference(args);
  }
}

uint64_t MatrixSpanBytes(int64_t rows, int64_t cols, int64_t ld, size_t elem) {
  if (rows <= 0 || cols <= 0) return 0;
  // Dimensions are below 2^31 (CheckGemmArgs), so only the last product can
  // wrap; a span that would is reported as the largest size, never fits.
  const uint64_t elems =
      static_cast<uint64_t>(ld) * static_cast<uint64_t>(cols - 1) +
      static_cast<uint64_t>(rows);
  if (elems > UINT64_MAX / elem) return UINT64_MAX;
  return elems * elem;
}

Status CheckGemmArgs(const GemmArgs& g) {
  if (g.m < 0 || g.n < 0 || g.k < 0) {
    return Status::InvalidArgument("GEMM dimensions must be >= 0");
  }
  if (g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX ||
      g.lda > INT32_MAX || g.ldb > INT32_MAX || g.ldc > INT32_MAX) {
    return Status::NotSupported("GEMM dimensions above 2^31-1");
  }
  if (g.c_type != g.ab_type && g.c_type != ElementType::kFloat32) {
    return Status::NotSupported(std::string("GEMM with A/B of ") +
                                std::string(ElementTypeName(g.ab_type)) +
                                " and C of " +
                                std::string(ElementTypeName(g.c_type)) +
                                "; C must match A/B or be float32");
  }
  const int64_t a_rows = g.op_a == GemmOp::kNoTranspose ? g.m : g.k;
  const int64_t b_rows = g.op_b == GemmOp::kNoTranspose ? g.k : g.n;
  if (g.lda < std::max<int64_t>(1, a_rows) ||
      g.ldb < std::max<int64_t>(1, b_rows) ||
      g.ldc < std::max<int64_t>(1, g.m)) {
    return Status::InvalidArgument(
        "GEMM leading dimension smaller than the stored rows (lda " +
        std::to_string(g.lda) + ", ldb " + std::to_string(g.ldb) + ", ldc " +
        std::to_string(g.ldc) + " for m " + std::to_string(g.m) + ", n " +
        std::to_string(g.n) + ", k " + std::to_string(g.k) + ")");
  }
  return Status::Ok();
}

void GemmOnCpuReference(const GemmArgs& g) {
  const bool ta = g.op_a == GemmOp::kTranspose;
  const bool tb = g.op_b == GemmOp::kTranspose;
  for (int64_t j = 0; j < g.n; ++j) {
    for (int64_t i = 0; i < g.m; ++i) {
      float acc = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        const int64_t ai = ta ? p + i * g.lda : i + p * g.lda;
        const int64_t bi = tb ? j + p * g.ldb : p + j * g.ldb;
        acc += LoadElement(g.a, static_cast<size_t>(ai), g.ab_type) *
               LoadElement(g.b, static_cast<size_t>(bi), g.ab_type);
      }
      const size_t ci = static_cast<size_t>(i + j * g.ldc);
      float out = g.alpha * acc;
      if (g.beta != 0) out += g.beta * LoadElement(g.c, ci, g.c_type);
      StoreElement(g.c, ci, g.c_type, out);
    }
  }
}

}  // namespace strata::internal
