// Training data for the fine-tune example: a text file, or a directory of
// them, tokenized once into a compact token stream, split into a training
// part and an optional held-out part, and cut into batches of windows that a
// seed and the step number determine.
//
// A directory is walked recursively and its regular files are read in byte
// order of their paths (the same stream on every machine). Skipped: names
// starting with '.', symbolic links (not followed: no cycles, and no file
// read twice, as Debian's fortunes ships each file again as a ".u8" link),
// and files that look binary (a NUL byte in their first 8 KiB). A file named
// directly is read whatever it holds.
//
// Memory: files are read and tokenized a chunk at a time (DataOptions::
// read_chunk_bytes), and tokens are stored in the narrowest of 1, 2 or 4
// bytes that holds the vocabulary: a corpus of S bytes takes S bytes with the
// byte tokenizer, about 0.6 S with GPT-2 BPE. Chunks are cut only where
// Tokenizer::StreamCut allows, so the stream equals the tokenization of each
// file whole (unless a file offers no such place in 16 chunks, when the 16
// are encoded as they are). Between files the tokenizer's document separator,
// if it has one, is inserted.
#ifndef STRATA_EXAMPLES_FINETUNE_IO_DATA_H_
#define STRATA_EXAMPLES_FINETUNE_IO_DATA_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "examples/finetune/io/tokenizer.h"
#include "strata/status.h"

namespace strata::finetune {

struct DataOptions {
  // A text file or a directory (see above). Required.
  std::string path;
  // The fraction of the token stream, taken from its end, held out for
  // evaluation. Range [0, 0.5]; default 0 (no held-out part).
  double holdout_fraction = 0.0;
  // Bytes of text to read at most, over all files; 0 (default) reads all.
  uint64_t max_bytes = 0;
  // Bytes read and tokenized at a time. Range [4 KiB, 1 GiB]; default 4 MiB.
  size_t read_chunk_bytes = size_t{4} << 20;
};

// A contiguous range of a token stream; a view, valid while the dataset that
// made it lives. Thread-compatible (read-only, so concurrent reads are fine).
class TokenSpan {
 public:
  TokenSpan() = default;
  int64_t size() const { return size_; }
  TokenId operator[](int64_t i) const;
  // Copies tokens [begin, begin + out.size()) into out. REQUIRES: in range.
  void Copy(int64_t begin, std::span<TokenId> out) const;

 private:
  friend class TextDataset;
  TokenSpan(const uint8_t* data, int width, int64_t size)
      : data_(data), width_(width), size_(size) {}
  const uint8_t* data_ = nullptr;
  int width_ = 1;  // bytes per token
  int64_t size_ = 0;
};

// A tokenized corpus. Move-only (spans point into it); thread-compatible.
class TextDataset {
 public:
  // Reads and tokenizes options.path with `tokenizer`. kNotFound naming the
  // path when it does not exist; kInvalidArgument for bad options, for a
  // directory with no text file (saying how many binary files it skipped),
  // and for data that gives no token; kIoError etc. from reading, with the
  // file.
  static StatusOr<TextDataset> Load(const DataOptions& options,
                                    Tokenizer* tokenizer);

  TextDataset(TextDataset&&) noexcept = default;
  TextDataset& operator=(TextDataset&&) noexcept = default;
  TextDataset(const TextDataset&) = delete;
  TextDataset& operator=(const TextDataset&) = delete;

  // The files read, in order, and those skipped as binary.
  const std::vector<std::string>& files() const { return files_; }
  const std::vector<std::string>& skipped_files() const { return skipped_; }
  uint64_t text_bytes() const { return text_bytes_; }
  int64_t total_tokens() const;
  // The first (1 - holdout_fraction) of the stream, and the rest.
  TokenSpan train() const;
  TokenSpan holdout() const;

 private:
  TextDataset() = default;
  std::vector<std::string> files_;
  std::vector<std::string> skipped_;
  uint64_t text_bytes_ = 0;
  std::vector<uint8_t> tokens_;  // width_ bytes per token, native order
  int width_ = 1;
  int64_t train_tokens_ = 0;
};

// The regular text files under `path` in reading order, as Load walks them
// (a file path gives itself); the binary-looking ones go to *skipped.
StatusOr<std::vector<std::string>> ListTextFiles(
    const std::string& path, std::vector<std::string>* skipped);

// Batches of [batch, seq_len + 1] tokens: row b is a window of the span
// starting at a position drawn uniformly from [0, size - seq_len - 1] by a
// hash of (seed, step, b). A batch depends on nothing else, so a resumed run
// sees the batches it would have seen, and the input and target of a step
// are a row's first and last seq_len tokens. Copyable; holds a TokenSpan (the
// dataset must outlive it); thread-compatible, and Fill is const.
class BatchSampler {
 public:
  // kInvalidArgument when batch or seq_len < 1, or when the span is shorter
  // than seq_len + 1 (naming both).
  static StatusOr<BatchSampler> Create(TokenSpan tokens, int64_t batch,
                                       int64_t seq_len, uint64_t seed);

  int64_t batch() const { return batch_; }
  int64_t seq_len() const { return seq_len_; }
  // Fills out (batch * (seq_len + 1) tokens, row-major) with batch `step`.
  // kInvalidArgument when out has another size.
  Status Fill(int64_t step, std::span<TokenId> out) const;

 private:
  BatchSampler() = default;
  TokenSpan tokens_;
  int64_t batch_ = 0;
  int64_t seq_len_ = 0;
  uint64_t seed_ = 0;
};

}  // namespace strata::finetune

#endif  // STRATA_EXAMPLES_FINETUNE_IO_DATA_H_
