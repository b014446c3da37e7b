// Tokenizers for the fine-tune example: byte-level (the default, vocabulary
// 256, token = byte) and GPT-2's byte-level BPE from the vocab.json and
// merges.txt that Hugging Face publishes with GPT-2.
//
// Both are lossless on arbitrary bytes: Decode(Encode(x)) == x, including
// invalid UTF-8.
//
// GPT-2 BPE, as OpenAI's encoder.py does it:
//  1. Pre-tokenization splits the text with GPT-2's pattern
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
//       ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     implemented by hand (no regex library), with leftmost-first alternation
//     and the backtracking of \s+(?!\S) (a run of spaces before a word leaves
//     its last space to the word).
//  2. Each piece's bytes become the printable characters of GPT-2's
//     byte-to-unicode table, and the merges apply lowest rank first (every
//     occurrence of the best pair, left to right), until none applies.
//  3. The resulting symbols are looked up in vocab.json.
// The Unicode categories are approximated, exactly so for ASCII and Latin-1:
// \s is ASCII whitespace plus Unicode's White_Space code points; \p{N} is the
// ASCII digits plus Latin-1's superscripts and fractions; \p{L} is ASCII and
// Latin-1 letters and every other non-ASCII code point except the General
// Punctuation (U+2000-U+206F) and CJK Symbols and Punctuation (U+3000-U+303F)
// blocks, which count as punctuation. So digits of other scripts count as
// letters, and symbols outside those blocks (e.g. emoji, math) as letters; for
// English text the result is GPT-2's. A byte that is not part of valid UTF-8
// counts as punctuation, one piece per run.
#ifndef STRATA_EXAMPLES_FINETUNE_IO_TOKENIZER_H_
#define STRATA_EXAMPLES_FINETUNE_IO_TOKENIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "strata/status.h"

namespace strata::finetune {

// Token ids: below vocab_size(), which fits int32 for every tokenizer here.
using TokenId = int32_t;

// A tokenizer. Thread-compatible: Encode may update a cache, so one thread at
// a time per object (or one object per thread); const methods may run
// concurrently.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // "bytes" or "gpt2-bpe".
  virtual std::string_view name() const = 0;
  virtual int64_t vocab_size() const = 0;
  // Appends the tokens of `text` to *out. Never fails: every byte sequence
  // has an encoding.
  virtual void Encode(std::string_view text, std::vector<TokenId>* out) = 0;
  // Appends the bytes of `ids` to *out. kOutOfRange naming the first id
  // outside [0, vocab_size()).
  virtual Status Decode(std::span<const TokenId> ids,
                        std::string* out) const = 0;
  // The token that separates documents (GPT-2's <|endoftext|>), if any.
  virtual std::optional<TokenId> document_separator() const = 0;
  // Where a text being streamed may be cut: the largest k such that encoding
  // text[0, k) and then the rest gives the tokens of the whole, whatever
  // follows `text`; 0 when no such cut is known in `text`.
  virtual size_t StreamCut(std::string_view text) const = 0;
};

// Token = byte: vocabulary 256, no separator.
class ByteTokenizer final : public Tokenizer {
 public:
  std::string_view name() const override { return "bytes"; }
  int64_t vocab_size() const override { return 256; }
  void Encode(std::string_view text, std::vector<TokenId>* out) override;
  Status Decode(std::span<const TokenId> ids, std::string* out) const override;
  std::optional<TokenId> document_separator() const override {
    return std::nullopt;
  }
  size_t StreamCut(std::string_view text) const override { return text.size(); }
};

// GPT-2's byte-to-unicode table: the code point that stands for each byte in
// vocab.json and merges.txt. Printable Latin-1 bytes ('!'..'~', 0xA1..0xAC,
// 0xAE..0xFF) stand for themselves; the other 68 map to 256, 257, ... in
// byte order (so ' ' is U+0120 'Ġ' and '\n' is U+010A 'Ċ').
char32_t Gpt2ByteToUnicode(uint8_t byte);

// Splits `text` with GPT-2's pre-tokenization pattern (see above); the pieces
// are contiguous and cover the text.
std::vector<std::string_view> Gpt2PreTokenize(std::string_view text);

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  // Loads vocab.json (token string -> id, ids dense 0..n-1) and merges.txt
  // ("#version" line optional, then one "a b" pair per line, highest
  // priority first). Errors name the file and the entry or line:
  // kNotFound/kIoError from reading, kInvalidArgument for content (bad JSON,
  // ids not dense, a byte without a token, a merge whose parts or result are
  // not in the vocabulary).
  static StatusOr<std::unique_ptr<Gpt2BpeTokenizer>> Load(
      const std::string& vocab_json_path, const std::string& merges_txt_path);
  // The same from the files' contents; `vocab_name` and `merges_name` are
  // what errors call them.
  static StatusOr<std::unique_ptr<Gpt2BpeTokenizer>> FromContents(
      std::string_view vocab_json, std::string_view merges_txt,
      std::string_view vocab_name = "vocab.json",
      std::string_view merges_name = "merges.txt");

  std::string_view name() const override { return "gpt2-bpe"; }
  int64_t vocab_size() const override {
    return static_cast<int64_t>(bytes_of_.size());
  }
  void Encode(std::string_view text, std::vector<TokenId>* out) override;
  Status Decode(std::span<const TokenId> ids, std::string* out) const override;
  std::optional<TokenId> document_separator() const override {
    return separator_;
  }
  // After the last newline that a printable ASCII character follows: the
  // pattern always ends a piece there (no alternative runs from whitespace
  // into such a character) and a piece's extent depends only on what
  // follows its start.
  size_t StreamCut(std::string_view text) const override;
  // The id of a token string as vocab.json spells it, or nullopt.
  std::optional<TokenId> TokenOf(std::string_view vocab_string) const;

 private:
  Gpt2BpeTokenizer() = default;
  // BPE of one pre-tokenized piece.
  void EncodePiece(std::string_view piece, std::vector<TokenId>* out) const;

  // Lets the maps keyed by std::string be searched with a string_view.
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const {
      return std::hash<std::string_view>{}(s);
    }
  };
  struct PairHash {
    size_t operator()(uint64_t k) const { return k * 0x9e3779b97f4a7c15ull; }
  };
  struct Merge {
    uint32_t rank;
    TokenId result;
  };

  std::vector<std::string> bytes_of_;  // id -> its raw bytes
  // vocab.json spelling -> id
  std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>> ids_;
  TokenId byte_token_[256] = {};  // byte -> its one-byte token
  std::unordered_map<uint64_t, Merge, PairHash> merges_;  // (a << 32 | b)
  std::optional<TokenId> separator_;
  // Encoded pieces; cleared when it reaches kMaxCacheEntries.
  std::unordered_map<std::string, std::vector<TokenId>, StringHash,
                     std::equal_to<>>
      cache_;
};

}  // namespace strata::finetune

#endif  // STRATA_EXAMPLES_FINETUNE_IO_TOKENIZER_H_
