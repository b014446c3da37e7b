#include "examples/finetune/io/tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

namespace strata::finetune {
namespace {

using nlohmann::json;

// The cache holds pieces (words), not texts; natural text has a few hundred
// thousand distinct ones. Past this it starts over rather than grow.
constexpr size_t kMaxCacheEntries = size_t{1} << 18;
// BPE is quadratic in a piece's length; a longer piece (a base64 blob, a
// line of one repeated character) is encoded in slices of this many bytes.
// GPT-2's merged tokens are far shorter, so text is unaffected.
constexpr size_t kMaxPieceBytes = 1024;

enum class Cat : uint8_t { kLetter, kNumber, kSpace, kOther };

constexpr char32_t kInvalid = 0xffffffff;

// Decodes the code point at text[i]: its length in bytes (1 for a byte that
// starts no valid UTF-8 sequence, with *cp = kInvalid).
size_t DecodeUtf8(std::string_view text, size_t i, char32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(text[i + k]); };
  const uint8_t c = b(0);
  *cp = kInvalid;
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len = 0;
  uint8_t lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 1;
  }
  if (i + len > text.size()) return 1;
  if (b(1) < lo || b(1) > hi) return 1;
  for (size_t k = 2; k < len; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 1;
  }
  char32_t v = c & (0x7f >> len);
  for (size_t k = 1; k < len; ++k) v = (v << 6) | (b(k) & 0x3f);
  *cp = v;
  return len;
}

bool IsUnicodeSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
         c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// The approximation of \p{L}, \p{N}, \s stated in the header.
Cat Category(char32_t c) {
  if (c == kInvalid) return Cat::kOther;
  if (IsUnicodeSpace(c)) return Cat::kSpace;
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return Cat::kLetter;
    if (c >= '0' && c <= '9') return Cat::kNumber;
    return Cat::kOther;
  }
  if (c < 0x100) {
    if (c < 0xa0) return Cat::kOther;  // C1 controls
    if (c == 0xaa || c == 0xb5 || c == 0xba) return Cat::kLetter;
    if (c == 0xb2 || c == 0xb3 || c == 0xb9 || (c >= 0xbc && c <= 0xbe)) {
      return Cat::kNumber;
    }
    if (c < 0xc0 || c == 0xd7 || c == 0xf7) return Cat::kOther;
    return Cat::kLetter;
  }
  if ((c >= 0x2000 && c <= 0x206f) || (c >= 0x3000 && c <= 0x303f)) {
    return Cat::kOther;
  }
  return Cat::kLetter;
}

struct CodePoint {
  size_t len;
  Cat cat;
};

CodePoint At(std::string_view text, size_t i) {
  char32_t cp;
  const size_t len = DecodeUtf8(text, i, &cp);
  return {len, Category(cp)};
}

// End of the run of category `cat` that starts at i.
size_t RunEnd(std::string_view text, size_t i, Cat cat) {
  while (i < text.size()) {
    const CodePoint p = At(text, i);
    if (p.cat != cat) break;
    i += p.len;
  }
  return i;
}

// Length of a contraction ('s 't 're 've 'm 'll 'd) at text[i], or 0.
size_t Contraction(std::string_view text, size_t i) {
  if (text[i] != '\'' || i + 1 >= text.size()) return 0;
  const char a = text[i + 1];
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 < text.size()) {
    const char b = text[i + 2];
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') ||
        (a == 'l' && b == 'l')) {
      return 3;
    }
  }
  return 0;
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xc0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    out->push_back(static_cast<char>(0xe0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
}

StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("cannot open " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::IoError("reading " + path + " failed");
  return ss.str();
}

Status IdOutOfRange(TokenId id, int64_t vocab) {
  return Status::OutOfRange("token id " + std::to_string(id) +
                            " is outside the vocabulary [0, " +
                            std::to_string(vocab) + ")");
}

}  // namespace

// ---- Byte-level
// ---------------------------------------------------------------

void ByteTokenizer::Encode(std::string_view text, std::vector<TokenId>* out) {
  out->reserve(out->size() + text.size());
  for (char c : text) out->push_back(static_cast<uint8_t>(c));
}

Status ByteTokenizer::Decode(std::span<const TokenId> ids,
                             std::string* out) const {
  for (TokenId id : ids) {
    if (id < 0 || id >= 256) return IdOutOfRange(id, 256);
    out->push_back(static_cast<char>(id));
  }
  return Status::Ok();
}

// ---- GPT-2 BPE
// ----------------------------------------------------------------

char32_t Gpt2ByteToUnicode(uint8_t byte) {
  const auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) ||
           (b >= 0xae && b <= 0xff);
  };
  if (printable(byte)) return byte;
  char32_t n = 0;
  for (int b = 0; b < byte; ++b) n += printable(b) ? 0 : 1;
  return 256 + n;
}

