#include "examples/finetune/model/config.h"

#include <cmath>
#include <random>
#include <string>

namespace finetune {
namespace {

struct Preset {
  const char* name;
  GptConfig config;
};

constexpr Preset kPresets[] = {
    {"gpt2-124M", {50257, 1024, 12, 12, 768}},
    {"gpt2-355M", {50257, 1024, 24, 16, 1024}},
    {"gpt2-774M", {50257, 1024, 36, 20, 1280}},
    {"gpt2-1.5B", {50257, 1024, 48, 25, 1600}},
    {"gpt3-6.7B", {50257, 2048, 32, 32, 4096}},
    {"gpt3-13B", {50257, 2048, 40, 40, 5120}},
    {"tiny", {64, 16, 2, 2, 32}},
};

constexpr const char* kBlockNames[kBlockTensorCount] = {
    "ln_1.weight",      "ln_1.bias",          "attn.c_attn.weight",
    "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight",      "ln_2.bias",          "mlp.c_fc.weight",
    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};

// FNV-1a, so that each tensor's stream depends on its name only.
uint64_t HashName(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

strata::Status ValidateConfig(const GptConfig& c) {
  auto bad = [](const std::string& what) {
    return strata::Status::InvalidArgument("model config: " + what);
  };
  constexpr int64_t kMax = (int64_t{1} << 31) - 1;
  if (c.vocab_size < 1 || c.vocab_size > kMax) {
    return bad("vocab_size " + std::to_string(c.vocab_size) +
               " is outside [1, 2^31-1]");
  }
  if (c.context_length < 1 || c.context_length > (1 << 20)) {
    return bad("context_length " + std::to_string(c.context_length) +
               " is outside [1, 2^20]");
  }
  if (c.n_layer < 1 || c.n_layer > 10000) {
    return bad("n_layer " + std::to_string(c.n_layer) +
               " is outside [1, 10000]");
  }
  if (c.n_head < 1 || c.n_embd < 1 || c.n_embd > (1 << 20) ||
      c.n_embd % c.n_head != 0) {
    return bad("n_embd " + std::to_string(c.n_embd) + " must be in [1, 2^20]" +
               " and a multiple of n_head " + std::to_string(c.n_head));
  }
  return strata::Status::Ok();
}

strata::StatusOr<GptConfig> PresetConfig(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) return p.config;
  }
  std::string names;
  for (const Preset& p : kPresets) {
    names += names.empty() ? "" : ", ";
    names += p.name;
  }
  return strata::Status::NotFound("unknown model preset '" + std::string(name) +
                                  "'; accepted: " + names);
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name);
  return out;
}

std::vector<ParamSpec> ListParameters(const GptConfig& c) {
  const int64_t C = c.n_embd;
  std::vector<ParamSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, int layer,
                 int slot) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out.push_back({std::move(name), std::move(shape), n, layer, slot});
  };
  add("wte.weight", {c.vocab_size, C}, -1, kWte);
  add("wpe.weight", {c.context_length, C}, -1, kWpe);
  const std::vector<int64_t> shapes[kBlockTensorCount] = {
      {C}, {C}, {C, 3 * C}, {3 * C}, {C, C},     {C},
      {C}, {C}, {C, 4 * C}, {4 * C}, {4 * C, C}, {C}};
  for (int l = 0; l < c.n_layer; ++l) {
    for (int s = 0; s < kBlockTensorCount; ++s) {
      add("h." + std::to_string(l) + "." + kBlockNames[s], shapes[s], l, s);
    }
  }
  add("ln_f.weight", {C}, -1, kLnfWeight);
  add("ln_f.bias", {C}, -1, kLnfBias);
  return out;
}

int64_t ParameterCount(const GptConfig& c) {
  const int64_t C = c.n_embd;
  return c.vocab_size * C + c.context_length * C +
         c.n_layer * (12 * C * C + 13 * C) + 2 * C;
}

double TrainingFlopsPerToken(const GptConfig& c, int64_t seq_len) {
  const double n =
      static_cast<double>(ParameterCount(c) - c.context_length * c.n_embd);
  return 6.0 * n + 12.0 * static_cast<double>(c.n_layer) *
                       static_cast<double>(seq_len) *
                       static_cast<double>(c.n_embd);
}

void InitParameter(const ParamSpec& spec, const GptConfig& c, uint64_t seed,
                   std::span<float> out) {
  const std::string_view name = spec.name;
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() &&
           name.substr(name.size() - suffix.size()) == suffix;
  };
  const bool is_ln = name.find("ln_") != std::string_view::npos;
  if (ends_with(".bias")) {
    std::fill(out.begin(), out.end(), 0.0f);
    return;
  }
  if (is_ln) {
    std::fill(out.begin(), out.end(), 1.0f);
    return;
  }
  double std_dev = 0.02;
  if (ends_with("c_proj.weight")) {
    std_dev /= std::sqrt(2.0 * static_cast<double>(c.n_layer));
  }
  std::mt19937_64 rng(seed ^ HashName(name));
  std::normal_distribution<float> normal(0.0f, static_cast<float>(std_dev));
  for (float& v : out) v = normal(rng);
}

}  // namespace finetune
