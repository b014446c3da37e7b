// The CUDA side of HostEvent (strata/device.h): the 32-bit words that
// streams wait on with the driver's cuStreamWaitValue32, in host memory
// mapped into the GPU, and the run-time lookup of that driver function (so
// libcuda need not be linked when strata is built). Internal to the CUDA
// backend; see docs/gpu.md, "Host events on CUDA".
#ifndef STRATA_GPU_CUDA_HOST_EVENT_H_
#define STRATA_GPU_CUDA_HOST_EVENT_H_

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpu/host_signal.h"
#include "util/mutex.h"

namespace strata::internal {

// cuStreamWaitValue32 (the v2 entry point, CUDA 11.7 and later).
using StreamWaitValue32Fn = CUresult(CUDAAPI*)(CUstream stream,
                                               CUdeviceptr addr,
                                               cuuint32_t value,
                                               unsigned int flags);

// Looks the driver function up for the GPU `ordinal` (current on the calling
// thread): null, with the reason in `why`, when the driver lacks it or the
// GPU cannot map host memory.
StreamWaitValue32Fn ResolveStreamWaitValue32(int ordinal, std::string* why);

// A word of mapped, page-locked host memory: the host writes `host`, a
// stream waits on `device`.
struct HostWord {
  uint32_t* host = nullptr;
  CUdeviceptr device = 0;
};

// Words for host events, carved from 4 KiB pages of cudaHostAlloc'ed
// (mapped, portable) memory, one per 64-byte line. A word given back is
// reused as it is, never reset (Note [Host event word] in
// gpu/host_signal.h), and pages are freed only with the pool, so a stream
// still waiting on a word never reads freed memory. Thread-safe.
class HostWordPool {
 public:
  HostWordPool() = default;
  // REQUIRES: no stream still waits on a word (the device is being
  // destroyed, its streams drained).
  ~HostWordPool();
  HostWordPool(const HostWordPool&) = delete;
  HostWordPool& operator=(const HostWordPool&) = delete;

  // A free word, allocating a page when none is free. REQUIRES: the GPU
  // current on the calling thread.
  cudaError_t Take(HostWord* word) STRATA_EXCLUDES(mu_);
  void Give(const HostWord& word) STRATA_EXCLUDES(mu_);

 private:
  Mutex mu_;
  std::vector<void*> pages_ STRATA_GUARDED_BY(mu_);
  std::vector<HostWord> free_ STRATA_GUARDED_BY(mu_);
};

}  // namespace strata::internal

#endif  // STRATA_GPU_CUDA_HOST_EVENT_H_
