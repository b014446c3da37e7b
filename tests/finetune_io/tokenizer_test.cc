// Tokenizers: GPT-2's pre-tokenization pattern case by case, BPE with a tiny
// hand-made vocabulary and merge list, load errors, and the lossless round
// trip on arbitrary bytes.
#include "examples/finetune/io/tokenizer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tests/finetune_io/test_util.h"

namespace strata::finetune {
namespace {

using testing::ScratchDir;
using testing::Spell;
using testing::Tiny;
using testing::TinyMerges;
using testing::TinyVocab;
using testing::Utf8;
using testing::WriteBytes;

std::vector<std::string> Pieces(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : Gpt2PreTokenize(text)) out.emplace_back(p);
  return out;
}

using Strings = std::vector<std::string>;

TEST(Gpt2PreTokenizeTest, WordsSpacesAndContractions) {
  EXPECT_EQ(Pieces("Hello world"), (Strings{"Hello", " world"}));
  EXPECT_EQ(Pieces("I'm here's you'll we've they're it'd don't"),
            (Strings{"I", "'m", " here", "'s", " you", "'ll", " we", "'ve",
                     " they", "'re", " it", "'d", " don", "'t"}));
  // Contractions are lowercase only, and only at the start of a match.
  EXPECT_EQ(Pieces("'LL x''s"), (Strings{"'", "LL", " x", "''", "s"}));
  EXPECT_EQ(Pieces("abc123 456!? ..."),
            (Strings{"abc", "123", " 456", "!?", " ..."}));
  // A run of whitespace leaves its last space to the word after it.
  EXPECT_EQ(Pieces("  two  spaces\n\nend "),
            (Strings{" ", " two", " ", " spaces", "\n", "\n", "end", " "}));
  EXPECT_EQ(Pieces(" \nx"), (Strings{" ", "\n", "x"}));
  EXPECT_EQ(Pieces("a  1"), (Strings{"a", " ", " 1"}));
  EXPECT_EQ(Pieces("tab\tend\t\t"), (Strings{"tab", "\t", "end", "\t\t"}));
  EXPECT_EQ(Pieces(""), Strings{});
}

TEST(Gpt2PreTokenizeTest, NonAsciiAndInvalidBytes) {
  EXPECT_EQ(Pieces("café naïve"), (Strings{"café", " naïve"}));
  // General Punctuation (curly quotes, dashes) is punctuation.
  EXPECT_EQ(Pieces("“quoted”—yes"), (Strings{"“", "quoted", "”—", "yes"}));
  // No-break space is whitespace; superscript two is a number.
  EXPECT_EQ(Pieces("a\u00a0b x²"), (Strings{"a", "\u00a0", "b", " x", "²"}));
  EXPECT_EQ(Pieces("ab\xff\xfe"
                   "cd"),
            (Strings{"ab", "\xff\xfe", "cd"}));
  // A truncated sequence is invalid bytes, not a letter.
  EXPECT_EQ(Pieces("x\xc3"), (Strings{"x", "\xc3"}));
}

TEST(Gpt2ByteToUnicodeTest, MatchesGpt2Table) {
  EXPECT_EQ(Gpt2ByteToUnicode('A'), U'A');
  EXPECT_EQ(Gpt2ByteToUnicode(' '), 0x120u);   // 'Ġ'
  EXPECT_EQ(Gpt2ByteToUnicode('\n'), 0x10au);  // 'Ċ'
  EXPECT_EQ(Gpt2ByteToUnicode(0), 0x100u);
  EXPECT_EQ(Gpt2ByteToUnicode(0xad), 0x143u);  // the last of the 68
  EXPECT_EQ(Gpt2ByteToUnicode(0xe9), 0xe9u);
}

TEST(Gpt2BpeTest, EncodesWithMergeRanks) {
  auto t = Tiny();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->vocab_size(), 256 + 7 + 1);
  ASSERT_TRUE(t->document_separator().has_value());
  EXPECT_EQ(*t->document_separator(), 263);
  const auto id = [&](std::string_view bytes) {
    auto i = t->TokenOf(Spell(bytes));
    EXPECT_TRUE(i.has_value()) << bytes;
    return i.value_or(-1);
  };
  std::vector<TokenId> got;
  t->Encode("hello world", &got);
  EXPECT_EQ(got,
            (std::vector<TokenId>{id("hello"), id(" wor"), id("l"), id("d")}));
  got.clear();
  // Every occurrence of the best pair merges, left to right.
  t->Encode("lllll", &got);
  EXPECT_EQ(got, (std::vector<TokenId>{id("ll"), id("ll"), id("l")}));
  got.clear();
  // The cache returns the same as a fresh encoding.
  t->Encode("hello hello", &got);
  t->Encode("hello", &got);
  EXPECT_EQ(got, (std::vector<TokenId>{id("hello"), id(" "), id("hello"),
                                       id("hello")}));
  std::string text;
  ASSERT_TRUE(t->Decode(got, &text).ok());
  EXPECT_EQ(text, "hello hellohello");
  std::string eot;
  ASSERT_TRUE(t->Decode(std::vector<TokenId>{263}, &eot).ok());
  EXPECT_EQ(eot, "<|endoftext|>");
  EXPECT_EQ(t->Decode(std::vector<TokenId>{264}, &eot).code(),
            StatusCode::kOutOfRange);
}

TEST(Gpt2BpeTest, StreamCutIsAfterANewlineBeforeText) {
  auto t = Tiny();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->StreamCut("ab\ncd\n  x"), 3u);
  EXPECT_EQ(t->StreamCut("ab\n"), 0u);
  EXPECT_EQ(t->StreamCut("no newline"), 0u);
  ByteTokenizer b;
  EXPECT_EQ(b.StreamCut("anything"), 8u);
}

