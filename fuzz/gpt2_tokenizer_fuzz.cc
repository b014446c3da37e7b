// Fuzzes the GPT-2 BPE tokenizer files reader of the fine-tune example
// (Gpt2BpeTokenizer::FromContents: vocab.json and merges.txt, as users
// download them), then the tokenizer such files make.
//
// Input: the vocab.json text, a NUL byte, the merges.txt text, optionally a
// second NUL byte and a text to encode (neither file holds a NUL).
//
// Besides the sanitizers it checks the contract: a refusal is
// kInvalidArgument naming the file; a loaded tokenizer encodes the text to
// ids below its vocabulary size that decode to the text again, and to the
// same ids when cut where StreamCut says it may be; the pre-tokenizer splits
// the text into contiguous pieces that cover it.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "examples/finetune/io/tokenizer.h"
#include "strata/status.h"

namespace {

void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

// The next NUL-terminated part of *rest (all of it when there is no NUL).
std::string_view NextPart(std::string_view* rest) {
  const size_t nul = rest->find('\0');
  const std::string_view part = rest->substr(0, nul);
  rest->remove_prefix(nul == std::string_view::npos ? rest->size() : nul + 1);
  return part;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::finetune::Gpt2BpeTokenizer;
  using strata::finetune::TokenId;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  const std::string_view vocab = NextPart(&rest);
  const std::string_view merges = NextPart(&rest);
  std::string_view text = rest;
  if (text.empty()) text = "Hello, world! It's 2024\n\n  and\tthe   end.";

  // The pre-tokenizer depends on the text alone.
  size_t covered = 0;
  for (std::string_view piece : strata::finetune::Gpt2PreTokenize(text)) {
    if (piece.data() != text.data() + covered || piece.empty()) {
      Fail("pre-tokenized pieces are not contiguous and non-empty",
           std::to_string(covered));
    }
    covered += piece.size();
  }
  if (covered != text.size()) Fail("pre-tokenized pieces miss the end", "");

  auto tokenizer = Gpt2BpeTokenizer::FromContents(vocab, merges);
  if (!tokenizer.ok()) {
    const std::string_view message = tokenizer.status().message();
    if (tokenizer.status().code() != strata::StatusCode::kInvalidArgument ||
        (message.find("vocab.json") == std::string_view::npos &&
         message.find("merges.txt") == std::string_view::npos)) {
      Fail("refused without kInvalidArgument naming the file",
           tokenizer.status().ToString());
    }
    return 0;
  }
  std::vector<TokenId> ids;
  (*tokenizer)->Encode(text, &ids);
  for (TokenId id : ids) {
    if (id < 0 || id >= (*tokenizer)->vocab_size()) {
      Fail("encoded an id outside the vocabulary", std::to_string(id));
    }
  }
  std::string decoded;
  if (strata::Status s = (*tokenizer)->Decode(ids, &decoded); !s.ok()) {
    Fail("cannot decode what it encoded", s.ToString());
  }
  if (decoded != text) Fail("Decode(Encode(text)) != text", decoded);
  // Encoding the text in two pieces cut where StreamCut allows gives the
  // same tokens.
  const size_t cut = (*tokenizer)->StreamCut(text);
  if (cut > text.size()) Fail("StreamCut past the end", std::to_string(cut));
  std::vector<TokenId> pieces;
  (*tokenizer)->Encode(text.substr(0, cut), &pieces);
  (*tokenizer)->Encode(text.substr(cut), &pieces);
  if (pieces != ids)
    Fail("encoding cut at StreamCut differs", std::to_string(cut));
  return 0;
}
