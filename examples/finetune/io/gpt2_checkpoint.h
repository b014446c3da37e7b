// GPT-2 checkpoints in the layout in which Hugging Face publishes them
// (model.safetensors of gpt2, gpt2-medium, gpt2-large, gpt2-xl): which
// tensors a model of given dimensions expects, which file tensor holds each,
// and what the dimensions of a file are.
//
// Parameter names and shapes (C = n_embd, V = vocab, T = n_ctx; the linear
// layers are Conv1D, stored [in, out] row-major, so y = x W + b):
//   wte.weight [V, C]   wpe.weight [T, C]
//   h.N.ln_1.weight [C]           h.N.ln_1.bias [C]
//   h.N.attn.c_attn.weight [C, 3C] h.N.attn.c_attn.bias [3C]
//   h.N.attn.c_proj.weight [C, C]  h.N.attn.c_proj.bias [C]
//   h.N.ln_2.weight [C]           h.N.ln_2.bias [C]
//   h.N.mlp.c_fc.weight [C, 4C]   h.N.mlp.c_fc.bias [4C]
//   h.N.mlp.c_proj.weight [4C, C] h.N.mlp.c_proj.bias [C]
//   ln_f.weight [C]  ln_f.bias [C]
// The LM head is tied to wte.weight.
//
// Files differ in small ways, all accepted: names with or without the
// "transformer." prefix (GPT2LMHeadModel saves with it, GPT2Model without);
// the causal-mask buffers h.N.attn.bias and h.N.attn.masked_bias, which older
// files carry, are ignored; lm_head.weight is ignored when it equals
// wte.weight (it is the same tensor, saved twice) and rejected otherwise.
#ifndef STRATA_EXAMPLES_FINETUNE_IO_GPT2_CHECKPOINT_H_
#define STRATA_EXAMPLES_FINETUNE_IO_GPT2_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "examples/finetune/io/safetensors.h"
#include "strata/status.h"

namespace strata::finetune {

// The dimensions that a checkpoint's tensors determine. The head count is not
// among them (it changes no shape): GPT-2's four sizes all use heads of 64,
// n_head = n_embd / 64.
struct Gpt2Dims {
  int64_t n_layer = 0;
  int64_t n_embd = 0;
  int64_t vocab = 0;
  int64_t n_ctx = 0;

  bool operator==(const Gpt2Dims&) const = default;
};

// "n_layer=12 n_embd=768 vocab=50257 n_ctx=1024".
std::string ToString(const Gpt2Dims& dims);

// One parameter the model expects.
struct Gpt2ParamSpec {
  std::string name;  // as listed above, without a prefix
  std::vector<int64_t> shape;
  int64_t numel() const;
};

// Every parameter of a model of `dims`, in model order: wte, wpe, the blocks
// in order (each in the order listed above), ln_f.
std::vector<Gpt2ParamSpec> Gpt2ParameterSpecs(const Gpt2Dims& dims);

// Where each parameter lives in a file.
struct Gpt2CheckpointMap {
  Gpt2Dims dims;
  // Parameter name (unprefixed) -> the file's tensor name.
  std::map<std::string, std::string, std::less<>> tensor_of;
  // File tensors that were recognized and skipped (mask buffers, a tied
  // lm_head.weight), for a log line.
  std::vector<std::string> ignored;
};

// Matches the tensors of `file` against a model of `dims`. kInvalidArgument
// when they do not fit, with every missing, unexpected and mis-shaped tensor
// named (the first few of each kind and the counts), or when lm_head.weight
// differs from wte.weight; read errors as SafetensorsFile reports them.
StatusOr<Gpt2CheckpointMap> MapGpt2Checkpoint(const SafetensorsFile& file,
                                              const Gpt2Dims& dims);

// The largest dimensions a checkpoint may give: every GPT-style model fits
// well inside them, and the shapes derived from them (4 * n_embd, the
// products of two dimensions) stay far from int64 overflow.
inline constexpr int64_t kMaxGpt2Dim = int64_t{1}
                                       << 24;  // n_embd, vocab, n_ctx
inline constexpr int64_t kMaxGpt2Layers = 4096;

// The dimensions of the model in `file`: vocab and n_embd from wte.weight,
// n_ctx from wpe.weight, n_layer from the h.N blocks (N = 0..n_layer-1). The
// tensors are not checked beyond that; MapGpt2Checkpoint does it.
// kInvalidArgument naming the file when wte/wpe are missing or not 2-D, when
// n_embd, vocab or n_ctx is outside 1..kMaxGpt2Dim, or a block index is at
// or above kMaxGpt2Layers.
StatusOr<Gpt2Dims> InferGpt2Dims(const SafetensorsFile& file);

// Reads parameter `param` (unprefixed name) as fp32 into `out` (its numel
// elements), converting from the file's dtype.
Status ReadGpt2Parameter(const SafetensorsFile& file,
                         const Gpt2CheckpointMap& map, std::string_view param,
                         std::span<float> out);

}  // namespace strata::finetune

#endif  // STRATA_EXAMPLES_FINETUNE_IO_GPT2_CHECKPOINT_H_
