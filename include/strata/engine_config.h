// The memtier engine's JSON config: strata's own keys (a top-level `strata`
// object) and a DeepSpeed config as it is (`zero_optimization`, `aio`,
// `fp16`, `bf16`, `optimizer`, `gradient_clipping`, batch sizes, and the
// other top-level DeepSpeed keys). docs/config.md lists every key with its
// default, unit and mapping onto EngineOptions.
//
// Strict by design:
//   - an unknown (misspelt) key is an error naming its JSON path, with the
//     closest known key as a suggestion;
//   - a value of the wrong type, "auto" (Hugging Face's placeholder, which
//     the caller must resolve), a negative, non-integral or absurd size, and
//     a key given twice in one object are errors naming the path;
//   - a DeepSpeed key strata knows but does not act on yet is accepted and
//     reported by its path in EngineConfig::warnings;
//   - coercions, each with a warning: the `aio` section's booleans may be
//     the strings "true"/"false" (ds_nvme_tune writes them so); optimizer
//     states DeepSpeed would keep on the device rest in host memory; the
//     deprecated cpu_offload keys read as the offload sections.
// All key and type errors of a document are reported together; once there
// are none, all range errors (ValidateEngineOptions, naming the JSON paths
// that set the fields) are. Errors are
// kInvalidArgument ("engine config: <path>: <what>; <path>: <what>"); invalid
// JSON reports its line and column. No exception escapes.
//
// The functions are thread-safe (they share no state).
#ifndef STRATA_ENGINE_CONFIG_H_
#define STRATA_ENGINE_CONFIG_H_

#include <string>
#include <string_view>
#include <vector>

#include "strata/engine_options.h"
#include "strata/export.h"
#include "strata/status.h"

namespace strata {

struct EngineConfig {
  // Validated (ValidateEngineOptions holds).
  EngineOptions options;
  // "<json path>: <why>" for each key accepted but not acted on, and each
  // coercion, section by section. The caller logs or shows them.
  std::vector<std::string> warnings;
};

// Parses a config held in memory.
STRATA_EXPORT StatusOr<EngineConfig> ParseEngineConfig(std::string_view json);

// Reads and parses the file at `path`; errors name the file.
STRATA_EXPORT StatusOr<EngineConfig> ParseEngineConfigFile(
    const std::string& path);

}  // namespace strata

#endif  // STRATA_ENGINE_CONFIG_H_
