// The model's non-GEMM kernels, one set per backend with the same arguments:
// finetune::cpu (host memory, multi-threaded on oneTBB, vectorized per ISA)
// and finetune::cuda (device memory, on a cudaStream_t; cuda_kernels.h).
// C++17 and free of strata headers, so nvcc compiles the CUDA side.
//
// Shapes: N = B * T rows; C channels; NH heads of C / NH; V vocabulary.
// Tensors are row-major. "W" pointers hold the working type `wt` (fp32,
// bf16 or fp16): parameters, and the activations that feed GEMMs; every
// other tensor is fp32. Note [Precision] in model.h says why.
#ifndef STRATA_EXAMPLES_FINETUNE_MODEL_KERNELS_H_
#define STRATA_EXAMPLES_FINETUNE_MODEL_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace finetune {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// The CPU kernels' instruction sets. kScalar runs anywhere.
enum class Isa : int { kScalar = 0, kAvx2 = 1 };

// The CPU kernel set: one table per ISA with the same semantics (they agree
// to rounding). Each call runs on the calling thread and oneTBB workers
// (inside Device::LaunchHostWork, the device's compute arena).
struct CpuKernels {
  // out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. REQUIRES: 0 <= token < V.
  void (*encoder_forward)(float* out, const int32_t* tokens, const void* wte,
                          const void* wpe, DType wt, int B, int T, int C);
  // dwte[tokens[b,t],:] += dout[b,t,:]; dwpe[t,:] = sum_b dout[b,t,:].
  void (*encoder_backward)(float* dwte, float* dwpe, const float* dout,
                           const int32_t* tokens, int B, int T, int C);
  // out = (inp - mean) * rstd * w + b per row, eps 1e-5; saves mean, rstd.
  void (*layernorm_forward)(void* out, float* mean, float* rstd,
                            const float* inp, const void* w, const void* b,
                            DType wt, int N, int C);
  // dinp += d/dinp; dw = sum_rows dout * xhat; db = sum_rows dout.
  void (*layernorm_backward)(float* dinp, float* dw, float* db,
                             const float* dout, const float* inp, const void* w,
                             DType wt, const float* mean, const float* rstd,
                             int N, int C);
  // out[n,:] = (res ? res[n,:] : 0) + bias[:]. `res` may equal `out`.
  void (*add_bias)(float* out, const float* res, const void* bias, DType wt,
                   int N, int OC);
  // db[:] = sum_n dout[n,:].
  void (*bias_grad)(float* db, const float* dout, int N, int OC);
  // out = gelu(inp), GPT-2's tanh approximation; out holds `wt`.
  void (*gelu_forward)(void* out, const float* inp, DType wt, size_t n);
  // dinout = dinout * gelu'(inp), in place.
  void (*gelu_backward)(float* dinout, const float* inp, size_t n);
  // qkv [N, 3C] (q, k, v; heads of C/NH channels each) -> causal softmax
  // attention: att [B, NH, T, T] the probabilities (0 above the diagonal),
  // out [N, C] in `wt`.
  void (*attention_forward)(void* out, float* att, const float* qkv, DType wt,
                            int B, int T, int C, int NH);
  // dqkv = d/dqkv (overwritten), from dout [N, C], qkv and att.
  void (*attention_backward)(float* dqkv, const float* dout, const float* qkv,
                             const float* att, int B, int T, int C, int NH);
  // losses[n] = -log softmax(logits[n])[targets[n]]; when dlogits is not
  // null, dlogits[n,:] = (softmax(logits[n]) - onehot) * dscale in `wt`.
  // REQUIRES: 0 <= target < V.
  void (*crossentropy)(float* losses, void* dlogits, const float* logits,
                       const int32_t* targets, DType wt, int N, int V,
                       float dscale);
};

namespace cpu {
// The set for `isa`. REQUIRES: IsaSupported(isa).
const CpuKernels& Kernels(Isa isa);
bool IsaSupported(Isa isa);
// The widest ISA this CPU runs.
Isa BestIsa();
}  // namespace cpu

}  // namespace finetune

#endif  // STRATA_EXAMPLES_FINETUNE_MODEL_KERNELS_H_
