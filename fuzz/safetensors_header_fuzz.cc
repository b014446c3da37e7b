// Fuzzes the safetensors header reader of the fine-tune example
// (ParseSafetensorsHeader, which SafetensorsFile::Open runs on every file).
//
// Input: 8 bytes, the size of the data buffer that follows the header
// (unsigned little-endian, as the format writes its header length), then the
// header's JSON text. The size is an input of its own rather than the length
// of a real data buffer so that mutating it is cheap and any size, up to what
// a file can hold, is reached.
//
// Besides the sanitizers it checks the reader's contract: a refusal is
// kCorruption naming the file; an accepted header lists tensors that tile the
// data buffer exactly, each of shape * itemsize bytes.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>

#include "examples/finetune/io/safetensors.h"
#include "strata/status.h"

namespace {

void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using strata::finetune::SafetensorsDTypeSize;
  using strata::finetune::SafetensorsHeader;
  if (size < 8) return 0;
  uint64_t data_size = 0;
  for (int i = 7; i >= 0; --i) data_size = (data_size << 8) | data[i];
  const std::string_view text(reinterpret_cast<const char*>(data) + 8,
                              size - 8);
  // A file's size is an off_t: data buffer + header + 8 fit in int64.
  const uint64_t max_data =
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - 8 -
      text.size();
  if (data_size > max_data) return 0;

  const std::string path = "fuzz.safetensors";
  strata::StatusOr<SafetensorsHeader> header =
      strata::finetune::ParseSafetensorsHeader(text, data_size, path);
  if (!header.ok()) {
    if (header.status().code() != strata::StatusCode::kCorruption ||
        header.status().message().find(path) == std::string_view::npos) {
      Fail("refused without kCorruption naming the file",
           header.status().ToString());
    }
    return 0;
  }
  uint64_t pos = 0;
  for (const auto& t : header->tensors) {
    if (t.data_begin != pos || t.data_end < t.data_begin) {
      Fail("tensors do not tile the data buffer", t.name);
    }
    const int64_t numel = t.numel();
    if (numel < 0 ||
        static_cast<uint64_t>(numel) * SafetensorsDTypeSize(t.dtype) !=
            t.bytes()) {
      Fail("shape and byte size disagree", t.name);
    }
    pos = t.data_end;
  }
  if (pos != data_size) Fail("tensors do not fill the data buffer", "");
  return 0;
}
