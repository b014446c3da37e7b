// Kernels of the CUDA backend (convert_kernels.cu), callable from C++. This
// header is plain C++17 with CUDA types only: nvcc compiles the kernels as
// C++17 (CMake 3.25 cannot ask nvcc for C++20), so it does not include
// strata/device.h.
#ifndef STRATA_GPU_CUDA_KERNELS_H_
#define STRATA_GPU_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>

namespace strata::internal {

// Element type codes; the same values as strata::ElementType (checked with
// static_assert in cuda_device.cc).
inline constexpr int kKernelFloat32 = 0;
inline constexpr int kKernelFloat16 = 1;
inline constexpr int kKernelBFloat16 = 2;

// The ConvertArgs contract of strata/device.h.
struct ConvertLaunch {
  const void* src;
  int src_type;
  void* dst;
  int dst_type;
  size_t count;  // elements, > 0
  float scale;
};

// Enqueues the conversion on `stream`; returns the launch error.
// REQUIRES: pointers validated, the stream's device current.
cudaError_t LaunchConvert(const ConvertLaunch& args, cudaStream_t stream);

}  // namespace strata::internal

#endif  // STRATA_GPU_CUDA_KERNELS_H_
