// The CUDA side of kernels.h: the same kernels with the same arguments, on
// device memory, enqueued on `stream`; each returns the launch error.
// Correct first: attention materializes [B, NH, T, T] and its backward
// accumulates with atomics (a fused flash-style kernel is future work).
#ifndef STRATA_EXAMPLES_FINETUNE_MODEL_CUDA_KERNELS_H_
#define STRATA_EXAMPLES_FINETUNE_MODEL_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include "examples/finetune/model/kernels.h"

namespace finetune::cuda {

cudaError_t EncoderForward(cudaStream_t s, float* out, const int32_t* tokens,
                           const void* wte, const void* wpe, DType wt, int B,
                           int T, int C);
cudaError_t EncoderBackward(cudaStream_t s, float* dwte, float* dwpe,
                            const float* dout, const int32_t* tokens, int B,
                            int T, int C);
cudaError_t LayerNormForward(cudaStream_t s, void* out, float* mean,
                             float* rstd, const float* inp, const void* w,
                             const void* b, DType wt, int N, int C);
cudaError_t LayerNormBackward(cudaStream_t s, float* dinp, float* dw, float* db,
                              const float* dout, const float* inp,
                              const void* w, DType wt, const float* mean,
                              const float* rstd, int N, int C);
cudaError_t AddBias(cudaStream_t s, float* out, const float* res,
                    const void* bias, DType wt, int N, int OC);
cudaError_t BiasGrad(cudaStream_t s, float* db, const float* dout, int N,
                     int OC);
cudaError_t GeluForward(cudaStream_t s, void* out, const float* inp, DType wt,
                        size_t n);
cudaError_t GeluBackward(cudaStream_t s, float* dinout, const float* inp,
                         size_t n);
cudaError_t AttentionForward(cudaStream_t s, void* out, float* att,
                             const float* qkv, DType wt, int B, int T, int C,
                             int NH);
cudaError_t AttentionBackward(cudaStream_t s, float* dqkv, const float* dout,
                              const float* qkv, const float* att, int B, int T,
                              int C, int NH);
cudaError_t CrossEntropy(cudaStream_t s, float* losses, void* dlogits,
                         const float* logits, const int32_t* targets, DType wt,
                         int N, int V, float dscale);

}  // namespace finetune::cuda

#endif  // STRATA_EXAMPLES_FINETUNE_MODEL_CUDA_KERNELS_H_
