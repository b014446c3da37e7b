#include "gpu/cuda_host_event.h"

#include <cstddef>

namespace strata::internal {
namespace {

constexpr size_t kPageBytes = 4096;
constexpr size_t kWordStride = 64;  // one cache line per word

}  // namespace

StreamWaitValue32Fn ResolveStreamWaitValue32(int ordinal, std::string* why) {
  int can_map = 0;
  if (cudaDeviceGetAttribute(&can_map, cudaDevAttrCanMapHostMemory, ordinal) !=
          cudaSuccess ||
      can_map == 0) {
    (void)cudaGetLastError();
    *why = "the GPU cannot map host memory (cudaDevAttrCanMapHostMemory)";
    return nullptr;
  }
  // Asked for as of CUDA 12.0, which has the v2 stream memory operations
  // (available on every platform without a driver option); an older driver
  // answers null or cudaErrorInvalidValue.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(
      "cuStreamWaitValue32", &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess || fn == nullptr ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    *why = std::string(
               "the CUDA driver has no cuStreamWaitValue32 of CUDA 12.0 or "
               "later (cudaGetDriverEntryPointByVersion: ") +
           cudaGetErrorName(err) + ", query result " +
           std::to_string(static_cast<int>(found)) + ")";
    return nullptr;
  }
  return reinterpret_cast<StreamWaitValue32Fn>(fn);
}

HostWordPool::~HostWordPool() {
  MutexLock lock(&mu_);
  for (void* p : pages_) (void)cudaFreeHost(p);
}

cudaError_t HostWordPool::Take(HostWord* word) {
  MutexLock lock(&mu_);
  if (free_.empty()) {
    void* page = nullptr;
    cudaError_t err = cudaHostAlloc(
        &page, kPageBytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) return err;
    void* device = nullptr;
    err = cudaHostGetDevicePointer(&device, page, 0);
    if (err != cudaSuccess) {
      (void)cudaFreeHost(page);
      return err;
    }
    pages_.push_back(page);
    for (size_t off = 0; off < kPageBytes; off += kWordStride) {
      auto* host =
          reinterpret_cast<uint32_t*>(static_cast<std::byte*>(page) + off);
      *host = 0;
      free_.push_back({host, reinterpret_cast<CUdeviceptr>(device) + off});
    }
  }
  *word = free_.back();
  free_.pop_back();
  return cudaSuccess;
}

void HostWordPool::Give(const HostWord& word) {
  MutexLock lock(&mu_);
  free_.push_back(word);
}

}  // namespace strata::internal
