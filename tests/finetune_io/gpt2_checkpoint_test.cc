// GPT-2 checkpoint mapping on small synthetic files written in Hugging
// Face's layout: names with and without "transformer.", the mask buffers, a
// tied lm_head, and every kind of mismatch named in the error.
#include "examples/finetune/io/gpt2_checkpoint.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/finetune_io/test_util.h"

namespace strata::finetune {
namespace {

using testing::ScratchDir;

constexpr Gpt2Dims kTiny{.n_layer = 2, .n_embd = 8, .vocab = 11, .n_ctx = 6};

// The value of element i of parameter number p: distinct everywhere.
float Value(size_t p, int64_t i) {
  return static_cast<float>(p) * 1000.0f + static_cast<float>(i);
}

struct Extra {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// Writes a checkpoint of `dims` in fp32 (names prefixed with `prefix`),
// without the parameters in `drop`, with `extras` appended, and with the
// shapes of `reshape` replaced.
void WriteCheckpoint(
    const std::string& path, const Gpt2Dims& dims, const std::string& prefix,
    const std::vector<std::string>& drop = {},
    const std::vector<Extra>& extras = {},
    const std::map<std::string, std::vector<int64_t>>& reshape = {}) {
  std::vector<std::vector<float>> storage;
  std::vector<SafetensorsTensorData> tensors;
  const auto specs = Gpt2ParameterSpecs(dims);
  storage.reserve(specs.size() + extras.size());
  for (size_t p = 0; p < specs.size(); ++p) {
    if (std::find(drop.begin(), drop.end(), specs[p].name) != drop.end()) {
      continue;
    }
    std::vector<int64_t> shape = specs[p].shape;
    if (auto it = reshape.find(specs[p].name); it != reshape.end()) {
      shape = it->second;
    }
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float>& v = storage.emplace_back(n);
    for (int64_t i = 0; i < n; ++i) v[i] = Value(p, i);
    tensors.push_back({{prefix + specs[p].name, SafetensorsDType::kF32, shape},
                       std::as_bytes(std::span(v))});
  }
  for (const Extra& e : extras) {
    const std::vector<float>& v = storage.emplace_back(e.values);
    tensors.push_back({{e.name, SafetensorsDType::kF32, e.shape},
                       std::as_bytes(std::span(v))});
  }
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
}

std::vector<float> Wte(const Gpt2Dims& d) {
  std::vector<float> v(d.vocab * d.n_embd);
  for (size_t i = 0; i < v.size(); ++i) v[i] = Value(0, i);
  return v;
}

TEST(Gpt2CheckpointTest, ParameterSpecsMatchHuggingFaceLayout) {
  const auto specs = Gpt2ParameterSpecs(kTiny);
  ASSERT_EQ(specs.size(), 2u + 12u * 2 + 2u);
  EXPECT_EQ(specs[0].name, "wte.weight");
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{11, 8}));
  EXPECT_EQ(specs[1].name, "wpe.weight");
  EXPECT_EQ(specs[1].shape, (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(specs[4].name, "h.0.attn.c_attn.weight");
  EXPECT_EQ(specs[4].shape, (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(specs[12].name, "h.0.mlp.c_proj.weight");
  EXPECT_EQ(specs[12].shape, (std::vector<int64_t>{32, 8}));
  EXPECT_EQ(specs.back().name, "ln_f.bias");
  // GPT-2 124M has 124,439,808 parameters (the tied head counted once).
  int64_t total = 0;
  for (const auto& s : Gpt2ParameterSpecs(
           {.n_layer = 12, .n_embd = 768, .vocab = 50257, .n_ctx = 1024})) {
    total += s.numel();
  }
  EXPECT_EQ(total, 124439808);
}

class PrefixTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefixTest, MapsInfersAndReadsWithBuffersAndTiedHead) {
  ScratchDir dir;
  const std::string path = dir.File("gpt2.safetensors");
  const std::string prefix = GetParam();
  std::vector<Extra> extras;
  for (int l = 0; l < kTiny.n_layer; ++l) {
    extras.push_back({prefix + "h." + std::to_string(l) + ".attn.bias",
                      {1, 1, 6, 6},
                      std::vector<float>(36, 1.0f)});
    extras.push_back(
        {prefix + "h." + std::to_string(l) + ".attn.masked_bias", {}, {-1e4f}});
  }
  extras.push_back({"lm_head.weight", {11, 8}, Wte(kTiny)});
  WriteCheckpoint(path, kTiny, prefix, {}, extras);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto dims = InferGpt2Dims(*file);
  ASSERT_TRUE(dims.ok()) << dims.status().ToString();
  EXPECT_EQ(*dims, kTiny) << ToString(*dims);

  auto map = MapGpt2Checkpoint(*file, *dims);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_EQ(map->ignored.size(), 5u);
  EXPECT_EQ(map->tensor_of.at("h.1.mlp.c_fc.bias"),
            prefix + "h.1.mlp.c_fc.bias");
  const auto specs = Gpt2ParameterSpecs(kTiny);
  for (size_t p = 0; p < specs.size(); ++p) {
    std::vector<float> out(specs[p].numel());
    ASSERT_TRUE(ReadGpt2Parameter(*file, *map, specs[p].name, out).ok());
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(out[i], Value(p, i)) << specs[p].name << "[" << i << "]";
    }
  }
  std::vector<float> one(1);
  EXPECT_EQ(ReadGpt2Parameter(*file, *map, "lm_head.weight", one).code(),
            StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Names, PrefixTest,
                         ::testing::Values("", "transformer."),
                         [](const auto& i) {
                           return i.param.empty() ? "bare" : "transformer";
                         });

TEST(Gpt2CheckpointTest, NamesEveryMissingUnexpectedAndMisshapedTensor) {
  ScratchDir dir;
  const std::string path = dir.File("bad.safetensors");
  WriteCheckpoint(path, kTiny, "", {"h.1.ln_2.bias", "ln_f.weight"},
                  {{"h.0.attn.rotary", {2}, {0, 0}}},
                  {{"h.0.mlp.c_fc.weight", {32, 8}}});
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto map = MapGpt2Checkpoint(*file, kTiny);
  ASSERT_FALSE(map.ok());
  EXPECT_EQ(map.status().code(), StatusCode::kInvalidArgument);
  const std::string msg(map.status().message());
  for (const char* part :
       {"bad.safetensors", "n_layer=2 n_embd=8 vocab=11 n_ctx=6", "2 missing",
        "h.1.ln_2.bias [8]", "ln_f.weight [8]", "1 unexpected",
        "h.0.attn.rotary [2]", "1 mis-shaped",
        "h.0.mlp.c_fc.weight [32, 8] (expected [8, 32])"}) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << " not in " << msg;
  }
}

TEST(Gpt2CheckpointTest, WrongDimsAreMismatches) {
  ScratchDir dir;
  const std::string path = dir.File("gpt2.safetensors");
  WriteCheckpoint(path, kTiny, "transformer.");
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  Gpt2Dims deeper = kTiny;
  deeper.n_layer = 3;
  auto map = MapGpt2Checkpoint(*file, deeper);
  ASSERT_FALSE(map.ok());
  EXPECT_NE(map.status().message().find("12 missing (h.2."), std::string::npos)
      << map.status().ToString();
  Gpt2Dims wider = kTiny;
  wider.vocab = 12;
  map = MapGpt2Checkpoint(*file, wider);
  ASSERT_FALSE(map.ok());
  EXPECT_NE(map.status().message().find(
                "transformer.wte.weight [11, 8] (expected [12, 8])"),
            std::string::npos)
      << map.status().ToString();
}

// The error of mapping a kTiny checkpoint with `extras` added; "" when it
// maps.
std::string MapErrorWith(const std::vector<Extra>& extras) {
  ScratchDir dir;
  const std::string path = dir.File("gpt2.safetensors");
  WriteCheckpoint(path, kTiny, "", {}, extras);
  auto file = SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status().ToString();
  if (!file.ok()) return "cannot open";
  auto map = MapGpt2Checkpoint(*file, kTiny);
  if (map.ok()) return "";
  EXPECT_EQ(map.status().code(), StatusCode::kInvalidArgument);
  return std::string(map.status().message());
}

TEST(Gpt2CheckpointTest, UntiedHeadIsRejected) {
  std::vector<float> head = Wte(kTiny);
  head[50] += 1.0f;
  const std::string msg = MapErrorWith({{"lm_head.weight", {11, 8}, head}});
  EXPECT_NE(msg.find("lm_head.weight differs"), std::string::npos) << msg;
  EXPECT_EQ(MapErrorWith({{"lm_head.weight", {11, 8}, Wte(kTiny)}}), "");
}

TEST(Gpt2CheckpointTest, BothSpellingsOfOneNameAreRejected) {
  const std::string msg =
      MapErrorWith({{"transformer.ln_f.bias", {8}, std::vector<float>(8)}});
  EXPECT_NE(msg.find("with and without 'transformer.' (ln_f.bias)"),
            std::string::npos)
      << msg;
}

TEST(Gpt2CheckpointTest, InferNeedsEmbeddings) {
  ScratchDir dir;
  const std::string path = dir.File("noemb.safetensors");
  WriteCheckpoint(path, kTiny, "", {"wpe.weight"});
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto dims = InferGpt2Dims(*file);
  ASSERT_FALSE(dims.ok());
  EXPECT_EQ(dims.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dims.status().message().find("wpe.weight"), std::string::npos);
}

// Found by the gpt2_checkpoint fuzz target: a stray block index made the
// expected-tensor list billions long, and a zero-byte [0, 2^62] embedding
// overflowed 4 * n_embd. Both are refused naming the file and the value.
TEST(Gpt2CheckpointTest, InferRefusesDimensionsOutOfRange) {
  ScratchDir dir;
  struct Case {
    std::vector<Extra> extras;
    std::map<std::string, std::vector<int64_t>> reshape;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {{{"h.300000000.ln_1.weight", {8}, std::vector<float>(8)}},
       {},
       "names block 300000000; accepted: blocks 0..4095"},
      {{}, {{"wte.weight", {0, int64_t{1} << 62}}}, "vocab (dim 0) 0 is out"},
      {{}, {{"wte.weight", {1, 0}}}, "n_embd (dim 1) 0 is out of range"},
      {{}, {{"wpe.weight", {0, 8}}}, "n_ctx (dim 0) 0 is out of range"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string path = dir.File("dims" + std::to_string(i));
    WriteCheckpoint(path, kTiny, "", {}, cases[i].extras, cases[i].reshape);
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status().ToString();
    auto dims = InferGpt2Dims(*file);
    ASSERT_FALSE(dims.ok()) << i;
    EXPECT_EQ(dims.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(dims.status().message().find(cases[i].expect), std::string::npos)
        << dims.status().ToString();
    EXPECT_NE(dims.status().message().find(path), std::string::npos);
  }
}

TEST(Gpt2CheckpointTest, Bf16CheckpointReadsAsFloat) {
  ScratchDir dir;
  const std::string path = dir.File("bf16.safetensors");
  const Gpt2Dims d{.n_layer = 1, .n_embd = 4, .vocab = 5, .n_ctx = 3};
  std::vector<std::vector<uint16_t>> storage;
  std::vector<SafetensorsTensorData> tensors;
  for (const auto& s : Gpt2ParameterSpecs(d)) {
    // bf16 0x4000 + k is 2 + k/64 exactly.
    auto& v = storage.emplace_back(s.numel());
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0x4000 + (i % 64);
    tensors.push_back({{s.name, SafetensorsDType::kBF16, s.shape},
                       std::as_bytes(std::span(v))});
  }
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto dims = InferGpt2Dims(*file);
  ASSERT_TRUE(dims.ok());
  EXPECT_EQ(*dims, d);
  auto map = MapGpt2Checkpoint(*file, d);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::vector<float> out(4 * 16);
  ASSERT_TRUE(ReadGpt2Parameter(*file, *map, "h.0.mlp.c_fc.weight", out).ok());
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i], 2.0f + static_cast<float>(i % 64) / 64.0f) << i;
  }
}

}  // namespace
}  // namespace strata::finetune
