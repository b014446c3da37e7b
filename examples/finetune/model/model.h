// A GPT-2 style decoder driven block by block, so that a trainer can fetch a
// block's parameters just before its forward, release them after, and in
// backward fetch them again, recompute the block from its saved input and
// hand over its gradients:
//
//   model->SetBatch(inputs, targets);
//   model->EmbeddingForward(embedding_params);
//   for l in 0..L-1: fetch(l); model->BlockForward(l, params[l]); release(l)
//   model->HeadForwardBackward(head_params, &head_grads, loss_scale);
//   for l in L-1..0: fetch(l); model->BlockBackward(l, params[l], grads[l]);
//                    add grads[l]; release(l)
//   model->EmbeddingBackward(embedding_grads);  // dwte += token rows
//
// Every call only enqueues on the stream given to Create, in that order;
// parameter pointers must stay valid until the work enqueued before the
// next call that is ordered after it (e.g. an event recorded after the
// call) completes; gradient buffers are written by work on that stream.
//
// Note [Precision]: parameters arrive in the working type (bf16 by default,
// fp16 or fp32; the engine's Fetch returns those). Device::GemmAsync takes A
// and B of one type, so the activations that feed GEMMs (LayerNorm outputs,
// the attention output, the GELU output, and the gradients fed back through
// them) are stored in the working type too, while GEMMs accumulate and
// write fp32, and the residual stream, LayerNorm statistics, attention
// probabilities, the logits, the loss and every gradient handed out are
// fp32. That is PyTorch autocast's split (GEMM inputs in 16 bits, reductions
// and the residual in fp32); with fp32 parameters the whole model is fp32,
// which is how the tests check gradients against finite differences.
//
// Note [Workspace]: all device memory the model needs is allocated from the
// Device at Create (Device::Allocate on the model's stream) and counted in
// workspace_bytes(): the block inputs kept for recompute ((L + 1) x B x T x
// C fp32), one block's activations (or L of them without checkpointing),
// the backward scratch, and the head's logits (B x T x V fp32 plus their
// gradient in the working type). Nothing is allocated per step.
//
// Thread-compatible: one thread drives a model.
#ifndef STRATA_EXAMPLES_FINETUNE_MODEL_MODEL_H_
#define STRATA_EXAMPLES_FINETUNE_MODEL_MODEL_H_

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "examples/finetune/model/config.h"
#include "examples/finetune/model/kernels.h"
#include "strata/device.h"
#include "strata/status.h"

namespace finetune {

struct GpuKernels;

struct ModelOptions {
  int batch_size = 4;  // sequences per step, B >= 1
  int seq_len = 64;    // tokens per sequence, 1 <= T <= context_length
  // The working type of parameters and GEMM operands (Note [Precision]).
  strata::ElementType param_type = strata::ElementType::kBFloat16;
  // Keep only each block's input and recompute the block in backward;
  // false keeps every block's activations (more memory, no recompute).
  bool checkpoint_blocks = true;
  // Host-emulated device only: which CPU kernel set runs. Default the
  // widest the CPU has.
  Isa cpu_isa = cpu::BestIsa();
};

// Device pointers in the working type, indexed by BlockTensor / the fields.
struct BlockParams {
  std::array<const void*, kBlockTensorCount> t{};
};
// fp32 device buffers of the parameters' shapes; overwritten.
struct BlockGrads {
  std::array<float*, kBlockTensorCount> t{};
};
struct EmbeddingParams {
  const void* wte = nullptr;  // [V, C]
  const void* wpe = nullptr;  // [T_ctx, C]; rows 0..T-1 are read
};
struct EmbeddingGrads {
  float* wte = nullptr;  // [V, C]: token rows are ADDED to (see the head)
  float* wpe = nullptr;  // [T_ctx, C]: overwritten (rows >= T with 0)
};
struct HeadParams {
  const void* lnf_weight = nullptr;
  const void* lnf_bias = nullptr;
  const void* wte = nullptr;  // the tied LM head
};
struct HeadGrads {
  float* lnf_weight = nullptr;
  float* lnf_bias = nullptr;
  float* wte = nullptr;  // [V, C], overwritten with the LM head's part
};

class GptModel {
 public:
  // kInvalidArgument for a bad config or options (naming the field and its
  // range); kOutOfMemory when the device cannot hold the workspace;
  // kUnavailable for a CUDA device in a build without CUDA kernels.
  // REQUIRES: `device` and `stream` (a stream of `device`) outlive the model.
  static strata::StatusOr<std::unique_ptr<GptModel>> Create(
      strata::Device* device, strata::Stream* stream, const GptConfig& config,
      const ModelOptions& options);
  ~GptModel();
  GptModel(const GptModel&) = delete;
  GptModel& operator=(const GptModel&) = delete;

