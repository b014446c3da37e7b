// Built when nvcc was not found (or -DSTRATA_ENABLE_CUDA=OFF): the CUDA
// backend is absent, and saying so is its whole behaviour.
#include "gpu/raw_copy.h"
#include "strata/device.h"

namespace strata {

StatusOr<std::unique_ptr<Device>> NewCudaDevice(const DeviceOptions&) {
  return Status::Unavailable("strata was built without CUDA");
}

namespace internal {

StatusOr<double> TimeRawCudaCopies(Device&, std::span<const RawCopy>, int) {
  return Status::Unavailable("strata was built without CUDA");
}

}  // namespace internal
}  // namespace strata
