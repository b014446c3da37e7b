// How every backend runs a function given to Device::LaunchHostFunc: on the
// backend's callback thread, where an exception must not escape (on CUDA it
// would unwind into the driver; on the host-emulated device it would end the
// stream's executor). Internal.
#ifndef STRATA_GPU_HOST_FUNC_H_
#define STRATA_GPU_HOST_FUNC_H_

#include <exception>
#include "strata/device.h"
#include "util/log.h"

namespace strata::internal {

// Runs `fn`; an exception it throws is logged and dropped.
inline void RunHostFunction(HostFunction& fn) noexcept {
  try {
    fn();
  } catch (const std::exception& e) {
    STRATA_LOG_ERROR("a host function on a stream threw: {}", e.what());
  } catch (...) {
    STRATA_LOG_ERROR("a host function on a stream threw");
  }
}

}  // namespace strata::internal

#endif  // STRATA_GPU_HOST_FUNC_H_
