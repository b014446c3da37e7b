// CPU implementations of the device's numeric work. The scalar reference
// versions (...Reference) are written for clarity and are what the tests
// compare against; ConvertOnCpu is the vectorized one the host-emulated
// device runs (gpu/cpu_compute.h adds threads and the BLAS GEMM). gpu/ does
// not depend on cpu_adam, whose conversions follow x86's NaN and denormal
// rules rather than CUDA's.
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

// The ConvertArgs contract on host memory, one element at a time.
void ConvertOnCpuReference(const ConvertArgs& args);
// The same, bit for bit, with the widest vector unit this CPU has (AVX2 and
// F16C, else the reference). Single-threaded.
void ConvertOnCpu(const ConvertArgs& args);

// The GemmArgs contract on host memory: fp32 accumulation over k in order,
// one element at a time. REQUIRES: arguments validated by CheckGemmArgs.
void GemmOnCpuReference(const GemmArgs& args);

// Shapes, leading dimensions and types of a GEMM; kInvalidArgument or
// kNotSupported naming the first problem.
Status CheckGemmArgs(const GemmArgs& args);
// Bytes spanned by a column-major rows x cols matrix with leading dimension
// ld of `elem` bytes each (0 when rows or cols is 0).
uint64_t MatrixSpanBytes(int64_t rows, int64_t cols, int64_t ld, size_t elem);

}  // namespace strata::internal

#endif  // STRATA_GPU_CPU_KERNELS_H_
