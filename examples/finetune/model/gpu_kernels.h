// The CUDA kernel set as a table with the CPU set's arguments, each entry
// taking the strata::Stream to enqueue on (its cudaStream_t comes from
// strata/device_cuda.h) and returning a Status that names the CUDA error.
#ifndef STRATA_EXAMPLES_FINETUNE_MODEL_GPU_KERNELS_H_
#define STRATA_EXAMPLES_FINETUNE_MODEL_GPU_KERNELS_H_

#include "examples/finetune/model/kernels.h"
#include "strata/device.h"

namespace finetune {

template <class F>
struct StreamFnOf;
template <class... A>
struct StreamFnOf<void (*)(A...)> {
  using type = strata::Status (*)(strata::Stream&, A...);
};
template <class F>
using StreamFn = typename StreamFnOf<F>::type;

struct GpuKernels {
  StreamFn<decltype(CpuKernels::encoder_forward)> encoder_forward;
  StreamFn<decltype(CpuKernels::encoder_backward)> encoder_backward;
  StreamFn<decltype(CpuKernels::layernorm_forward)> layernorm_forward;
  StreamFn<decltype(CpuKernels::layernorm_backward)> layernorm_backward;
  StreamFn<decltype(CpuKernels::add_bias)> add_bias;
  StreamFn<decltype(CpuKernels::bias_grad)> bias_grad;
  StreamFn<decltype(CpuKernels::gelu_forward)> gelu_forward;
  StreamFn<decltype(CpuKernels::gelu_backward)> gelu_backward;
  StreamFn<decltype(CpuKernels::attention_forward)> attention_forward;
  StreamFn<decltype(CpuKernels::attention_backward)> attention_backward;
  StreamFn<decltype(CpuKernels::crossentropy)> crossentropy;
};

// The CUDA set; null when this build has no CUDA.
const GpuKernels* CudaKernelTable();

}  // namespace finetune

#endif  // STRATA_EXAMPLES_FINETUNE_MODEL_GPU_KERNELS_H_