std::vector<std::string_view> Gpt2PreTokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  size_t i = 0;
  while (i < text.size()) {
    size_t end;
    const CodePoint p = At(text, i);
    if (const size_t c = Contraction(text, i); c > 0) {
      end = i + c;  // 's 't 're 've 'm 'll 'd
    } else if (text[i] == ' ' && i + 1 < text.size() &&
               At(text, i + 1).cat != Cat::kSpace) {
      // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+' with the space
      end = RunEnd(text, i + 1, At(text, i + 1).cat);
    } else if (p.cat != Cat::kSpace) {
      end = RunEnd(text, i, p.cat);  // the same without it
    } else {
      // '\s+(?!\S)' then '\s+': a run of whitespace followed by more text
      // gives its last code point to that text (when the run has more than
      // one); at the end of the text the run is whole.
      end = i;
      size_t last = i;
      while (end < text.size()) {
        const CodePoint q = At(text, end);
        if (q.cat != Cat::kSpace) break;
        last = end;
        end += q.len;
      }
      if (end < text.size() && last > i) end = last;
    }
    pieces.push_back(text.substr(i, end - i));
    i = end;
  }
  return pieces;
}

StatusOr<std::unique_ptr<Gpt2BpeTokenizer>> Gpt2BpeTokenizer::Load(
    const std::string& vocab_json_path, const std::string& merges_txt_path) {
  STRATA_ASSIGN_OR_RETURN(std::string vocab, ReadWholeFile(vocab_json_path));
  STRATA_ASSIGN_OR_RETURN(std::string merges, ReadWholeFile(merges_txt_path));
  return FromContents(vocab, merges, vocab_json_path, merges_txt_path);
}

StatusOr<std::unique_ptr<Gpt2BpeTokenizer>> Gpt2BpeTokenizer::FromContents(
    std::string_view vocab_json, std::string_view merges_txt,
    std::string_view vocab_name, std::string_view merges_name) {
  const std::string vname(vocab_name), mname(merges_name);
  json vocab;
  try {
    vocab = json::parse(vocab_json);
  } catch (const json::exception& e) {
    return Status::InvalidArgument(vname + " is not valid JSON: " + e.what());
  }
  if (!vocab.is_object() || vocab.empty()) {
    return Status::InvalidArgument(
        vname + " must be a non-empty JSON object {\"token\": id, ...}");
  }
  // Inverse of the byte table, for turning vocabulary strings into bytes.
  std::array<int, 0x144> byte_of;
  byte_of.fill(-1);
  for (int b = 0; b < 256; ++b) byte_of[Gpt2ByteToUnicode(b)] = b;

  std::unique_ptr<Gpt2BpeTokenizer> t(new Gpt2BpeTokenizer());
  const size_t n = vocab.size();
  if (n > static_cast<size_t>(std::numeric_limits<TokenId>::max())) {
    return Status::InvalidArgument(vname + ": too many tokens");
  }
  t->bytes_of_.resize(n);
  std::vector<bool> seen(n, false);
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_unsigned() || id_json.get<uint64_t>() >= n) {
      return Status::InvalidArgument(
          vname + ": token '" + token + "' has id " + id_json.dump() +
          "; ids must be the integers 0.." + std::to_string(n - 1));
    }
    const auto id = static_cast<TokenId>(id_json.get<uint64_t>());
    if (seen[id]) {
      return Status::InvalidArgument(vname + ": id " + std::to_string(id) +
                                     " is given to two tokens (one is '" +
                                     token + "')");
    }
    seen[id] = true;
    std::string bytes;
    for (size_t i = 0; i < token.size();) {
      char32_t cp;
      i += DecodeUtf8(token, i, &cp);
      if (cp == kInvalid || cp >= byte_of.size() || byte_of[cp] < 0) {
        return Status::InvalidArgument(
            vname + ": token '" + token + "' (id " + std::to_string(id) +
            ") has a character outside GPT-2's byte alphabet");
      }
      bytes.push_back(static_cast<char>(byte_of[cp]));
    }
    t->bytes_of_[id] = std::move(bytes);
    t->ids_.emplace(token, id);
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    AppendUtf8(Gpt2ByteToUnicode(static_cast<uint8_t>(b)), &s);
    auto it = t->ids_.find(s);
    if (it == t->ids_.end()) {
      return Status::InvalidArgument(
          vname + ": no token for byte " + std::to_string(b) + " ('" + s +
          "'); GPT-2's vocabulary has one for each of the 256 bytes");
    }
    t->byte_token_[b] = it->second;
  }
  t->separator_ = t->TokenOf("<|endoftext|>");

  size_t line_no = 0;
  uint32_t rank = 0;
  std::unordered_map<uint64_t, size_t> line_of;
  while (!merges_txt.empty()) {
    const size_t nl = merges_txt.find('\n');
    std::string_view line = merges_txt.substr(0, nl);
    merges_txt.remove_prefix(nl == std::string_view::npos ? merges_txt.size()
                                                          : nl + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) {
      continue;
    }
    const std::string where = mname + " line " + std::to_string(line_no);
    const size_t sp = line.find(' ');
    if (sp == 0 || sp == std::string_view::npos || sp + 1 == line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos) {
      return Status::InvalidArgument(where + ": '" + std::string(line) +
                                     "' is not two tokens separated by a "
                                     "space");
    }
    const std::string_view a = line.substr(0, sp), b = line.substr(sp + 1);
    const auto ia = t->TokenOf(a), ib = t->TokenOf(b);
    const auto iab = t->TokenOf(std::string(a) + std::string(b));
    if (!ia || !ib || !iab) {
      return Status::InvalidArgument(
          where + ": '" +
          std::string(!ia   ? a
                      : !ib ? b
                            : line) +
          (!ia || !ib ? "' is not in " : "' merged is not in ") + vname);
    }
    const uint64_t key = (static_cast<uint64_t>(*ia) << 32) | *ib;
    if (auto [it, fresh] = line_of.emplace(key, line_no); !fresh) {
      return Status::InvalidArgument(where + " repeats line " +
                                     std::to_string(it->second));
    }
    t->merges_.emplace(key, Merge{rank++, *iab});
  }
  return t;
}

