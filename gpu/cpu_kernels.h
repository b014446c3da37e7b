// Scalar CPU implementations of the device's numeric work: the host-emulated
// backend runs them, and they are written for clarity, not speed (the
// engine's fast CPU conversions belong to cpu_adam, which gpu/ does not
// depend on).
//
// Conversions round to nearest, ties to even, as cvt.rn in PTX and the
// __float2half_rn / __float2bfloat16_rn intrinsics do: overflow gives +-inf,
// tiny values become fp16 subnormals or signed zero, and any NaN becomes the
// canonical NaN 0x7fff (as CUDA's conversions produce). Thread-safe (pure).
#ifndef STRATA_GPU_CPU_KERNELS_H_
#define STRATA_GPU_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "strata/device.h"

namespace strata::internal {

uint16_t FloatToHalfBits(float f);
float HalfBitsToFloat(uint16_t h);
uint16_t FloatToBFloat16Bits(float f);
float BFloat16BitsToFloat(uint16_t b);

// The ConvertArgs contract on host memory.
void ConvertOnCpu(const ConvertArgs& args);

// The GemmArgs contract on host memory: fp32 accumulation over k in order.
// REQUIRES: arguments validated by CheckGemmArgs.
void GemmOnCpu(const GemmArgs& args);

// Shapes, leading dimensions and types of a GEMM; kInvalidArgument or
// kNotSupported naming the first problem.
Status CheckGemmArgs(const GemmArgs& args);
// Bytes spanned by a column-major rows x cols matrix with leading dimension
// ld of `elem` bytes each (0 when rows or cols is 0).
uint64_t MatrixSpanBytes(int64_t rows, int64_t cols, int64_t ld, size_t elem);

}  // namespace strata::internal

#endif  // STRATA_GPU_CPU_KERNELS_H_
