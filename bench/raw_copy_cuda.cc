#include <cuda_runtime.h>

#include <chrono>
#include <string>
#include <vector>

#include "bench/raw_copy.h"

namespace strata::bench {
namespace {

Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// The streams of one timing, destroyed on every return path.
struct Streams {
  std::vector<cudaStream_t> s;
  ~Streams() {
    for (cudaStream_t x : s) cudaStreamDestroy(x);
  }
};

// Restores the calling thread's current device.
struct CurrentDevice {
  int previous = -1;
  ~CurrentDevice() {
    if (previous >= 0) cudaSetDevice(previous);
  }
};

}  // namespace

StatusOr<double> TimeRawCudaCopies(int cuda_ordinal,
                                   std::span<const RawCopy> copies,
                                   int iterations) {
  CurrentDevice current;
  STRATA_RETURN_IF_ERROR(
      CudaStatus(cudaGetDevice(&current.previous), "cudaGetDevice"));
  STRATA_RETURN_IF_ERROR(
      CudaStatus(cudaSetDevice(cuda_ordinal), "cudaSetDevice"));
  Streams streams;
  for (size_t i = 0; i < copies.size(); ++i) {
    cudaStream_t s = nullptr;
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                   "cudaStreamCreateWithFlags"));
    streams.s.push_back(s);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int it = 0; it < iterations; ++it) {
    for (size_t i = 0; i < copies.size(); ++i) {
      const RawCopy& c = copies[i];
      const cudaMemcpyKind k =
          c.kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
          : c.kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                              : cudaMemcpyDeviceToDevice;
      STRATA_RETURN_IF_ERROR(
          CudaStatus(cudaMemcpyAsync(c.dst, c.src, c.bytes, k, streams.s[i]),
                     "cudaMemcpyAsync"));
    }
  }
  for (cudaStream_t s : streams.s) {
    STRATA_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace strata::bench
