// The safetensors reader and writer: round trips of every dtype, streaming
// writes, and each way a file can be malformed, each failing at Open with
// the file and the tensor named.
#include "examples/finetune/io/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/finetune_io/test_util.h"

namespace strata::finetune {
namespace {

using testing::SafetensorsBytes;
using testing::ScratchDir;
using testing::WriteBytes;

std::span<const std::byte> Bytes(const auto& v) {
  return std::as_bytes(std::span(v));
}

TEST(SafetensorsTest, RoundTripsEveryDtypeAndMetadata) {
  ScratchDir dir;
  const std::string path = dir.File("m.safetensors");
  const std::vector<float> f32 = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, 7.0f};
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x3555};   // 1, -2, ~1/3
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc040, 0x4049};  // 1, -3, ~3.14
  const std::vector<double> f64 = {0.5, -8.0};
  const std::vector<int64_t> i64 = {-3, 1LL << 40};
  const std::vector<int8_t> i8 = {-128, 127, 0};
  const std::vector<uint8_t> empty;
  std::vector<SafetensorsTensorData> tensors = {
      {{"a.f32", SafetensorsDType::kF32, {2, 3}}, Bytes(f32)},
      {{"b.f16", SafetensorsDType::kF16, {3}}, Bytes(f16)},
      {{"c.bf16", SafetensorsDType::kBF16, {1, 3}}, Bytes(bf16)},
      {{"d.f64", SafetensorsDType::kF64, {2}}, Bytes(f64)},
      {{"e.i64", SafetensorsDType::kI64, {2}}, Bytes(i64)},
      {{"f.i8", SafetensorsDType::kI8, {3}}, Bytes(i8)},
      {{"g.empty", SafetensorsDType::kF32, {0, 4}}, Bytes(empty)},
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}}).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_EQ(file->data_offset() % 8, 0u) << "the header is padded to 8";
  EXPECT_EQ(file->metadata().at("format"), "pt");
  ASSERT_EQ(file->tensors().size(), tensors.size());
  const SafetensorsTensorInfo* a = file->Find("a.f32");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->numel(), 6);
  EXPECT_EQ(file->Find("nope"), nullptr);

  EXPECT_EQ(*file->ReadFloat32("a.f32"), f32);
  EXPECT_EQ(*file->ReadFloat32("b.f16"),
            (std::vector<float>{1, -2, 0.333251953125f}));
  EXPECT_EQ(*file->ReadFloat32("c.bf16"),
            (std::vector<float>{1, -3, 3.140625f}));
  EXPECT_EQ(*file->ReadFloat32("d.f64"), (std::vector<float>{0.5f, -8.0f}));
  EXPECT_EQ(*file->ReadFloat32("e.i64"),
            (std::vector<float>{-3.0f, static_cast<float>(1LL << 40)}));
  EXPECT_EQ(*file->ReadFloat32("f.i8"), (std::vector<float>{-128, 127, 0}));
  EXPECT_TRUE(file->ReadFloat32("g.empty")->empty());

  std::vector<uint16_t> raw(3);
  ASSERT_TRUE(
      file->ReadRaw("b.f16", std::as_writable_bytes(std::span(raw))).ok());
  EXPECT_EQ(raw, f16);
  uint16_t one = 0;
  ASSERT_TRUE(
      file->ReadRaw("b.f16", 2, std::as_writable_bytes(std::span(&one, 1)))
          .ok());
  EXPECT_EQ(one, 0xc000);
  EXPECT_EQ(
      file->ReadRaw("b.f16", 6, std::as_writable_bytes(std::span(&one, 1)))
          .code(),
      StatusCode::kOutOfRange);

  std::vector<float> wrong(5);
  Status s = file->ReadFloat32("a.f32", std::span(wrong));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("a.f32"), std::string_view::npos) << s.ToString();
  EXPECT_EQ(file->ReadFloat32("missing").status().code(),
            StatusCode::kNotFound);
}

TEST(SafetensorsTest, LargeTensorConvertsThroughTheStagingBuffer) {
  ScratchDir dir;
  const std::string path = dir.File("big.safetensors");
  // 3M bf16 values: more than one 4 MiB staging chunk.
  std::vector<uint16_t> v(3 << 20);
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = static_cast<uint16_t>(0x3f80 + (i % 128));
  }
  std::vector<SafetensorsTensorData> t = {
      {{"w", SafetensorsDType::kBF16, {3, 1 << 20}}, Bytes(v)}};
  ASSERT_TRUE(WriteSafetensors(path, t).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  auto got = file->ReadFloat32("w");
  ASSERT_TRUE(got.ok());
  for (size_t i = 0; i < v.size(); i += 4099) {
    uint32_t bits = static_cast<uint32_t>(v[i]) << 16;
    float want;
    std::memcpy(&want, &bits, 4);
    ASSERT_EQ((*got)[i], want) << i;
  }
}

