// A plain cudaMemcpyAsync loop, with nothing of strata's in the way: the
// baseline that `strata-bench copy` puts beside the Device path, over the
// same buffers. Built against the CUDA runtime when CUDA is enabled
// (raw_copy_cuda.cc), else it answers kUnavailable (raw_copy_absent.cc).
#ifndef STRATA_BENCH_RAW_COPY_H_
#define STRATA_BENCH_RAW_COPY_H_

#include <cstddef>
#include <span>

#include "strata/device.h"
#include "strata/status.h"

namespace strata::bench {

struct RawCopy {
  void* dst;
  const void* src;
  size_t bytes;
  CopyKind kind;
};

// Runs every copy `iterations` times on GPU `cuda_ordinal`, each copy on its
// own fresh stream, all streams at once, and returns the wall time in
// seconds from the first enqueue to the end of the last copy. The calling
// thread's current device is restored before return.
StatusOr<double> TimeRawCudaCopies(int cuda_ordinal,
                                   std::span<const RawCopy> copies,
                                   int iterations);

}  // namespace strata::bench

#endif  // STRATA_BENCH_RAW_COPY_H_
