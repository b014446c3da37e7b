// The GPT-2 model on the host-emulated device: config and parameter layout,
// every parameter's gradient against finite differences, and activation
// checkpointing against keeping every block's activations.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "examples/finetune/model/config.h"
#include "examples/finetune/model/model.h"
#include "strata/device.h"
#include "tests/finetune/harness.h"

namespace finetune {
namespace {

using testing::Harness;
using testing::StepResult;

TEST(GptConfigTest, PresetsMatchPublishedParameterCounts) {
  auto c = PresetConfig("gpt2-124M");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ParameterCount(*c), 124439808);  // Hugging Face's gpt2
  c = PresetConfig("gpt2-1.5B");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(ParameterCount(*c), 1557611200);  // gpt2-xl
  c = PresetConfig("gpt3-13B");
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR(ParameterCount(*c) / 1e9, 12.85, 0.05);
  c = PresetConfig("gpt3-6.7B");
  ASSERT_TRUE(c.ok());
  EXPECT_NEAR(ParameterCount(*c) / 1e9, 6.66, 0.05);
  for (const std::string& name : PresetNames()) {
    auto p = PresetConfig(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_TRUE(ValidateConfig(*p).ok()) << name;
  }
  auto bad = PresetConfig("gpt2-huge");
  EXPECT_EQ(bad.status().code(), strata::StatusCode::kNotFound);
  EXPECT_NE(bad.status().message().find("gpt2-124M"), std::string::npos);
}

TEST(GptConfigTest, ValidateNamesTheField) {
  GptConfig c;
  c.n_head = 5;  // 768 % 5 != 0
  const strata::Status s = ValidateConfig(c);
  EXPECT_EQ(s.code(), strata::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("n_head"), std::string::npos);
}

TEST(GptConfigTest, ParametersAreNamedAndShapedAsHuggingFaceGpt2) {
  GptConfig c;
  c.n_layer = 2;
  const std::vector<ParamSpec> specs = ListParameters(c);
  ASSERT_EQ(specs.size(), 2u + 12u * 2 + 2u);
  EXPECT_EQ(specs[0].name, "wte.weight");
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{50257, 768}));
  EXPECT_EQ(specs[1].name, "wpe.weight");
  EXPECT_EQ(specs[1].shape, (std::vector<int64_t>{1024, 768}));
  EXPECT_EQ(specs[4].name, "h.0.attn.c_attn.weight");
  EXPECT_EQ(specs[4].shape, (std::vector<int64_t>{768, 2304}));
  EXPECT_EQ(specs[4].slot, kQkvWeight);
  EXPECT_EQ(specs[10].name, "h.0.mlp.c_fc.weight");
  EXPECT_EQ(specs[10].shape, (std::vector<int64_t>{768, 3072}));
  EXPECT_EQ(specs[12].name, "h.0.mlp.c_proj.weight");
  EXPECT_EQ(specs[12].shape, (std::vector<int64_t>{3072, 768}));
  EXPECT_EQ(specs[13].name, "h.0.mlp.c_proj.bias");
  EXPECT_EQ(specs[14].name, "h.1.ln_1.weight");
  EXPECT_EQ(specs[14].layer, 1);
  EXPECT_EQ(specs.back().name, "ln_f.bias");
  int64_t total = 0;
  for (const ParamSpec& s : specs) total += s.numel;
  EXPECT_EQ(total, ParameterCount(c));
}

TEST(GptConfigTest, InitFollowsGpt2) {
  const GptConfig c = *PresetConfig("tiny");
  for (const ParamSpec& s : ListParameters(c)) {
    std::vector<float> v(s.numel), again(s.numel);
    InitParameter(s, c, 7, v);
    InitParameter(s, c, 7, again);
    EXPECT_EQ(v, again) << s.name;
    double sum = 0, sq = 0;
    for (float x : v) {
      sum += x;
      sq += double(x) * x;
    }
    const double mean = sum / v.size();
    const double sd = std::sqrt(sq / v.size() - mean * mean);
    if (s.name.ends_with(".bias")) {
      EXPECT_EQ(sq, 0.0) << s.name;
    } else if (s.name.find("ln_") != std::string::npos) {
      EXPECT_EQ(mean, 1.0) << s.name;
    } else if (s.name.ends_with("c_proj.weight")) {
      EXPECT_NEAR(sd, 0.02 / std::sqrt(4.0), 0.003) << s.name;
    } else {
      EXPECT_NEAR(sd, 0.02, 0.003) << s.name;
    }
  }
}

