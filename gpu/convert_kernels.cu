// fp32 <-> fp16/bf16 conversion with an optional scale, on a stream. One
// grid-stride kernel per (source, destination) type pair: the product is an
// fp32 multiply and the rounding is the _rn intrinsics' (nearest, ties to
// even), which the conformance suite checks bit for bit against a CPU
// reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "gpu/cuda_kernels.h"

namespace strata::internal {
namespace {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename D>
__device__ __forceinline__ D FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// src and dst may be the same array (in place, same element size), so no
// __restrict__.
template <typename S, typename D>
__global__ void ConvertKernel(const S* src, D* dst, size_t n, float scale) {
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    dst[i] = FromFloat<D>(ToFloat(src[i]) * scale);
  }
}

constexpr unsigned kThreads = 256;
// Enough blocks to fill any current GPU; larger arrays loop in the kernel.
constexpr size_t kMaxBlocks = 4096;

template <typename S, typename D>
cudaError_t Launch(const ConvertLaunch& a, cudaStream_t stream) {
  const size_t blocks =
      std::min(kMaxBlocks, (a.count + kThreads - 1) / kThreads);
  // cudaGetLastError below must report this launch, not an error an earlier
  // runtime call on this thread left behind (that one was already returned to
  // its caller). A sticky error still shows: it is reported again.
  (void)cudaGetLastError();
  ConvertKernel<S, D><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const S*>(a.src), static_cast<D*>(a.dst), a.count, a.scale);
  return cudaGetLastError();
}

template <typename S>
cudaError_t LaunchFrom(const ConvertLaunch& a, cudaStream_t stream) {
  switch (a.dst_type) {
    case kKernelFloat32:
      return Launch<S, float>(a, stream);
    case kKernelFloat16:
      return Launch<S, __half>(a, stream);
    case kKernelBFloat16:
      return Launch<S, __nv_bfloat16>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchConvert(const ConvertLaunch& args, cudaStream_t stream) {
  switch (args.src_type) {
    case kKernelFloat32:
      return LaunchFrom<float>(args, stream);
    case kKernelFloat16:
      return LaunchFrom<__half>(args, stream);
    case kKernelBFloat16:
      return LaunchFrom<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace strata::internal
