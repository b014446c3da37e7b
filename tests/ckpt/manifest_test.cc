// The manifest parser: a round trip, and refusals that name the JSON path.
#include "ckpt/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdio>

namespace strata::ckpt {
namespace {

using ::testing::HasSubstr;

Manifest Small() {
  Manifest m;
  m.step = 12;
  m.tensors = {{"w", {4, 1024}, ElementType::kFloat32}};
  ExtentRecord a{StateRole::kMaster, 0, 8192, 0x1234, {{0, 0, 0, 2048}}};
  ExtentRecord b{StateRole::kMaster, 8192, 8192, 0x5678, {{0, 2048, 0, 2048}}};
  m.extents = {a, b};
  const ExtentRecord* es[] = {&m.extents[0], &m.extents[1]};
  m.files = {{StateRole::kMaster, "master.bin", 16384, FileChecksum(es)}};
  m.blobs = {{"trainer", std::string("a\0b", 3)}};
  return m;
}

// Replaces the first `from` in the JSON with `to` and re-seals the text
// with a valid checksum line, so that the parser's later checks are reached.
std::string Edit(const std::string& text, const std::string& from,
                 const std::string& to) {
  std::string body = text.substr(0, text.size() - 22);
  const size_t at = body.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) body.replace(at, from.size(), to);
  char sum[32];
  std::snprintf(
      sum, sizeof sum, "xxh3 %016llx\n",
      static_cast<unsigned long long>(XXH3_64bits(body.data(), body.size())));
  return body + sum;
}

TEST(ManifestTest, RoundTrip) {
  const std::string text = SerializeManifest(Small());
  auto m = ParseManifest(text, "M");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->step, 12);
  ASSERT_EQ(m->extents.size(), 2u);
  EXPECT_EQ(m->extents[1].placements[0].tensor_offset, 2048u);
  EXPECT_EQ(m->blobs[0].bytes, std::string("a\0b", 3));
  EXPECT_EQ(SerializeManifest(*m), text);
}

TEST(ManifestTest, RefusalsNameTheJsonPath) {
  const std::string text = SerializeManifest(Small());
  struct Case {
    std::string from, to, want;
  };
  const Case cases[] = {
      {"\"step\": 12", "\"step\": -12", "step: expected an unsigned integer"},
      {"\"step\": 12", "\"step\": 1.5", "step: expected an unsigned"},
      {"\"version\": 1", "\"version\": 2", "version: 2 is not 1"},
      {"\"dtype\": \"float32\"", "\"dtype\": \"int8\"", "tensors[0].dtype"},
      {"1024", "0", "tensors[0].shape"},
      {"\"elems\": 2048", "\"elems\": 4096", "extents[0]"},
      {"\"offset\": 8192", "\"offset\": 4096", "extents[1].offset"},
      {"\"size\": 16384", "\"size\": 20480", "files[0].size"},
      {"\"name\": \"master.bin\"", "\"name\": \"../x\"", "files[0].name"},
      {"\"role\": \"master\"", "\"role\": \"other\"", "extents[0].role"},
      {"\"tensor\": 0", "\"tensor\": 7", "placements[0].tensor"},
      {"\"tensor_offset\": 2048", "\"tensor_offset\": 1024", "stored twice"},
      {"\"hex\": \"610062\"", "\"hex\": \"61006\"", "blobs[0].hex"},
      {"\"format\"", "\"extra\": 1, \"format\"", "extra: unknown key"},
      {"{", "[[[[[[[[[[", "nested deeper"},
      {"{", "{]", "invalid JSON"},
  };
  for (const Case& c : cases) {
    auto m = ParseManifest(Edit(text, c.from, c.to), "dir/MANIFEST.json");
    ASSERT_FALSE(m.ok()) << c.to;
    EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
    EXPECT_THAT(std::string(m.status().message()), HasSubstr(c.want)) << c.to;
    EXPECT_THAT(std::string(m.status().message()),
                HasSubstr("dir/MANIFEST.json"));
  }
}

TEST(ManifestTest, ChecksumLine) {
  const std::string text = SerializeManifest(Small());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{21}, text.size() - 1}) {
    EXPECT_EQ(ParseManifest(text.substr(0, cut), "M").status().code(),
              StatusCode::kCorruption);
  }
  std::string flipped = text;
  flipped[10] ^= 1;
  auto m = ParseManifest(flipped, "M");
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("checksum"));
}

TEST(ManifestTest, StepDirNames) {
  EXPECT_EQ(StepDirName(42), "step-000000000042");
  EXPECT_EQ(ParseStepDirName("step-000000000042"), 42);
  EXPECT_EQ(ParseStepDirName("step-42"), -1);
  EXPECT_EQ(ParseStepDirName("step-0000000000042"), -1);  // not canonical
  EXPECT_EQ(ParseStepDirName("step-00000000004x"), -1);
  EXPECT_EQ(ParseStepDirName("step-1234567890123"), 1234567890123);
}

}  // namespace
}  // namespace strata::ckpt
