// A plain cudaMemcpyAsync loop, with nothing of strata's in the way: the
// baseline that `strata-bench copy` puts beside the Device path, over the
// same buffers. Internal to strata (bench only).
#ifndef STRATA_GPU_RAW_COPY_H_
#define STRATA_GPU_RAW_COPY_H_

#include <cstddef>
#include <span>

#include "strata/device.h"

namespace strata::internal {

struct RawCopy {
  void* dst;
  const void* src;
  size_t bytes;
  CopyKind kind;
};

// Runs every copy `iterations` times, each copy on its own fresh stream, all
// streams at once, and returns the wall time in seconds from the first
// enqueue to the end of the last copy. `device` must be a CUDA device from
// NewCudaDevice (its current GPU is used); kUnavailable otherwise.
StatusOr<double> TimeRawCudaCopies(Device& device,
                                   std::span<const RawCopy> copies,
                                   int iterations);

}  // namespace strata::internal

#endif  // STRATA_GPU_RAW_COPY_H_
