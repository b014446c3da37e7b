// Training data: the directory walk (order, hidden files, links, binary
// files), tokenization in chunks equal to whole files, token widths, the
// held-out split, deterministic batches, errors, and the default corpus.
#include "examples/finetune/io/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "examples/finetune/io/corpus.h"
#include "tests/finetune_io/test_util.h"

namespace strata::finetune {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;
using testing::Tiny;
using testing::WriteBytes;

std::vector<TokenId> All(TokenSpan s) {
  std::vector<TokenId> v(s.size());
  s.Copy(0, v);
  return v;
}

std::vector<TokenId> Ids(std::string_view text) {
  return std::vector<TokenId>(
      reinterpret_cast<const uint8_t*>(text.data()),
      reinterpret_cast<const uint8_t*>(text.data()) + text.size());
}

// A tree with every kind of entry the walk must order or skip.
void MakeTree(const ScratchDir& d) {
  fs::create_directories(d.File("sub/deeper"));
  fs::create_directories(d.File(".git"));
  WriteBytes(d.File("b.txt"), "bee\n");
  WriteBytes(d.File("a.txt"), "ay\n");
  WriteBytes(d.File("sub/deeper/c"), "sea\n");
  WriteBytes(d.File("sub/Z"), "zed\n");
  WriteBytes(d.File("empty"), "");
  WriteBytes(d.File(".hidden"), "no\n");
  WriteBytes(d.File(".git/config"), "no\n");
  WriteBytes(d.File("index.dat"), std::string("\0\0\0\2abc", 7));
  fs::create_symlink(d.File("a.txt"), d.File("a.txt.u8"));
  fs::create_directory_symlink(d.File("sub"), d.File("loop"));
}

TEST(DataTest, DirectoryWalkIsSortedAndSkipsHiddenLinksAndBinary) {
  ScratchDir d;
  MakeTree(d);
  std::vector<std::string> skipped;
  auto files = ListTextFiles(d.path(), &skipped);
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ(*files, (std::vector<std::string>{d.File("a.txt"), d.File("b.txt"),
                                              d.File("empty"), d.File("sub/Z"),
                                              d.File("sub/deeper/c")}));
  EXPECT_EQ(skipped, std::vector<std::string>{d.File("index.dat")});

  ByteTokenizer bytes;
  auto data = TextDataset::Load({.path = d.path()}, &bytes);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_EQ(All(data->train()), Ids("ay\nbee\nzed\nsea\n"));
  EXPECT_EQ(data->text_bytes(), 15u);
  EXPECT_EQ(data->skipped_files().size(), 1u);
  EXPECT_EQ(data->holdout().size(), 0);
}

TEST(DataTest, NamedFileIsReadWhateverItHolds) {
  ScratchDir d;
  const std::string path = d.File("bin");
  WriteBytes(path, std::string("a\0b", 3));
  ByteTokenizer bytes;
  auto data = TextDataset::Load({.path = path}, &bytes);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_EQ(All(data->train()), (std::vector<TokenId>{'a', 0, 'b'}));
}

TEST(DataTest, ErrorsNameThePath) {
  ScratchDir d;
  ByteTokenizer bytes;
  auto missing = TextDataset::Load({.path = d.File("nope")}, &bytes);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(d.File("nope")), std::string::npos);

  fs::create_directory(d.File("bin"));
  WriteBytes(d.File("bin/x.dat"), std::string("\0", 1));
  auto binary = TextDataset::Load({.path = d.File("bin")}, &bytes);
  EXPECT_EQ(binary.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(binary.status().message().find("1 binary-looking files skipped"),
            std::string::npos)
      << binary.status().ToString();

  fs::create_directory(d.File("empty"));
  WriteBytes(d.File("empty/a"), "");
  auto empty = TextDataset::Load({.path = d.File("empty")}, &bytes);
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.status().message().find("holds no text"), std::string::npos)
      << empty.status().ToString();