TEST(SafetensorsTest, StreamingWriterChecksOrderAndCompleteness) {
  ScratchDir dir;
  const std::string path = dir.File("s.safetensors");
  std::vector<SafetensorsTensorSpec> specs = {
      {"x", SafetensorsDType::kF32, {4}}, {"y", SafetensorsDType::kF32, {2}}};
  {
    auto w = SafetensorsWriter::Create(path, specs);
    ASSERT_TRUE(w.ok());
    const std::vector<float> part = {1, 2, 3};
    ASSERT_TRUE(w->Write(Bytes(part)).ok());
    Status s = w->Finish();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("'x' has 12 of its 16 bytes"), std::string::npos)
        << s.ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp")) << "abandoned file left";
  EXPECT_FALSE(std::filesystem::exists(path));

  auto w = SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(w.ok());
  const std::vector<float> a = {1, 2, 3}, b = {4, 5, 6};
  ASSERT_TRUE(w->Write(Bytes(a)).ok());  // spans x and y
  ASSERT_TRUE(w->Write(Bytes(b)).ok());
  EXPECT_EQ(w->Write(Bytes(a)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(w->Finish().ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(*file->ReadFloat32("x"), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(*file->ReadFloat32("y"), (std::vector<float>{5, 6}));
}

TEST(SafetensorsTest, WriterRejectsBadSpecs) {
  ScratchDir dir;
  const std::string p = dir.File("w.safetensors");
  using Specs = std::vector<SafetensorsTensorSpec>;
  EXPECT_EQ(
      SafetensorsWriter::Create(p, Specs{{"", SafetensorsDType::kF32, {1}}})
          .status()
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      SafetensorsWriter::Create(p, Specs{{"a", SafetensorsDType::kF32, {1}},
                                         {"a", SafetensorsDType::kF32, {1}}})
          .status()
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      SafetensorsWriter::Create(p, Specs{{"a", SafetensorsDType::kF32, {-1}}})
          .status()
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::Create(
                p, Specs{{"a", SafetensorsDType::kF64, {1LL << 62, 4}}})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  const std::vector<float> three = {1, 2, 3};
  std::vector<SafetensorsTensorData> t = {
      {{"a", SafetensorsDType::kF32, {2}}, Bytes(three)}};
  EXPECT_EQ(WriteSafetensors(p, t).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(p + ".tmp"));
}

struct Malformed {
  const char* name;
  std::string bytes;
  std::vector<std::string> message_has;  // all must appear in the message
};

std::string F32Header(const std::string& name, const std::string& shape,
                      const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"F32\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

std::vector<Malformed> MalformedFiles() {
  const std::string d8(8, '\1'), d16(16, '\1');
  return {
      {"shorter_than_length_field", "\4\0\0", {"shorter than the 8-byte"}},
      {"huge_header_length",
       SafetensorsBytes("{}", "", 1LL << 40),
       {"header length 1099511627776", "out of range"}},
      {"header_past_end",
       SafetensorsBytes("{}", "", 100),
       {"header length 100"}},
      {"truncated_data",
       SafetensorsBytes("{" + F32Header("w", "[4]", "[0,16]") + "}", d8),
       {"'w'", "run past the 8-byte data buffer"}},
      {"bad_json", SafetensorsBytes("{\"w\": {", ""), {"not valid JSON"}},
      {"not_an_object", SafetensorsBytes("[1,2]", ""), {"not an object"}},
      {"duplicate_name",
       SafetensorsBytes("{" + F32Header("w", "[2]", "[0,8]") + "," +
                            F32Header("w", "[2]", "[8,16]") + "}",
                        d16),
       {"'w' twice"}},
      {"unknown_dtype",
       SafetensorsBytes(
           R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", d8),
       {"'w'", "'Q4'", "F32", "BF16"}},
      {"missing_dtype",
       SafetensorsBytes(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", d8),
       {"'w'", "dtype"}},
      {"unknown_field",
       SafetensorsBytes(
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})",
           d8),
       {"'w'", "unknown field 'x'"}},
      {"negative_dim",
       SafetensorsBytes("{" + F32Header("w", "[-2]", "[0,8]") + "}", d8),
       {"'w'", "shape"}},
      {"fractional_offset",
       SafetensorsBytes("{" + F32Header("w", "[2]", "[0,8.5]") + "}", d8),
       {"'w'", "data_offsets"}},
      {"offsets_reversed",
       SafetensorsBytes("{" + F32Header("w", "[0]", "[8,0]") + "}", d8),
       {"'w'", "end before they begin"}},
      {"wrong_size",
       SafetensorsBytes("{" + F32Header("w", "[3]", "[0,8]") + "}", d8),
       {"'w'", "is 12 bytes", "span 8"}},
      {"shape_overflows",
       SafetensorsBytes(
           "{" + F32Header("w", "[4294967296,4294967296]", "[0,8]") + "}", d8),
       {"'w'", "overflows"}},
      {"overlapping",
       SafetensorsBytes("{" + F32Header("a", "[2]", "[0,8]") + "," +
                            F32Header("b", "[2]", "[4,12]") + "}",
                        std::string(12, '\1')),
       {"'a'", "'b'", "overlap"}},
      {"same_offsets",
       SafetensorsBytes("{" + F32Header("a", "[2]", "[0,8]") + "," +
                            F32Header("b", "[2]", "[0,8]") + "}",
                        d8),
       {"'a'", "'b'", "overlap"}},
      {"hole",
       SafetensorsBytes("{" + F32Header("a", "[1]", "[0,4]") + "," +
                            F32Header("b", "[1]", "[8,12]") + "}",
                        std::string(12, '\1')),
       {"bytes 4..8", "belong to no tensor", "'b'"}},
      {"trailing_bytes",
       SafetensorsBytes("{" + F32Header("a", "[1]", "[0,4]") + "}", d8),
       {"4 trailing bytes"}},
      {"metadata_not_strings",
       SafetensorsBytes(R"({"__metadata__":{"k":3}})", ""),
       {"__metadata__", "'k'"}},
  };
}

class MalformedTest : public ::testing::TestWithParam<Malformed> {};

TEST_P(MalformedTest, FailsAtOpenNamingFileAndTensor) {
  ScratchDir dir;
  const std::string path = dir.File("bad.safetensors");
  WriteBytes(path, GetParam().bytes);
  auto file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kCorruption)
      << file.status().ToString();
  const std::string msg(file.status().message());
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  for (const std::string& part : GetParam().message_has) {
    EXPECT_NE(msg.find(part), std::string::npos)
        << "'" << part << "' not in: " << msg;
  }
}

INSTANTIATE_TEST_SUITE_P(Files, MalformedTest,
                         ::testing::ValuesIn(MalformedFiles()),
                         [](const ::testing::TestParamInfo<Malformed>& i) {
                           return i.param.name;
                         });

TEST(SafetensorsTest, MissingFileAndDirectory) {
  ScratchDir dir;
  auto missing = SafetensorsFile::Open(dir.File("none.safetensors"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("none.safetensors"),
            std::string_view::npos);
  EXPECT_EQ(SafetensorsFile::Open(dir.path()).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, AcceptsHeaderPaddingAndEmptyFile) {
  ScratchDir dir;
  const std::string path = dir.File("pad.safetensors");
  WriteBytes(path, SafetensorsBytes("{}      ", ""));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE(file->tensors().empty());
}

// Found by fuzz/safetensors_header_fuzz.cc: numel() multiplied the
// dimensions in order, overflowing int64 before the zero.
TEST(SafetensorsTest, EmptyTensorWithHugeDimensionsHasNoElements) {
  ScratchDir dir;
  const std::string path = dir.File("empty.safetensors");
  WriteBytes(path, SafetensorsBytes(R"({"a":{"dtype":"U8","shape":)"
                                    R"([3,4611686018427387904,0],)"
                                    R"("data_offsets":[0,0]}})",
                                    ""));
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_EQ(file->tensors().size(), 1u);
  EXPECT_EQ(file->tensors()[0].numel(), 0);
  auto values = file->ReadFloat32("a");
  ASSERT_TRUE(values.ok()) << values.status().ToString();
  EXPECT_TRUE(values->empty());
}

// The header check Open runs, on a header held in memory.
TEST(SafetensorsTest, ParsesHeaderFromMemory) {
  auto h = ParseSafetensorsHeader(
      R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
      R"("a":{"dtype":"I16","shape":[2],"data_offsets":[0,4]},)"
      R"("__metadata__":{"k":"v"}})",
      8, "mem");
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].name, "a");
  EXPECT_EQ(h->tensors[1].name, "b");
  EXPECT_EQ(h->metadata.at("k"), "v");
  auto trailing = ParseSafetensorsHeader(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 9, "mem");
  EXPECT_EQ(trailing.status().code(), StatusCode::kCorruption);
  EXPECT_NE(trailing.status().message().find("mem: 5 trailing bytes"),
            std::string_view::npos)
      << trailing.status().ToString();
}

TEST(SafetensorsTest, ConvertToFloat32ChecksSizes) {
  const std::vector<uint16_t> h = {0x3c00, 0x7c00};  // 1, +inf
  std::vector<float> out(2);
  ASSERT_TRUE(ConvertToFloat32(SafetensorsDType::kF16, Bytes(h), out).ok());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_TRUE(std::isinf(out[1]));
  std::vector<float> three(3);
  EXPECT_EQ(ConvertToFloat32(SafetensorsDType::kF16, Bytes(h), three).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsDTypeFromName("F8_E4M3").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(*SafetensorsDTypeFromName("BF16"), SafetensorsDType::kBF16);
  EXPECT_EQ(SafetensorsDTypeName(SafetensorsDType::kBool), "BOOL");
}

}  // namespace
}  // namespace strata::finetune