// Arbitrary bytes, weighted toward what makes pieces interesting.
std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  static const std::vector<std::string> kAtoms = {
      "he", "ll", "o",      " ",    "  ",   "\n",       "'s", "'",  "'ll", "1",
      "é",  "“",  "\u00a0", "\xff", "\xc3", "\xe2\x80", "w",  "or", "\t",  "Z"};
  std::string s;
  while (s.size() < n) {
    if (rng() % 3 == 0) {
      s.push_back(static_cast<char>(rng() & 0xff));
    } else {
      s += kAtoms[rng() % kAtoms.size()];
    }
  }
  return s;
}

TEST(TokenizerRoundTripTest, DecodeOfEncodeIsIdentityOnArbitraryBytes) {
  auto bpe = Tiny();
  ASSERT_NE(bpe, nullptr);
  ByteTokenizer bytes;
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const std::string x = RandomBytes(rng, rng() % 200);
    for (Tokenizer* t : {static_cast<Tokenizer*>(bpe.get()),
                         static_cast<Tokenizer*>(&bytes)}) {
      std::vector<TokenId> ids;
      t->Encode(x, &ids);
      std::string back;
      ASSERT_TRUE(t->Decode(ids, &back).ok());
      ASSERT_EQ(back, x) << t->name() << " trial " << trial;
      for (TokenId id : ids) ASSERT_LT(id, t->vocab_size());
    }
    // The pieces cover the text exactly.
    std::string joined;
    for (std::string_view p : Gpt2PreTokenize(x)) {
      ASSERT_FALSE(p.empty());
      joined += p;
    }
    ASSERT_EQ(joined, x);
  }
}

TEST(TokenizerRoundTripTest, EncodingAcrossAStreamCutEqualsWhole) {
  auto t = Tiny();
  ASSERT_NE(t, nullptr);
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string x = RandomBytes(rng, 50 + rng() % 200);
    const std::string y = RandomBytes(rng, rng() % 50);
    const size_t cut = t->StreamCut(x);
    if (cut == 0) continue;
    std::vector<TokenId> whole, parts;
    t->Encode(x + y, &whole);
    t->Encode(std::string_view(x).substr(0, cut), &parts);
    t->Encode(x.substr(cut) + y, &parts);
    ASSERT_EQ(parts, whole) << "trial " << trial;
  }
}

TEST(ByteTokenizerTest, TokensAreBytes) {
  ByteTokenizer t;
  std::vector<TokenId> ids;
  t.Encode(std::string("a\0\xff", 3), &ids);
  EXPECT_EQ(ids, (std::vector<TokenId>{97, 0, 255}));
  std::string s;
  EXPECT_EQ(t.Decode(std::vector<TokenId>{256}, &s).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(t.Decode(std::vector<TokenId>{-1}, &s).code(),
            StatusCode::kOutOfRange);
  EXPECT_FALSE(t.document_separator().has_value());
}

TEST(Gpt2BpeTest, LoadsFromFilesAndNamesThemInErrors) {
  ScratchDir dir;
  const std::string vocab = dir.File("vocab.json");
  const std::string merges = dir.File("merges.txt");
  WriteBytes(vocab, TinyVocab());
  WriteBytes(merges, TinyMerges());
  auto t = Gpt2BpeTokenizer::Load(vocab, merges);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->vocab_size(), 264);

  auto missing = Gpt2BpeTokenizer::Load(dir.File("none.json"), merges);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("none.json"), std::string::npos);

  WriteBytes(merges, TinyMerges() + Spell("x") + " " + Spell("y") + "\n");
  auto bad = Gpt2BpeTokenizer::Load(vocab, merges);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("merges.txt line 9"), std::string::npos)
      << bad.status().ToString();
}

struct BadTokenizer {
  const char* name;
  std::string vocab;
  std::string merges;
  std::string message_has;
};

TEST(Gpt2BpeTest, RejectsBadFiles) {
  nlohmann::json no_byte = nlohmann::json::parse(TinyVocab());
  no_byte["qq"] = no_byte["q"];  // the id stays, the byte loses its token
  no_byte.erase("q");
  nlohmann::json gap = nlohmann::json::parse(TinyVocab());
  gap["<|endoftext|>"] = 999;
  nlohmann::json dup = nlohmann::json::parse(TinyVocab());
  dup["<|endoftext|>"] = 0;
  const std::vector<BadTokenizer> cases = {
      {"bad_json", "{", TinyMerges(), "vocab.json is not valid JSON"},
      {"missing_byte", no_byte.dump(), "", "no token for byte 113"},
      {"id_out_of_range", gap.dump(), "", "has id 999"},
      {"duplicate_id", dup.dump(), "", "id 0 is given to two tokens"},
      {"three_fields", TinyVocab(), "#version: 0.2\nh e l\n",
       "merges.txt line 2"},
      {"merged_not_in_vocab", TinyVocab(), "#version: 0.2\na b\n",
       "merged is not in vocab.json"},
      {"repeated_merge", TinyVocab(), TinyMerges() + "l l\n",
       "line 9 repeats line 2"},
  };
  for (const BadTokenizer& c : cases) {
    auto t = Gpt2BpeTokenizer::FromContents(c.vocab, c.merges);
    ASSERT_FALSE(t.ok()) << c.name;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(t.status().message().find(c.message_has), std::string::npos)
        << c.name << ": " << t.status().ToString();
  }
}

}  // namespace
}  // namespace strata::finetune
