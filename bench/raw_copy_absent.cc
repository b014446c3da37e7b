// Built without CUDA: there is no plain cudaMemcpyAsync to compare with.
#include "bench/raw_copy.h"

namespace strata::bench {

StatusOr<double> TimeRawCudaCopies(int, std::span<const RawCopy>, int) {
  return Status::Unavailable("strata-bench was built without CUDA");
}

}  // namespace strata::bench
