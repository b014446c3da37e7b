// Built when nvcc was not found (or -DSTRATA_ENABLE_CUDA=OFF): the CUDA
// backend is absent, and saying so is its whole behaviour.
#include "strata/device.h"

namespace strata {

StatusOr<std::unique_ptr<Device>> NewCudaDevice(const DeviceOptions&) {
  return Status::Unavailable("strata was built without CUDA");
}

}  // namespace strata