  WriteBytes(d.File("t"), "text");
  EXPECT_EQ(
      TextDataset::Load({.path = d.File("t"), .holdout_fraction = 0.6}, &bytes)
          .status()
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(
      TextDataset::Load({.path = d.File("t"), .read_chunk_bytes = 16}, &bytes)
          .status()
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(TextDataset::Load({.path = ""}, &bytes).status().code(),
            StatusCode::kInvalidArgument);
}

// Many lines of text the tiny vocabulary merges, some very long.
std::string Corpus(size_t lines) {
  std::string s;
  for (size_t i = 0; i < lines; ++i) {
    s += (i % 7 == 0) ? "  hello world's " : "hello, world\t";
    s += std::to_string(i);
    if (i % 50 == 0) s += std::string(600, 'l');
    s += (i % 5 == 0) ? "\n\n" : "\n";
  }
  return s;
}

TEST(DataTest, ChunkedBpeEqualsWholeFilesWithSeparators) {
  ScratchDir d;
  const std::string one = Corpus(2000), two = Corpus(300);
  WriteBytes(d.File("1.txt"), one);
  WriteBytes(d.File("2.txt"), two);
  auto t = Tiny();
  ASSERT_NE(t, nullptr);
  std::vector<TokenId> want;
  t->Encode(one, &want);
  want.push_back(*t->document_separator());
  t->Encode(two, &want);

  auto data =
      TextDataset::Load({.path = d.path(), .read_chunk_bytes = 4096}, t.get());
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_GT(one.size(), 10u * 4096) << "the test needs many chunks";
  EXPECT_EQ(All(data->train()), want);
}

TEST(DataTest, MaxBytesStopsReading) {
  ScratchDir d;
  WriteBytes(d.File("a"), "0123456789");
  WriteBytes(d.File("b"), "abcdef");
  ByteTokenizer bytes;
  auto data = TextDataset::Load({.path = d.path(), .max_bytes = 12}, &bytes);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_EQ(All(data->train()), Ids("0123456789ab"));
  EXPECT_EQ(data->files().size(), 2u);
  data = TextDataset::Load({.path = d.path(), .max_bytes = 10}, &bytes);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(data->files(), std::vector<std::string>{d.File("a")});
}

// Maps byte b to b * 300 + 1: ids up to 76501 need 4-byte storage.
class WideTokenizer final : public Tokenizer {
 public:
  std::string_view name() const override { return "wide"; }
  int64_t vocab_size() const override { return 100000; }
  void Encode(std::string_view text, std::vector<TokenId>* out) override {
    for (char c : text) out->push_back(static_cast<uint8_t>(c) * 300 + 1);
  }
  Status Decode(std::span<const TokenId>, std::string*) const override {
    return Status::NotSupported("test tokenizer");
  }
  std::optional<TokenId> document_separator() const override {
    return std::nullopt;
  }
  size_t StreamCut(std::string_view text) const override { return text.size(); }
};

TEST(DataTest, TokenWidthsHoldEveryId) {
  ScratchDir d;
  WriteBytes(d.File("f"), "\xff\x01z");
  WideTokenizer wide;
  auto data = TextDataset::Load({.path = d.File("f")}, &wide);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(All(data->train()),
            (std::vector<TokenId>{255 * 300 + 1, 301, 'z' * 300 + 1}));
  EXPECT_EQ(data->train()[0], 255 * 300 + 1);
  auto t = Tiny();
  WriteBytes(d.File("g"), "hello");
  data = TextDataset::Load({.path = d.File("g")}, t.get());
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(All(data->train()), std::vector<TokenId>{*t->TokenOf("hello")});
}

// Token = position in the stream (vocabulary 100000), so a window's first
// token is its start.
class CountingTokenizer final : public Tokenizer {
 public:
  std::string_view name() const override { return "counting"; }
  int64_t vocab_size() const override { return 100000; }
  void Encode(std::string_view text, std::vector<TokenId>* out) override {
    for (size_t i = 0; i < text.size(); ++i) out->push_back(next_++);
  }
  Status Decode(std::span<const TokenId>, std::string*) const override {
    return Status::NotSupported("test tokenizer");
  }
  std::optional<TokenId> document_separator() const override {
    return std::nullopt;
  }
  size_t StreamCut(std::string_view text) const override { return text.size(); }

 private:
  TokenId next_ = 0;
};

// 1000 tokens 0, 1, ..., 999.
StatusOr<TextDataset> Counting(const ScratchDir& d, double holdout) {
  WriteBytes(d.File("count"), std::string(1000, 'x'));
  CountingTokenizer counting;
  return TextDataset::Load(
      {.path = d.File("count"), .holdout_fraction = holdout}, &counting);
}

TEST(DataTest, HoldoutIsTheEndOfTheStream) {
  ScratchDir d;
  auto data = Counting(d, 0.25);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(data->total_tokens(), 1000);
  EXPECT_EQ(data->train().size(), 750);
  EXPECT_EQ(data->holdout().size(), 250);
  EXPECT_EQ(data->holdout()[0], 750);
  EXPECT_EQ(data->train()[749], 749);
}

TEST(BatchSamplerTest, BatchesAreWindowsFixedBySeedAndStep) {
  ScratchDir d;
  auto data = Counting(d, 0.0);
  ASSERT_TRUE(data.ok());
  constexpr int64_t kB = 4, kT = 16;
  auto s = BatchSampler::Create(data->train(), kB, kT, 42);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<TokenId> a(kB * (kT + 1)), b(a.size()), c(a.size());
  ASSERT_TRUE(s->Fill(3, a).ok());
  ASSERT_TRUE(s->Fill(3, b).ok());
  EXPECT_EQ(a, b) << "same seed and step";
  ASSERT_TRUE(s->Fill(4, c).ok());
  EXPECT_NE(a, c) << "another step";
  auto other = BatchSampler::Create(data->train(), kB, kT, 43);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(other->Fill(3, c).ok());
  EXPECT_NE(a, c) << "another seed";

  int64_t lo = 1000, hi = -1;
  for (int64_t step = 0; step < 500; ++step) {
    ASSERT_TRUE(s->Fill(step, a).ok());
    for (int64_t r = 0; r < kB; ++r) {
      // Each row is the window of the stream at its first token.
      const TokenId first = a[r * (kT + 1)];
      for (int64_t k = 1; k <= kT; ++k) {
        ASSERT_EQ(a[r * (kT + 1) + k], first + k);
      }
      lo = std::min<int64_t>(lo, first);
      hi = std::max<int64_t>(hi, first);
    }
  }
  EXPECT_LT(lo, 20) << "starts reach the beginning";
  EXPECT_GT(hi, 1000 - kT - 1 - 20) << "and the end";
  EXPECT_LE(hi, 1000 - kT - 1);
}

TEST(BatchSamplerTest, Errors) {
  ScratchDir d;
  auto data = Counting(d, 0.0);
  ASSERT_TRUE(data.ok());
  EXPECT_EQ(BatchSampler::Create(data->train(), 0, 8, 1).status().code(),
            StatusCode::kInvalidArgument);
  auto short_span = BatchSampler::Create(data->train(), 1, 1000, 1);
  EXPECT_EQ(short_span.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_span.status().message().find("1000 tokens"),
            std::string::npos)
      << short_span.status().ToString();
  // A window of exactly the whole span is allowed.
  auto whole = BatchSampler::Create(data->train(), 2, 999, 1);
  ASSERT_TRUE(whole.ok());
  std::vector<TokenId> out(2 * 1000);
  ASSERT_TRUE(whole->Fill(0, out).ok());
  EXPECT_EQ(out[0], 0);
  EXPECT_EQ(out[1999], 999);
  std::vector<TokenId> wrong(5);
  EXPECT_EQ(whole->Fill(0, wrong).code(), StatusCode::kInvalidArgument);
}

TEST(CorpusTest, DefaultCorpusIsInstalledAndReadable) {
  auto path = DefaultCorpusPath();
  ASSERT_TRUE(path.ok()) << path.status().ToString()
                         << " (scripts/install-deps.sh installs it)";
  ByteTokenizer bytes;
  auto data = TextDataset::Load({.path = *path}, &bytes);
  ASSERT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_GT(data->text_bytes(), 2u << 20) << "a few MB of text";
  EXPECT_FALSE(data->skipped_files().empty()) << "the strfile indexes";
  for (const std::string& f : data->files()) {
    EXPECT_FALSE(f.ends_with(".dat") || f.ends_with(".u8")) << f;
  }
}

TEST(CorpusTest, AbsentCorpusSaysHowToInstallIt) {
  ScratchDir d;
  auto absent = DefaultCorpusPath(d.path());
  ASSERT_FALSE(absent.ok());
  EXPECT_EQ(absent.status().code(), StatusCode::kNotFound);
  const std::string msg(absent.status().message());
  EXPECT_NE(msg.find("'fortunes'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("scripts/install-deps.sh"), std::string::npos) << msg;

  fs::create_directories(d.File("usr/share/games/fortunes"));
  WriteBytes(d.File("usr/share/games/fortunes/cookie"), "A fortune.\n");
  auto present = DefaultCorpusPath(d.path());
  ASSERT_TRUE(present.ok()) << present.status().ToString();
  EXPECT_EQ(fs::path(*present), fs::path(d.File("usr/share/games/fortunes")));
}

}  // namespace
}  // namespace strata::finetune
