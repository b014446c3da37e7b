// The shape of a GPT-2 style decoder, its parameters as Hugging Face
// publishes GPT-2 (names, shapes, Conv1D layout), their initialization, and
// the counts a trainer reports (parameters, FLOPs per token).
#ifndef STRATA_EXAMPLES_FINETUNE_MODEL_CONFIG_H_
#define STRATA_EXAMPLES_FINETUNE_MODEL_CONFIG_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"

namespace finetune {

struct GptConfig {
  int64_t vocab_size = 50257;     // tokens
  int64_t context_length = 1024;  // positions (rows of wpe)
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;  // channels C; a multiple of n_head
};

// kInvalidArgument naming the field and its accepted range when a dimension
// is not positive, n_embd is not a multiple of n_head, or a tensor would
// exceed 2^31 - 1 elements along a kernel's index range.
strata::Status ValidateConfig(const GptConfig& config);

// Named shapes: "gpt2-124M", "gpt2-355M", "gpt2-774M", "gpt2-1.5B" (GPT-2's
// published checkpoints), "gpt3-6.7B" and "gpt3-13B" (the GPT-3 paper's
// table 2.1, with d_model 5120 for 13B: the paper's 5140 is not divisible by
// its 40 heads), "tiny" (V=64, T=16, C=32, 2 heads, 2 layers, for tests).
// kNotFound lists the accepted names.
strata::StatusOr<GptConfig> PresetConfig(std::string_view name);
std::vector<std::string> PresetNames();

// The tensors of one block, in Hugging Face's order within h.N.
enum BlockTensor : int {
  kLn1Weight,
  kLn1Bias,
  kQkvWeight,       // attn.c_attn.weight [C, 3C]
  kQkvBias,         // [3C]
  kAttnProjWeight,  // attn.c_proj.weight [C, C]
  kAttnProjBias,
  kLn2Weight,
  kLn2Bias,
  kFcWeight,      // mlp.c_fc.weight [C, 4C]
  kFcBias,        // [4C]
  kFcProjWeight,  // mlp.c_proj.weight [4C, C]
  kFcProjBias,
  kBlockTensorCount
};

// The tensors outside the blocks.
enum GlobalTensor : int {
  kWte,
  kWpe,
  kLnfWeight,
  kLnfBias,
  kGlobalTensorCount
};

struct ParamSpec {
  std::string name;            // e.g. "h.3.attn.c_attn.weight"
  std::vector<int64_t> shape;  // row-major; Conv1D weights are [in, out]
  int64_t numel = 0;
  int layer = -1;  // block index, or -1 for wte, wpe, ln_f.*
  int slot = 0;    // BlockTensor when layer >= 0, else GlobalTensor
};

// Every parameter, in the order of Hugging Face's GPT-2 state dict: wte,
// wpe, h.0.* ... h.{L-1}.*, ln_f.weight, ln_f.bias. The LM head is tied to
// wte and has no tensor of its own.
std::vector<ParamSpec> ListParameters(const GptConfig& config);

int64_t ParameterCount(const GptConfig& config);

// Model FLOPs of one training token (forward and backward, no recompute):
// 6 * (parameters except wpe, a lookup) + 12 * n_layer * seq_len * n_embd
// for the attention scores and their use (PaLM's convention; the causal
// mask's saving is not counted). Activation recompute adds work that this
// deliberately leaves out, so TFLOPS from it are comparable to MFU figures.
double TrainingFlopsPerToken(const GptConfig& config, int64_t seq_len);

// GPT-2's initialization of one tensor, deterministic in (seed, name):
// weights and embeddings normal(0, 0.02), the residual projections
// (attn.c_proj.weight, mlp.c_proj.weight) normal(0, 0.02 / sqrt(2 * n_layer)),
// LayerNorm weights 1, biases 0. REQUIRES: out.size() == spec.numel.
void InitParameter(const ParamSpec& spec, const GptConfig& config,
                   uint64_t seed, std::span<float> out);

}  // namespace finetune

#endif  // STRATA_EXAMPLES_FINETUNE_MODEL_CONFIG_H_
