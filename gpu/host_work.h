// Device::LaunchHostWork composed from the public calls, for backends whose
// host functions must return quickly (CUDA): per launch, a fresh HostEvent;
// a host function that only hands `fn` to a worker thread; and a wait on the
// event, which the worker signals once `fn` has returned. No callback thread
// ever blocks, and the stream holds its place in order meanwhile.
//
// Backend-independent (it speaks only the Device interface), so the tests run
// it on the host-emulated device too. Internal to gpu/; docs/gpu.md,
// "Stream-ordered host work".
#ifndef STRATA_GPU_HOST_WORK_H_
#define STRATA_GPU_HOST_WORK_H_

#include <memory>
#include <thread>

#include "strata/device.h"
#include "util/mutex.h"

namespace strata::internal {

// Thread-safe. The worker thread starts with the first launch.
class HostWorkRunner {
 public:
  // `device` issues the events, host functions and waits; not owned, and
  // must outlive this runner.
  explicit HostWorkRunner(Device* device);
  // Runs the work already handed to the worker, then joins it. Work whose
  // host function fires later is dropped and its event abandoned, so its
  // stream is released (REQUIRES, as for every device object: streams have
  // completed their work before their device goes).
  ~HostWorkRunner();
  HostWorkRunner(const HostWorkRunner&) = delete;
  HostWorkRunner& operator=(const HostWorkRunner&) = delete;

  // Device::LaunchHostWork. Errors from the device come back as they are
  // (kNotSupported when it has no host events). If the wait cannot be
  // enqueued once the host function was, that error is returned and `fn`
  // still runs, unordered after the work before it.
  Status Launch(Stream& stream, HostFunction fn) STRATA_EXCLUDES(mu_);

 private:
  class Queue;

  Device* const device_;
  const std::shared_ptr<Queue> queue_;
  Mutex mu_;
  std::thread worker_ STRATA_GUARDED_BY(mu_);  // joinable once started
};

}  // namespace strata::internal

#endif  // STRATA_GPU_HOST_WORK_H_
