// Fuzzes the GPT-2 checkpoint mapping of the fine-tune example
// (InferGpt2Dims, MapGpt2Checkpoint, ReadGpt2Parameter), which runs on every
// --weights file after its safetensors header has been accepted: the tensor
// names and shapes it reads are the file's, so they are untrusted.
//
// Input: 8 bytes, the size of the data buffer (unsigned little-endian, capped
// at 1 GiB), then the header's JSON text. The target writes a safetensors
// file of that header and a zero data buffer (sparse) to an anonymous
// in-memory file and opens it by its /proc path, as the trainer opens a path.
//
// Besides the sanitizers it checks the contract: a refusal is
// kInvalidArgument naming the file (or the file is not valid safetensors at
// all); accepted dimensions are within the documented limits; an accepted map
// has a file tensor of the right shape for every parameter, and every small
// parameter reads back as the zeros that are in the file.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "examples/finetune/io/gpt2_checkpoint.h"
#include "examples/finetune/io/safetensors.h"
#include "strata/status.h"

namespace {

using strata::StatusCode;
using strata::finetune::Gpt2CheckpointMap;
using strata::finetune::Gpt2Dims;
using strata::finetune::SafetensorsFile;

void Fail(const char* what, const std::string& detail) {
  std::fprintf(stderr, "%s: %s\n", what, detail.c_str());
  std::abort();
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

void CheckRefusal(const strata::Status& s, const std::string& path,
                  const char* what) {
  if (s.code() != StatusCode::kInvalidArgument ||
      s.message().find(path) == std::string_view::npos) {
    Fail(what, s.ToString());
  }
}

void CheckMap(const SafetensorsFile& file, const Gpt2CheckpointMap& map) {
  for (const auto& spec : strata::finetune::Gpt2ParameterSpecs(map.dims)) {
    auto it = map.tensor_of.find(spec.name);
    if (it == map.tensor_of.end()) Fail("parameter not mapped", spec.name);
    const auto* t = file.Find(it->second);
    if (t == nullptr || t->shape != spec.shape) {
      Fail("mapped to a tensor of another shape", spec.name);
    }
    if (spec.numel() > (int64_t{1} << 16)) continue;
    std::vector<float> out(static_cast<size_t>(spec.numel()), 1.0f);
    strata::Status s = ReadGpt2Parameter(file, map, spec.name, out);
    if (!s.ok()) Fail("a mapped parameter does not read", s.ToString());
    for (float v : out) {
      if (v != 0.0f) Fail("read back what the file does not hold", spec.name);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t data_size = 0;
  for (int i = 7; i >= 0; --i) data_size = (data_size << 8) | data[i];
  if (data_size > (uint64_t{1} << 30)) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 8,
                              size - 8);

  const int fd = ::memfd_create("gpt2-fuzz", 0);
  if (fd < 0) Fail("memfd_create", "failed");
  const uint64_t header_len = text.size();
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(header_len >> 8 * i);
  if (!WriteAll(fd, len, 8) || !WriteAll(fd, text.data(), text.size()) ||
      ::ftruncate(fd, static_cast<off_t>(8 + header_len + data_size)) != 0) {
    Fail("writing the in-memory file", "failed");
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  {
    auto file = SafetensorsFile::Open(path);
    if (file.ok()) {
      auto dims = strata::finetune::InferGpt2Dims(*file);
      if (!dims.ok()) {
        CheckRefusal(dims.status(), path, "dims refused badly");
      } else {
        auto map = strata::finetune::MapGpt2Checkpoint(*file, *dims);
        if (map.ok()) {
          CheckMap(*file, *map);
        } else {
          CheckRefusal(map.status(), path, "map refused badly");
        }
      }
      // A fixed small model against whatever the file holds: the mismatch
      // report names what is missing, unexpected or mis-shaped.
      const Gpt2Dims tiny{.n_layer = 2, .n_embd = 4, .vocab = 8, .n_ctx = 4};
      auto map = strata::finetune::MapGpt2Checkpoint(*file, tiny);
      if (map.ok()) {
        CheckMap(*file, *map);
      } else {
        CheckRefusal(map.status(), path, "tiny map refused badly");
      }
    }
  }
  ::close(fd);
  return 0;
}