std::optional<TokenId> Gpt2BpeTokenizer::TokenOf(
    std::string_view vocab_string) const {
  auto it = ids_.find(vocab_string);
  if (it == ids_.end()) return std::nullopt;
  return it->second;
}

void Gpt2BpeTokenizer::EncodePiece(std::string_view piece,
                                   std::vector<TokenId>* out) const {
  std::vector<TokenId> sym;
  sym.reserve(piece.size());
  for (char c : piece) sym.push_back(byte_token_[static_cast<uint8_t>(c)]);
  std::vector<TokenId> next;
  while (sym.size() > 1) {
    // The adjacent pair of lowest rank...
    uint32_t best = std::numeric_limits<uint32_t>::max();
    Merge merge{};
    uint64_t best_key = 0;
    for (size_t i = 0; i + 1 < sym.size(); ++i) {
      const uint64_t key = (static_cast<uint64_t>(sym[i]) << 32) |
                           static_cast<uint32_t>(sym[i + 1]);
      auto it = merges_.find(key);
      if (it != merges_.end() && it->second.rank < best) {
        best = it->second.rank;
        merge = it->second;
        best_key = key;
      }
    }
    if (best == std::numeric_limits<uint32_t>::max()) break;
    // ...merged wherever it occurs, left to right.
    const auto first = static_cast<TokenId>(best_key >> 32);
    const auto second = static_cast<TokenId>(best_key & 0xffffffffu);
    next.clear();
    for (size_t i = 0; i < sym.size(); ++i) {
      if (i + 1 < sym.size() && sym[i] == first && sym[i + 1] == second) {
        next.push_back(merge.result);
        ++i;
      } else {
        next.push_back(sym[i]);
      }
    }
    sym.swap(next);
  }
  out->insert(out->end(), sym.begin(), sym.end());
}

void Gpt2BpeTokenizer::Encode(std::string_view text,
                              std::vector<TokenId>* out) {
  for (std::string_view piece : Gpt2PreTokenize(text)) {
    if (piece.size() > kMaxPieceBytes) {
      for (size_t i = 0; i < piece.size(); i += kMaxPieceBytes) {
        EncodePiece(piece.substr(i, kMaxPieceBytes), out);
      }
      continue;
    }
    auto it = cache_.find(piece);
    if (it == cache_.end()) {
      if (cache_.size() >= kMaxCacheEntries) cache_.clear();
      std::vector<TokenId> ids;
      EncodePiece(piece, &ids);
      it = cache_.emplace(std::string(piece), std::move(ids)).first;
    }
    out->insert(out->end(), it->second.begin(), it->second.end());
  }
}

size_t Gpt2BpeTokenizer::StreamCut(std::string_view text) const {
  for (size_t p = text.size(); p-- > 1;) {
    if (text[p - 1] == '\n' && text[p] > ' ' && text[p] < 0x7f) return p;
  }
  return 0;
}

Status Gpt2BpeTokenizer::Decode(std::span<const TokenId> ids,
                                std::string* out) const {
  for (TokenId id : ids) {
    if (id < 0 || id >= vocab_size()) return IdOutOfRange(id, vocab_size());
    out->append(bytes_of_[id]);
  }
  return Status::Ok();
}

}  // namespace strata::finetune