TEST(GptConfigTest, FlopsPerTokenIsSixNPlusAttention) {
  const GptConfig c = *PresetConfig("gpt2-124M");
  const double n = ParameterCount(c) - 1024.0 * 768;
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(c, 1024),
                   6 * n + 12.0 * 12 * 1024 * 768);
}

class GptModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    strata::DeviceOptions o;
    o.choice = strata::DeviceChoice::kHostEmulated;
    o.memory_budget_bytes = 256 << 20;
    auto d = strata::NewHostEmulatedDevice(o);
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    device_ = std::move(*d);
    config_ = *PresetConfig("tiny");
    options_.batch_size = 2;
    options_.seq_len = 16;
    options_.param_type = strata::ElementType::kFloat32;
    weights_ = testing::TestWeights(config_, 1);
    const size_t n = options_.batch_size * options_.seq_len;
    inputs_ = testing::TestTokens(n, config_.vocab_size, 2);
    targets_ = testing::TestTokens(n, config_.vocab_size, 3);
  }

  std::unique_ptr<strata::Device> device_;
  GptConfig config_;
  ModelOptions options_;
  std::map<std::string, std::vector<float>> weights_;
  std::vector<int32_t> inputs_, targets_;
};

TEST_F(GptModelTest, RejectsBadOptionsAndTokens) {
  auto stream = device_->NewStream({});
  ASSERT_TRUE(stream.ok());
  ModelOptions o = options_;
  o.seq_len = 17;
  auto m = GptModel::Create(device_.get(), stream->get(), config_, o);
  EXPECT_EQ(m.status().code(), strata::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("seq_len"), std::string::npos);
  auto ok = GptModel::Create(device_.get(), stream->get(), config_, options_);
  ASSERT_TRUE(ok.ok());
  std::vector<int32_t> bad = inputs_;
  bad[3] = 64;
  const strata::Status s = (*ok)->SetBatch(bad, targets_);
  EXPECT_EQ(s.code(), strata::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("vocab_size"), std::string::npos);
}

// Central differences of the summed loss (loss_scale = B T makes the
// analytic gradients those of the sum) for a few elements of every tensor.
TEST_F(GptModelTest, GradientsMatchFiniteDifferences) {
  auto h = Harness::Create(device_.get(), config_, options_, weights_);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  const float n = options_.batch_size * options_.seq_len;
  auto base = (*h)->Step(inputs_, targets_, /*backward=*/true, n);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  EXPECT_GT(base->loss, 0.5f);
  std::mt19937 rng(5);
  constexpr float kEps = 1e-2f;
  int checked = 0;
  for (const ParamSpec& s : (*h)->specs()) {
    std::vector<float> w = weights_.at(s.name);
    const std::vector<float>& grad = base->grads.at(s.name);
    std::vector<size_t> picks;
    // The largest-gradient element, and random ones (wpe: used rows only).
    size_t arg = 0;
    for (size_t i = 0; i < grad.size(); ++i) {
      if (std::fabs(grad[i]) > std::fabs(grad[arg])) arg = i;
    }
    picks.push_back(arg);
    const size_t limit = s.name == "wpe.weight"
                             ? size_t(options_.seq_len) * config_.n_embd
                             : w.size();
    for (int k = 0; k < 3; ++k) picks.push_back(rng() % limit);
    for (size_t i : picks) {
      const float orig = w[i];
      float loss[2];
      for (int side = 0; side < 2; ++side) {
        w[i] = orig + (side ? -kEps : kEps);
        FT_ASSERT_OK((*h)->Upload(s.name, w));
        auto r = (*h)->Step(inputs_, targets_, /*backward=*/false);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        loss[side] = r->loss * n;
      }
      w[i] = orig;
      FT_ASSERT_OK((*h)->Upload(s.name, w));
      const double fd = (double(loss[0]) - loss[1]) / (2 * kEps);
      EXPECT_NEAR(grad[i], fd, 2e-3 + 2e-2 * std::fabs(fd))
          << s.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * 28);
}

void ExpectSameStep(const StepResult& a, const StepResult& b) {
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.logits, b.logits);
  for (const auto& [name, g] : a.grads) {
    EXPECT_EQ(g, b.grads.at(name)) << name;
  }
}

