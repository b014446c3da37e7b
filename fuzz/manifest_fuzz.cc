// Fuzzes the checkpoint manifest reader (ckpt/manifest.h, ParseManifest).
// The manifest ends with a checksum of everything before it, which random
// mutations almost never keep right; so an input whose first byte is even
// is a manifest body whose checksum line the target appends, letting the
// fuzzer reach the JSON and cross-checks behind it, and an odd first byte
// gives the rest as the whole text. Besides the sanitizers it checks the
// reader's contract: a refusal is kCorruption naming the file, and an
// accepted manifest serializes to a text that parses to the same text.
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "ckpt/manifest.h"
#include "strata/status.h"
#include "util/checksum.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    char line[32];
    std::snprintf(
        line, sizeof(line), "xxh3 %016" PRIx64 "\n",
        strata::Xxh3(std::as_bytes(std::span(text.data(), text.size()))));
    text += line;
  }
  constexpr std::string_view kFile = "fuzz/MANIFEST.json";
  auto m = strata::ckpt::ParseManifest(text, kFile);
  if (!m.ok()) {
    if (m.status().code() != strata::StatusCode::kCorruption ||
        m.status().message().find(kFile) == std::string_view::npos) {
      std::fprintf(stderr, "refused without kCorruption naming the file: %s\n",
                   m.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  const std::string again = strata::ckpt::SerializeManifest(*m);
  auto m2 = strata::ckpt::ParseManifest(again, kFile);
  if (!m2.ok() || strata::ckpt::SerializeManifest(*m2) != again) {
    std::fprintf(stderr, "an accepted manifest does not round-trip: %s\n",
                 m2.ok() ? "text differs" : m2.status().ToString().c_str());
    std::abort();
  }
  return 0;
}
