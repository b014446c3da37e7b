// A tiny GPT-2 on a strata::Device for the tests: parameters and gradients
// in device buffers per tensor (the layout a trainer gets from the engine),
// one full forward + backward per call, values in and out as fp32 vectors.
#ifndef STRATA_TESTS_FINETUNE_HARNESS_H_
#define STRATA_TESTS_FINETUNE_HARNESS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "examples/finetune/model/config.h"
#include "examples/finetune/model/model.h"
#include "strata/device.h"

namespace finetune::testing {

#define FT_ASSERT_OK(expr)                                        \
  do {                                                            \
    const ::strata::Status ft_s_ = (expr);                        \
    ASSERT_TRUE(ft_s_.ok()) << #expr << ": " << ft_s_.ToString(); \
  } while (0)

// Values that exercise every path more than GPT-2's init (whose tiny
// gradients drown in fp32 rounding under finite differences): weights
// normal(0, 0.2), LayerNorm weights 1 + normal(0, 0.2), biases normal(0, 0.1).
inline std::map<std::string, std::vector<float>> TestWeights(
    const GptConfig& config, uint64_t seed) {
  std::map<std::string, std::vector<float>> out;
  std::mt19937_64 rng(seed);
  for (const ParamSpec& s : ListParameters(config)) {
    std::vector<float> v(s.numel);
    const bool bias = s.name.ends_with(".bias");
    const bool ln = s.name.find("ln_") != std::string::npos;
    std::normal_distribution<float> d(0.0f, bias ? 0.1f : 0.2f);
    for (float& x : v) x = (ln && !bias ? 1.0f : 0.0f) + d(rng);
    out[s.name] = std::move(v);
  }
  return out;
}

inline std::vector<int32_t> TestTokens(size_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

struct StepResult {
  float loss = 0.0f;
  std::vector<float> logits;
  std::map<std::string, std::vector<float>> grads;
};

class Harness {
 public:
  // Builds the model and uploads `weights` (fp32, converted on the device to
  // options.param_type).
  static strata::StatusOr<std::unique_ptr<Harness>> Create(
      strata::Device* device, const GptConfig& config,
      const ModelOptions& options,
      const std::map<std::string, std::vector<float>>& weights) {
    std::unique_ptr<Harness> h(new Harness(device, config));
    STRATA_ASSIGN_OR_RETURN(h->stream_,
                            device->NewStream(strata::StreamOptions{}));
    STRATA_ASSIGN_OR_RETURN(
        h->model_, GptModel::Create(device, h->stream_.get(), config, options));
    h->type_ = options.param_type;
    const size_t w = strata::ElementSize(options.param_type);
    for (const ParamSpec& s : h->specs_) {
      STRATA_ASSIGN_OR_RETURN(h->params_[s.name],
                              device->Allocate(s.numel * w, *h->stream_));
      STRATA_ASSIGN_OR_RETURN(
          h->grads_[s.name],
          device->Allocate(s.numel * sizeof(float), *h->stream_));
      STRATA_RETURN_IF_ERROR(h->Upload(s.name, weights.at(s.name)));
    }
    return h;
  }

  // Writes fp32 `values` into parameter `name` in the working type.
  strata::Status Upload(const std::string& name,
                        const std::vector<float>& values) {
    STRATA_ASSIGN_OR_RETURN(
        strata::DeviceMemory tmp,
        device_->Allocate(values.size() * sizeof(float), *stream_));
    STRATA_RETURN_IF_ERROR(device_->CopyAsync(
        *stream_, tmp.data(), values.data(), values.size() * sizeof(float),
        strata::CopyKind::kHostToDevice));
    strata::ConvertArgs c;
    c.src = tmp.data();
    c.src_type = strata::ElementType::kFloat32;
    c.dst = params_.at(name).data();
    c.dst_type = type_;
    c.count = values.size();
    STRATA_RETURN_IF_ERROR(device_->ConvertAsync(*stream_, c));
    return device_->SynchronizeStream(*stream_);
  }

  // One forward (and, with `backward`, backward) over the batch.
  strata::StatusOr<StepResult> Step(const std::vector<int32_t>& inputs,
                                    const std::vector<int32_t>& targets,
                                    bool backward, float loss_scale = 1.0f) {
    GptModel& m = *model_;
    STRATA_RETURN_IF_ERROR(m.SetBatch(inputs, targets));
    EmbeddingParams ep{P("wte.weight"), P("wpe.weight")};
    STRATA_RETURN_IF_ERROR(m.EmbeddingForward(ep));
    const int L = static_cast<int>(config_.n_layer);
    for (int l = 0; l < L; ++l) {
      STRATA_RETURN_IF_ERROR(m.BlockForward(l, Block(l)));
    }
    HeadParams hp{P("ln_f.weight"), P("ln_f.bias"), P("wte.weight")};
    HeadGrads hg{G("ln_f.weight"), G("ln_f.bias"), G("wte.weight")};
    STRATA_RETURN_IF_ERROR(
        m.HeadForwardBackward(hp, backward ? &hg : nullptr, loss_scale));
    if (backward) {
      for (int l = L - 1; l >= 0; --l) {
        BlockGrads g;
        for (const ParamSpec& s : specs_) {
          if (s.layer == l) g.t[s.slot] = G(s.name);
        }
        STRATA_RETURN_IF_ERROR(m.BlockBackward(l, Block(l), g));
      }
      STRATA_RETURN_IF_ERROR(
          m.EmbeddingBackward({G("wte.weight"), G("wpe.weight")}));
    }
    StepResult r;
    STRATA_ASSIGN_OR_RETURN(r.loss, m.MeanLoss());
    r.logits.resize(m.tokens_per_step() * config_.vocab_size);
    STRATA_RETURN_IF_ERROR(m.CopyLogits(r.logits));
    if (backward) {
      for (const ParamSpec& s : specs_) {
        std::vector<float> g(s.numel);
        STRATA_RETURN_IF_ERROR(device_->CopyAsync(
            *stream_, g.data(), grads_.at(s.name).data(),
            g.size() * sizeof(float), strata::CopyKind::kDeviceToHost));
        r.grads[s.name] = std::move(g);
      }
    }
    STRATA_RETURN_IF_ERROR(device_->SynchronizeStream(*stream_));
    return r;
  }

  const std::vector<ParamSpec>& specs() const { return specs_; }
  GptModel& model() { return *model_; }

  ~Harness() {
    if (stream_) (void)device_->SynchronizeStream(*stream_);
    model_.reset();
    params_.clear();
    grads_.clear();
  }

 private:
  Harness(strata::Device* device, const GptConfig& config)
      : device_(device), config_(config), specs_(ListParameters(config)) {}
  const void* P(const std::string& n) const { return params_.at(n).data(); }
  float* G(const std::string& n) const {
    return static_cast<float*>(grads_.at(n).data());
  }
  BlockParams Block(int l) const {
    BlockParams p;
    for (const ParamSpec& s : specs_) {
      if (s.layer == l) p.t[s.slot] = P(s.name);
    }
    return p;
  }

  strata::Device* device_;
  GptConfig config_;
  std::vector<ParamSpec> specs_;
  strata::ElementType type_ = strata::ElementType::kFloat32;
  std::unique_ptr<strata::Stream> stream_;
  std::unique_ptr<GptModel> model_;
  std::map<std::string, strata::DeviceMemory> params_;
  std::map<std::string, strata::DeviceMemory> grads_;
};

}  // namespace finetune::testing

#endif  // STRATA_TESTS_FINETUNE_HARNESS_H_
