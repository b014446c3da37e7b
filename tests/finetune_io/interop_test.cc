// Interoperability with an independent implementation of safetensors:
// safetensors_interop.py (json and struct only, since Debian's torch 1.13
// has no safetensors) writes a file that the reader must take, and dumps a
// file that the writer made. Runs the first python3 found
// ($STRATA_PYTHON, python3 on PATH, /usr/bin/python3); skips without one.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "examples/finetune/io/safetensors.h"
#include "tests/finetune_io/test_util.h"
#include "util/find_python.h"

#ifndef STRATA_INTEROP_SCRIPT
#error "STRATA_INTEROP_SCRIPT must name safetensors_interop.py"
#endif

namespace strata::finetune {
namespace {

using testing::ScratchDir;

struct Expected {
  std::string name;
  SafetensorsDType dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// The script's TENSORS.
const std::vector<Expected> kTensors = {
    {"transformer.wte.weight",
     SafetensorsDType::kF32,
     {2, 3},
     {0.5f, -1.25f, 3.0f, 4.5f, -0.0f, 1e-7f}},
    {"h.0.attn.c_attn.bias",
     SafetensorsDType::kF16,
     {4},
     {1.0f, -2.5f, 0.0999755859375f, 65504.0f}},
    {"ln_f.weight", SafetensorsDType::kBF16, {3}, {1.0f, -3.0f, 3.140625f}},
    {"count", SafetensorsDType::kI32, {2}, {7.0f, -9.0f}},
    {"empty", SafetensorsDType::kF32, {0}, {}},
};

std::string Python() {
  static const std::string py = FindPythonWith("json, struct");
  return py;
}

TEST(InteropTest, ReadsAFileWrittenByAnIndependentWriter) {
  if (Python().empty()) GTEST_SKIP() << "no python3 found";
  ScratchDir dir;
  const std::string path = dir.File("py.safetensors");
  ASSERT_EQ(RunQuietly({Python(), STRATA_INTEROP_SCRIPT, "write", path}), 0);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->metadata().at("writer"), "python");
  ASSERT_EQ(file->tensors().size(), kTensors.size());
  for (const Expected& e : kTensors) {
    const SafetensorsTensorInfo* t = file->Find(e.name);
    ASSERT_NE(t, nullptr) << e.name;
    EXPECT_EQ(t->dtype, e.dtype) << e.name;
    EXPECT_EQ(t->shape, e.shape) << e.name;
    auto v = file->ReadFloat32(e.name);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    EXPECT_EQ(*v, e.values) << e.name;
  }
}

TEST(InteropTest, AnIndependentReaderReadsOurFile) {
  if (Python().empty()) GTEST_SKIP() << "no python3 found";
  ScratchDir dir;
  const std::string path = dir.File("ours.safetensors");
  const std::string out = dir.File("dump.json");
  // The values in their own dtypes.
  const std::vector<float> wte = kTensors[0].values;
  const std::vector<uint16_t> f16 = {0x3c00, 0xc100, 0x2e66, 0x7bff};
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc040, 0x4049};
  const std::vector<int32_t> count = {7, -9};
  const std::vector<SafetensorsTensorData> tensors = {
      {{kTensors[0].name, kTensors[0].dtype, kTensors[0].shape},
       std::as_bytes(std::span(wte))},
      {{kTensors[1].name, kTensors[1].dtype, kTensors[1].shape},
       std::as_bytes(std::span(f16))},
      {{kTensors[2].name, kTensors[2].dtype, kTensors[2].shape},
       std::as_bytes(std::span(bf16))},
      {{kTensors[3].name, kTensors[3].dtype, kTensors[3].shape},
       std::as_bytes(std::span(count))},
      {{kTensors[4].name, kTensors[4].dtype, kTensors[4].shape}, {}},
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"writer", "strata"}}).ok());
  ASSERT_EQ(RunQuietly({Python(), STRATA_INTEROP_SCRIPT, "dump", path, out}),
            0);
  std::ifstream in(out);
  const nlohmann::json dump = nlohmann::json::parse(in, nullptr, false);
  ASSERT_FALSE(dump.is_discarded());
  EXPECT_EQ(dump["__metadata__"]["writer"], "strata");
  for (const Expected& e : kTensors) {
    ASSERT_TRUE(dump.contains(e.name)) << e.name;
    const nlohmann::json& t = dump[e.name];
    EXPECT_EQ(t["dtype"], std::string(SafetensorsDTypeName(e.dtype)));
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), e.shape);
    std::vector<float> got;
    for (const auto& v : t["values"]) got.push_back(v.get<float>());
    EXPECT_EQ(got, e.values) << e.name;
  }
}

}  // namespace
}  // namespace strata::finetune
