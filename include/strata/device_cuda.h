// Typed CUDA helpers for strata/device.h, for code that already uses the CUDA
// runtime (a trainer with PyTorch's streams and tensors). Optional: it
// includes <cuda_runtime_api.h>, so only a build with the CUDA headers can
// include it; strata/device.h and the other headers stay CUDA-free.
//
//   cudaStream_t torch_stream = ...;  // at::cuda::getCurrentCUDAStream()
//   auto s = strata::WrapCudaStream(*device, torch_stream);
//   auto mem = device->RegisterExternalMemory(tensor.data_ptr(), nbytes);
//   device->CopyAsync(**s, mem->data(), pinned.data(), nbytes,
//                     strata::CopyKind::kHostToDevice);
//
// Each helper checks that the stream, event or device is CUDA's and answers
// kInvalidArgument otherwise. Thread-safe as the calls they make.
#ifndef STRATA_DEVICE_CUDA_H_
#define STRATA_DEVICE_CUDA_H_

#include <cuda_runtime_api.h>

#include <memory>

#include "strata/device.h"
#include "strata/status.h"

namespace strata {

// A non-owning Stream on `stream` (Device::WrapNativeStream): destroying it
// neither synchronizes nor destroys `stream`. Null or cudaStreamLegacy is
// the legacy default stream; cudaStreamPerThread is refused.
// REQUIRES: `stream` outlives the wrapper.
inline StatusOr<std::unique_ptr<Stream>> WrapCudaStream(
    Device& device, cudaStream_t stream,
    StreamKind kind = StreamKind::kCompute) {
  if (device.kind() != DeviceKind::kCuda) {
    return Status::InvalidArgument("WrapCudaStream: " + device.name() +
                                   " is not a CUDA device");
  }
  return device.WrapNativeStream(static_cast<void*>(stream), kind);
}

// The cudaStream_t that `stream` enqueues on (null for the legacy default
// stream). Valid while the owning Stream lives.
inline StatusOr<cudaStream_t> CudaStreamOf(const Stream& stream) {
  if (stream.device_kind() != DeviceKind::kCuda) {
    return Status::InvalidArgument(
        "CudaStreamOf: the stream is not a CUDA device's");
  }
  return static_cast<cudaStream_t>(stream.native_handle());
}

// The cudaEvent_t behind `event`; valid while `event` lives. Make CUDA
// streams wait on it (cudaStreamWaitEvent) to order them after strata work.
inline StatusOr<cudaEvent_t> CudaEventOf(const Event& event) {
  if (event.device_kind() != DeviceKind::kCuda) {
    return Status::InvalidArgument(
        "CudaEventOf: the event is not a CUDA device's");
  }
  return static_cast<cudaEvent_t>(event.native_handle());
}

}  // namespace strata

#endif  // STRATA_DEVICE_CUDA_H_
