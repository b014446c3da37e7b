// The tiny model against GPT-2 written in PyTorch (gpt2_reference.py, run in
// float64 by the python3 that has torch) on the same weights and tokens:
// logits, loss and every parameter's gradient. Tolerance: fp32 rounding of
// a two-layer model, |ours - torch| <= 1e-4 + 1e-3 |torch| per element.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "examples/finetune/model/config.h"
#include "strata/device.h"
#include "tests/finetune/harness.h"
#include "tests/util/scratch_dir.h"

namespace finetune {
namespace {

namespace fs = std::filesystem;

using strata::testing::ScratchDir;

template <class T>
void WriteFile(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<float> ReadFloats(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::vector<float> v(f ? size_t(f.tellg()) / sizeof(float) : 0);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), v.size() * sizeof(float));
  return v;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-4 + 1e-3 * std::fabs(want[i]))
        << what << "[" << i << "]";
  }
}

TEST(TorchReferenceTest, SameLogitsLossAndGradients) {
  const std::string python = FINETUNE_TORCH_PYTHON;
  if (python.empty()) {
    GTEST_SKIP() << "no python3 with torch was found at configure time "
                    "(Debian: python3-torch)";
  }
  strata::DeviceOptions o;
  o.choice = strata::DeviceChoice::kHostEmulated;
  o.memory_budget_bytes = 64 << 20;
  auto device = strata::NewHostEmulatedDevice(o);
  ASSERT_TRUE(device.ok());
  const GptConfig config = *PresetConfig("tiny");
  ModelOptions options;
  options.batch_size = 2;
  options.seq_len = 12;  // shorter than the context: wpe rows 12..15 unused
  options.param_type = strata::ElementType::kFloat32;
  const auto weights = testing::TestWeights(config, 21);
  const size_t n = options.batch_size * options.seq_len;
  const auto inputs = testing::TestTokens(n, config.vocab_size, 22);
  const auto targets = testing::TestTokens(n, config.vocab_size, 23);

  auto h = testing::Harness::Create(device->get(), config, options, weights);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  auto ours = (*h)->Step(inputs, targets, /*backward=*/true);
  ASSERT_TRUE(ours.ok()) << ours.status().ToString();

  ScratchDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::string params = "[";
  for (const ParamSpec& s : ListParameters(config)) {
    WriteFile(dir.path() + "/" + s.name + ".bin", weights.at(s.name));
    params +=
        std::string(params.size() > 1 ? "," : "") + "[\"" + s.name + "\",[";
    for (size_t i = 0; i < s.shape.size(); ++i) {
      params += (i ? "," : "") + std::to_string(s.shape[i]);
    }
    params += "]]";
  }
  params += "]";
  std::ofstream(dir.path() + "/config.json")
      << "{\"vocab\":" << config.vocab_size << ",\"embd\":" << config.n_embd
      << ",\"layer\":" << config.n_layer << ",\"head\":" << config.n_head
      << ",\"batch\":" << options.batch_size << ",\"seq\":" << options.seq_len
      << ",\"params\":" << params << "}";
  WriteFile(dir.path() + "/inputs.bin", inputs);
  WriteFile(dir.path() + "/targets.bin", targets);
  const std::string cmd =
      python + " " + FINETUNE_TORCH_SCRIPT + " " + dir.path();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;

  const auto loss = ReadFloats(dir.path() + "/loss.bin");
  ASSERT_EQ(loss.size(), 1u);
  EXPECT_NEAR(ours->loss, loss[0], 1e-5 * loss[0]);
  ExpectClose(ours->logits, ReadFloats(dir.path() + "/logits.bin"), "logits");
  for (const ParamSpec& s : ListParameters(config)) {
    ExpectClose(ours->grads.at(s.name),
                ReadFloats(dir.path() + "/grad/" + s.name + ".bin"), s.name);
  }
}

}  // namespace
}  // namespace finetune