  // Device bytes of one block's activations (the set BlockForward writes
  // and BlockBackward reads): checkpointing keeps one set, otherwise there
  // is one per block. For a valid config and options.
  static size_t BlockActivationBytes(const GptConfig& config,
                                     const ModelOptions& options);

  const GptConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  int64_t tokens_per_step() const { return n_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // Copies B x T input tokens and their targets (host arrays) to the
  // device. kInvalidArgument for a wrong size or a token outside [0, V).
  strata::Status SetBatch(std::span<const int32_t> inputs,
                          std::span<const int32_t> targets);

  strata::Status EmbeddingForward(const EmbeddingParams& p);
  strata::Status BlockForward(int layer, const BlockParams& p);
  // Final LayerNorm, logits and per-token losses; with `grads`, also their
  // backward: dlogits = (softmax - onehot) * loss_scale / (B T), the head's
  // gradients and the gradient of the last block's output.
  strata::Status HeadForwardBackward(const HeadParams& p,
                                     const HeadGrads* grads, float loss_scale);
  // Recomputes the block from its saved input when checkpointing, then
  // propagates the residual gradient through it and writes its gradients.
  strata::Status BlockBackward(int layer, const BlockParams& p,
                               const BlockGrads& g);
  strata::Status EmbeddingBackward(const EmbeddingGrads& g);

  // Device arrays of the last HeadForwardBackward: losses [B T], logits
  // [B T, V]. Read them after the stream has run the call.
  const float* losses() const { return losses_; }
  const float* logits() const { return logits_; }
  // The mean loss of the last HeadForwardBackward; synchronizes the stream.
  strata::StatusOr<float> MeanLoss();
  // Copies the logits to `out` (B T x V floats); synchronizes the stream.
  strata::Status CopyLogits(std::span<float> out);

 private:
  struct Acts;  // one block's activations
  GptModel(strata::Device* device, strata::Stream* stream,
           const GptConfig& config, const ModelOptions& options);
  strata::Status Allocate();
  strata::StatusOr<void*> Alloc(size_t bytes);
  strata::Status RunBlockForward(int layer, const BlockParams& p, Acts& a,
                                 bool write_output);
  // out[N, OUT] (fp32) += in[N, IN] (working type) x w[IN, OUT].
  strata::Status Linear(float* out, const void* in, const void* w, int in_dim,
                        int out_dim);
  // dw[IN, OUT] = in^T dout; din[N, IN] = dout w^T (both fp32).
  strata::Status LinearBackward(const void* dout, const void* in, const void* w,
                                float* dw, float* din, int in_dim, int out_dim);
  // `src` (fp32, n elements) as a GEMM operand in the working type: itself
  // for fp32, else converted into the scratch dwork_.
  strata::StatusOr<const void*> AsWorking(const float* src, size_t n);
  // C (m x n, fp32) = op(A) op(B) (+ C when accumulating), in BLAS's
  // column-major convention; A and B in the working type.
  strata::Status Gemm(strata::GemmOp op_a, strata::GemmOp op_b, int64_t m,
                      int64_t n, int64_t k, const void* a, int64_t lda,
                      const void* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate);
  template <class CpuFn, class GpuFn, class... A>
  strata::Status Run(const char* name, CpuFn cpu_fn, GpuFn gpu_fn, A... args);

  strata::Device* const device_;
  strata::Stream* const stream_;
  const GptConfig config_;
  const ModelOptions options_;
  const DType wt_;
  const int64_t n_;  // B * T
  const CpuKernels* cpu_ = nullptr;
  const GpuKernels* gpu_ = nullptr;

  std::vector<strata::DeviceMemory> memory_;
  size_t workspace_bytes_ = 0;
  int32_t* tokens_ = nullptr;
  int32_t* targets_ = nullptr;
  std::vector<float*> residual_;             // L + 1 block inputs [N, C]
  std::vector<std::unique_ptr<Acts>> acts_;  // 1, or L without checkpoints
  float* dres_ = nullptr;                    // [N, C] residual gradient
  void* dwork_ = nullptr;                    // [N, 4C] working type
  float* dbig_ = nullptr;                    // [N, 4C]
  float* dsmall_ = nullptr;                  // [N, C]
  void* lnf_ = nullptr;                      // [N, C] working type
  float* lnf_mean_ = nullptr;
  float* lnf_rstd_ = nullptr;
  float* logits_ = nullptr;  // [N, V]
  void* dlogits_ = nullptr;  // [N, V] working type
  float* losses_ = nullptr;  // [N]
};

}  // namespace finetune

#endif  // STRATA_EXAMPLES_FINETUNE_MODEL_MODEL_H_