TEST_F(GptModelTest, CheckpointingEqualsKeepingActivations) {
  for (auto type :
       {strata::ElementType::kFloat32, strata::ElementType::kBFloat16,
        strata::ElementType::kFloat16}) {
    SCOPED_TRACE(std::string(strata::ElementTypeName(type)));
    ModelOptions with = options_, without = options_;
    with.param_type = without.param_type = type;
    with.checkpoint_blocks = true;
    without.checkpoint_blocks = false;
    auto a = Harness::Create(device_.get(), config_, with, weights_);
    auto b = Harness::Create(device_.get(), config_, without, weights_);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_LT((*a)->model().workspace_bytes(), (*b)->model().workspace_bytes());
    auto ra = (*a)->Step(inputs_, targets_, true, 8.0f);
    auto rb = (*b)->Step(inputs_, targets_, true, 8.0f);
    ASSERT_TRUE(ra.ok() && rb.ok());
    ExpectSameStep(*ra, *rb);
  }
}

// 16-bit working types follow fp32 within their rounding.
TEST_F(GptModelTest, SixteenBitRunsTrackFp32) {
  auto f = Harness::Create(device_.get(), config_, options_, weights_);
  ASSERT_TRUE(f.ok());
  auto ref = (*f)->Step(inputs_, targets_, true);
  ASSERT_TRUE(ref.ok());
  for (auto [type, tol] : {std::pair{strata::ElementType::kBFloat16, 0.03},
                           std::pair{strata::ElementType::kFloat16, 0.005}}) {
    SCOPED_TRACE(std::string(strata::ElementTypeName(type)));
    ModelOptions o = options_;
    o.param_type = type;
    auto h = Harness::Create(device_.get(), config_, o, weights_);
    ASSERT_TRUE(h.ok());
    auto r = (*h)->Step(inputs_, targets_, true);
    ASSERT_TRUE(r.ok());
    EXPECT_NEAR(r->loss, ref->loss, tol * ref->loss);
    for (const auto& [name, g] : ref->grads) {
      double num = 0, den = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        const double d = r->grads.at(name)[i] - g[i];
        num += d * d;
        den += double(g[i]) * g[i];
      }
      EXPECT_LT(std::sqrt(num), 4 * tol * std::sqrt(den) + 1e-6) << name;
    }
  }
}

// The scalar kernel set gives the AVX2 set's model to rounding.
TEST_F(GptModelTest, ScalarAndVectorKernelSetsAgree) {
  if (!cpu::IsaSupported(Isa::kAvx2)) GTEST_SKIP() << "no AVX2 here";
  ModelOptions s = options_, v = options_;
  s.cpu_isa = Isa::kScalar;
  v.cpu_isa = Isa::kAvx2;
  auto a = Harness::Create(device_.get(), config_, s, weights_);
  auto b = Harness::Create(device_.get(), config_, v, weights_);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ra = (*a)->Step(inputs_, targets_, true);
  auto rb = (*b)->Step(inputs_, targets_, true);
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_NEAR(ra->loss, rb->loss, 1e-5);
  for (const auto& [name, g] : ra->grads) {
    const auto& o = rb->grads.at(name);
    for (size_t i = 0; i < g.size(); ++i) {
      ASSERT_NEAR(g[i], o[i], 1e-4 + 1e-3 * std::fabs(g[i])) << name << i;
    }
  }
}

}  // namespace
}  // namespace finetune
