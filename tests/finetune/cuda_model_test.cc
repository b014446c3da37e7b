// The CUDA kernels against the CPU ones: the tiny model's forward and
// backward on the CUDA device (cuBLAS GEMMs, the CUDA kernel set) and on the
// host-emulated device (OpenBLAS, the CPU set) give the same logits, loss
// and gradients within fp32 rounding (the CUDA backward sums with atomics,
// in no fixed order). Skips without a working GPU.
#include <gtest/gtest.h>

#include <cmath>

#include "examples/finetune/model/config.h"
#include "strata/device.h"
#include "tests/finetune/harness.h"

namespace finetune {
namespace {

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 double rel, double abs, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], abs + rel * std::fabs(want[i]))
        << what << "[" << i << "]";
  }
}

TEST(CudaModelTest, MatchesTheHostEmulatedDevice) {
  strata::DeviceOptions co;
  co.memory_budget_bytes = 256 << 20;
  auto cuda = strata::NewCudaDevice(co);
  if (!cuda.ok()) GTEST_SKIP() << cuda.status().ToString();
  strata::DeviceOptions ho;
  ho.memory_budget_bytes = 256 << 20;
  auto host = strata::NewHostEmulatedDevice(ho);
  ASSERT_TRUE(host.ok());

  GptConfig config = *PresetConfig("tiny");
  config.n_embd = 48;  // head size 24: not a multiple of the warp
  config.vocab_size = 300;
  const auto weights = testing::TestWeights(config, 31);
  for (auto [type, rel] : {std::pair{strata::ElementType::kFloat32, 1e-3},
                           std::pair{strata::ElementType::kBFloat16, 5e-2}}) {
    SCOPED_TRACE(std::string(strata::ElementTypeName(type)));
    ModelOptions options;
    options.batch_size = 3;
    options.seq_len = 13;
    options.param_type = type;
    const size_t n = options.batch_size * options.seq_len;
    const auto inputs = testing::TestTokens(n, config.vocab_size, 32);
    const auto targets = testing::TestTokens(n, config.vocab_size, 33);
    auto hg = testing::Harness::Create(cuda->get(), config, options, weights);
    ASSERT_TRUE(hg.ok()) << hg.status().ToString();
    auto hc = testing::Harness::Create(host->get(), config, options, weights);
    ASSERT_TRUE(hc.ok()) << hc.status().ToString();
    auto g = (*hg)->Step(inputs, targets, true, 4.0f);
    auto c = (*hc)->Step(inputs, targets, true, 4.0f);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    EXPECT_NEAR(g->loss, c->loss, rel * c->loss);
    ExpectClose(g->logits, c->logits, rel, rel * 0.1, "logits");
    for (const auto& [name, grad] : c->grads) {
      double num = 0, den = 0;
      for (size_t i = 0; i < grad.size(); ++i) {
        const double d = g->grads.at(name)[i] - grad[i];
        num += d * d;
        den += double(grad[i]) * grad[i];
      }
      EXPECT_LE(std::sqrt(num), rel * std::sqrt(den) + 1e-6) << name;
    }
  }
}

}  // namespace
}  // namespace finetune
