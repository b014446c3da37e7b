#include "examples/finetune/io/data.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace strata::finetune {
namespace {

namespace fs = std::filesystem;

// How much of a file decides whether it looks binary.
constexpr size_t kSniffBytes = 8192;
// A chunk with no place to cut grows to at most this many read chunks before
// it is encoded as it is (a file of one enormous line).
constexpr size_t kMaxChunksWithoutCut = 16;

// An open file for reading; closes on destruction.
class InFile {
 public:
  static StatusOr<InFile> Open(const std::string& path) {
    InFile f;
    f.path_ = path;
    f.fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd_ < 0) return Status::FromErrno(errno, "opening " + path);
    return f;
  }
  InFile(InFile&& o) noexcept
      : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {}
  InFile& operator=(InFile&&) = delete;
  ~InFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Reads up to n bytes appended to *out; 0 appended means end of file.
  StatusOr<size_t> Read(size_t n, std::string* out) {
    const size_t old = out->size();
    out->resize(old + n);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::read(fd_, out->data() + old + done, n - done);
      if (r < 0) {
        if (errno == EINTR) continue;
        out->resize(old);
        return Status::FromErrno(errno, "reading " + path_);
      }
      if (r == 0) break;
      done += static_cast<size_t>(r);
    }
    out->resize(old + done);
    return done;
  }

 private:
  InFile() = default;
  std::string path_;
  int fd_ = -1;
};

StatusOr<bool> LooksBinary(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(InFile f, InFile::Open(path));
  std::string head;
  STRATA_RETURN_IF_ERROR(f.Read(kSniffBytes, &head).status());
  return head.find('\0') != std::string::npos;
}

int WidthFor(int64_t vocab) {
  if (vocab <= 256) return 1;
  if (vocab <= 65536) return 2;
  return 4;
}

// Appends ids to a store of `width`-byte tokens.
void Append(const std::vector<TokenId>& ids, int width,
            std::vector<uint8_t>* store) {
  const size_t old = store->size();
  store->resize(old + ids.size() * width);
  uint8_t* p = store->data() + old;
  for (TokenId id : ids) {
    const auto v = static_cast<uint32_t>(id);
    if (width == 1) {
      *p = static_cast<uint8_t>(v);
    } else if (width == 2) {
      const auto h = static_cast<uint16_t>(v);
      std::memcpy(p, &h, 2);
    } else {
      std::memcpy(p, &v, 4);
    }
    p += width;
  }
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

TokenId TokenSpan::operator[](int64_t i) const {
  const uint8_t* p = data_ + i * width_;
  if (width_ == 1) return *p;
  if (width_ == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p, 4);
  return static_cast<TokenId>(v);
}

void TokenSpan::Copy(int64_t begin, std::span<TokenId> out) const {
  const uint8_t* p = data_ + begin * width_;
  if (width_ == 1) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else if (width_ == 2) {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    }
  } else {
    std::memcpy(out.data(), p, out.size() * 4);
  }
}

StatusOr<std::vector<std::string>> ListTextFiles(
    const std::string& path, std::vector<std::string>* skipped) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) {
    return Status::NotFound("data path '" + path + "' does not exist");
  }
  if (fs::is_regular_file(st)) return std::vector<std::string>{path};
  if (!fs::is_directory(st)) {
    return Status::InvalidArgument("data path '" + path +
                                   "' is neither a regular file nor a "
                                   "directory");
  }
  std::vector<std::string> candidates;
  fs::recursive_directory_iterator it(path, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const fs::directory_entry& e = *it;
    const std::string name = e.path().filename().string();
    std::error_code eec;
    if (name.starts_with(".")) {
      if (e.is_directory(eec)) it.disable_recursion_pending();
      continue;
    }
    if (e.is_symlink(eec)) continue;
    if (e.is_regular_file(eec)) candidates.push_back(e.path().string());
  }
  if (ec) {
    return Status::FromErrno(ec.value(),
                             "walking the data directory '" + path + "'");
  }
  std::sort(candidates.begin(), candidates.end());
  std::vector<std::string> files;
  for (std::string& f : candidates) {
    STRATA_ASSIGN_OR_RETURN(bool binary, LooksBinary(f));
    (binary ? *skipped : files).push_back(std::move(f));
  }
  return files;
}

