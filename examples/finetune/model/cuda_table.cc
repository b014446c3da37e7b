// The CUDA kernels behind GpuKernels: each entry finds the stream's
// cudaStream_t and turns the launch error into a Status.
#include <string>

#include "examples/finetune/model/cuda_kernels.h"
#include "examples/finetune/model/gpu_kernels.h"
#include "strata/device_cuda.h"

namespace finetune {
namespace {

template <auto Fn>
struct Wrap;
template <class... A, cudaError_t (*Fn)(cudaStream_t, A...)>
struct Wrap<Fn> {
  static strata::Status Call(strata::Stream& stream, A... args) {
    strata::StatusOr<cudaStream_t> s = strata::CudaStreamOf(stream);
    if (!s.ok()) return s.status();
    const cudaError_t e = Fn(*s, args...);
    if (e == cudaSuccess) return strata::Status::Ok();
    return strata::Status(strata::StatusCode::kInternal,
                          std::string("CUDA kernel launch: ") +
                              cudaGetErrorName(e) + ": " +
                              cudaGetErrorString(e));
  }
};

constexpr GpuKernels kTable = {
    &Wrap<&cuda::EncoderForward>::Call,   &Wrap<&cuda::EncoderBackward>::Call,
    &Wrap<&cuda::LayerNormForward>::Call, &Wrap<&cuda::LayerNormBackward>::Call,
    &Wrap<&cuda::AddBias>::Call,          &Wrap<&cuda::BiasGrad>::Call,
    &Wrap<&cuda::GeluForward>::Call,      &Wrap<&cuda::GeluBackward>::Call,
    &Wrap<&cuda::AttentionForward>::Call, &Wrap<&cuda::AttentionBackward>::Call,
    &Wrap<&cuda::CrossEntropy>::Call,
};

}  // namespace

const GpuKernels* CudaKernelTable() { return &kTable; }

}  // namespace finetune
