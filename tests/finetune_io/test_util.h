// Helpers for the fine-tune input-layer tests: hand-built safetensors bytes
// (so malformed files can be made) and small files.
#ifndef STRATA_TESTS_FINETUNE_IO_TEST_UTIL_H_
#define STRATA_TESTS_FINETUNE_IO_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <memory>
#include <nlohmann/json.hpp>
#include <utility>

#include "examples/finetune/io/tokenizer.h"
#include "tests/swap/test_util.h"

namespace strata::finetune::testing {

using ::strata::testing::ScratchDir;

inline void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A safetensors file as bytes: the little-endian length of `header`, the
// header, then `data`. `length` overrides the length field.
inline std::string SafetensorsBytes(const std::string& header,
                                    const std::string& data,
                                    int64_t length = -1) {
  uint64_t n = length < 0 ? header.size() : static_cast<uint64_t>(length);
  std::string out;
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>(n & 0xff));
    n >>= 8;
  }
  return out + header + data;
}

// UTF-8 of a code point below U+10000.
inline std::string Utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    s.push_back(static_cast<char>(0xc0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    s.push_back(static_cast<char>(0xe0 | (c >> 12)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
  return s;
}

// vocab.json spelling of raw bytes.
inline std::string Spell(std::string_view bytes) {
  std::string s;
  for (char c : bytes) s += Utf8(Gpt2ByteToUnicode(static_cast<uint8_t>(c)));
  return s;
}

inline const std::vector<std::pair<std::string, std::string>> kMerges = {
    {"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"},
    {" ", "w"}, {"o", "r"}, {" w", "or"},
};

// The 256 byte tokens, the merge results, and <|endoftext|>.
inline std::string TinyVocab() {
  nlohmann::json v = nlohmann::json::object();
  int id = 0;
  for (int b = 0; b < 256; ++b) {
    v[Utf8(Gpt2ByteToUnicode(static_cast<uint8_t>(b)))] = id++;
  }
  for (const auto& [a, b] : kMerges) v[Spell(a + b)] = id++;
  v["<|endoftext|>"] = id++;
  return v.dump();
}

inline std::string TinyMerges() {
  std::string m = "#version: 0.2\n";
  for (const auto& [a, b] : kMerges) m += Spell(a) + " " + Spell(b) + "\n";
  return m;
}

// A GPT-2 BPE tokenizer with a tiny hand-made vocabulary: the 256 byte
// tokens (ids 0..255 in byte order), one per merge of kMerges (256..262) and
// <|endoftext|> (263).
inline std::unique_ptr<Gpt2BpeTokenizer> Tiny() {
  auto t = Gpt2BpeTokenizer::FromContents(TinyVocab(), TinyMerges());
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

}  // namespace strata::finetune::testing

#endif  // STRATA_TESTS_FINETUNE_IO_TEST_UTIL_H_