StatusOr<TextDataset> TextDataset::Load(const DataOptions& options,
                                        Tokenizer* tokenizer) {
  if (options.path.empty()) {
    return Status::InvalidArgument("no data path given");
  }
  if (!(options.holdout_fraction >= 0.0 && options.holdout_fraction <= 0.5)) {
    return Status::InvalidArgument("holdout fraction " +
                                   std::to_string(options.holdout_fraction) +
                                   " is outside [0, 0.5]");
  }
  if (options.read_chunk_bytes < 4096 ||
      options.read_chunk_bytes > (1u << 30)) {
    return Status::InvalidArgument("read chunk of " +
                                   std::to_string(options.read_chunk_bytes) +
                                   " bytes is outside [4096, 1073741824]");
  }
  TextDataset d;
  STRATA_ASSIGN_OR_RETURN(d.files_, ListTextFiles(options.path, &d.skipped_));
  if (d.files_.empty()) {
    return Status::InvalidArgument(
        "data directory '" + options.path + "' holds no text file (" +
        std::to_string(d.skipped_.size()) + " binary-looking files skipped)");
  }
  d.width_ = WidthFor(tokenizer->vocab_size());
  const std::optional<TokenId> separator = tokenizer->document_separator();
  uint64_t budget = options.max_bytes == 0 ? UINT64_MAX : options.max_bytes;
  std::vector<TokenId> ids;
  std::string buf;
  bool any_text = false;
  size_t files_read = 0;
  for (const std::string& path : d.files_) {
    if (budget == 0) break;
    ++files_read;
    STRATA_ASSIGN_OR_RETURN(InFile f, InFile::Open(path));
    buf.clear();
    bool eof = false;
    bool started = false;
    while (!eof || !buf.empty()) {
      size_t got = 0;
      if (!eof) {
        const size_t want = static_cast<size_t>(
            std::min<uint64_t>(options.read_chunk_bytes, budget));
        STRATA_ASSIGN_OR_RETURN(got, f.Read(want, &buf));
        budget -= got;
        d.text_bytes_ += got;
        eof = got < want || budget == 0;
      }
      size_t cut = eof ? buf.size() : tokenizer->StreamCut(buf);
      if (cut == 0) {
        if (buf.size() < kMaxChunksWithoutCut * options.read_chunk_bytes) {
          continue;  // read more before encoding
        }
        cut = buf.size();
      }
      if (!started && separator && any_text) {
        ids.push_back(*separator);
      }
      started = true;
      any_text = true;
      tokenizer->Encode(std::string_view(buf).substr(0, cut), &ids);
      buf.erase(0, cut);
      Append(ids, d.width_, &d.tokens_);
      ids.clear();
    }
  }
  d.files_.resize(files_read);
  const int64_t total = d.total_tokens();
  if (total == 0) {
    return Status::InvalidArgument(
        "data path '" + options.path + "' holds no text (" +
        std::to_string(d.files_.size()) + " files, all empty)");
  }
  const auto held = static_cast<int64_t>(static_cast<double>(total) *
                                         options.holdout_fraction);
  d.train_tokens_ = total - held;
  return d;
}

int64_t TextDataset::total_tokens() const {
  return static_cast<int64_t>(tokens_.size() / width_);
}

TokenSpan TextDataset::train() const {
  return TokenSpan(tokens_.data(), width_, train_tokens_);
}

TokenSpan TextDataset::holdout() const {
  return TokenSpan(tokens_.data() + train_tokens_ * width_, width_,
                   total_tokens() - train_tokens_);
}

StatusOr<BatchSampler> BatchSampler::Create(TokenSpan tokens, int64_t batch,
                                            int64_t seq_len, uint64_t seed) {
  if (batch < 1 || seq_len < 1) {
    return Status::InvalidArgument(
        "batch " + std::to_string(batch) + " and sequence length " +
        std::to_string(seq_len) + " must both be at least 1");
  }
  if (tokens.size() < seq_len + 1) {
    return Status::InvalidArgument(
        "the data has " + std::to_string(tokens.size()) +
        " tokens, fewer than one window of sequence length + 1 = " +
        std::to_string(seq_len + 1));
  }
  BatchSampler s;
  s.tokens_ = tokens;
  s.batch_ = batch;
  s.seq_len_ = seq_len;
  s.seed_ = seed;
  return s;
}

Status BatchSampler::Fill(int64_t step, std::span<TokenId> out) const {
  const auto row = static_cast<size_t>(seq_len_ + 1);
  if (out.size() != static_cast<size_t>(batch_) * row) {
    return Status::InvalidArgument(
        "batch buffer holds " + std::to_string(out.size()) + " tokens, not " +
        std::to_string(batch_) + " x " + std::to_string(row));
  }
  // Starts are uniform over [0, size - row]: the top 64 bits of hash * count.
  const auto count = static_cast<uint64_t>(tokens_.size() - seq_len_);
  const uint64_t base =
      SplitMix64(seed_ ^ SplitMix64(static_cast<uint64_t>(step)));
  for (int64_t b = 0; b < batch_; ++b) {
    const uint64_t h = SplitMix64(base + static_cast<uint64_t>(b));
    const auto start =
        static_cast<int64_t>((static_cast<unsigned __int128>(h) * count) >> 64);
    tokens_.Copy(start, out.subspan(b * row, row));
  }
  return Status::Ok();
}

}  // namespace strata::finetune
