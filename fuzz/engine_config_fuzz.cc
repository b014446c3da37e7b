// Fuzzes the engine's JSON / DeepSpeed config reader (ParseEngineConfig) with
// the input as the document. Besides the sanitizers, it checks the reader's
// contract (include/strata/engine_config.h): a document is either refused
// with kInvalidArgument "engine config: <path>: <what>...", or accepted with
// options that ValidateEngineOptions accepts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "strata/engine_config.h"
#include "strata/engine_options.h"
#include "strata/status.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  strata::StatusOr<strata::EngineConfig> config =
      strata::ParseEngineConfig(json);
  if (!config.ok()) {
    if (config.status().code() != strata::StatusCode::kInvalidArgument ||
        !config.status().message().starts_with("engine config: ")) {
      std::fprintf(stderr,
                   "refused without kInvalidArgument \"engine config: \": %s\n",
                   config.status().ToString().c_str());
      std::abort();
    }
    return 0;
  }
  if (strata::Status s = strata::ValidateEngineOptions(config->options);
      !s.ok()) {
    std::fprintf(stderr, "accepted options that do not validate: %s\n",
                 s.ToString().c_str());
    std::abort();
  }
  return 0;
}
