// Names inside a checkpoint directory, shared by the writer and the reader.
#ifndef STRATA_CKPT_PATHS_H_
#define STRATA_CKPT_PATHS_H_

#include <string>
#include <string_view>

#include "strata/checkpoint.h"

namespace strata::ckpt {

// Temporary entries (a checkpoint being written, "latest" being replaced, a
// checkpoint being pruned) start with this; a writer holding the lock
// removes every one it finds.
inline constexpr std::string_view kTmpPrefix = ".tmp-";
// The data files of a pruned checkpoint kept for the next writer
// (CheckpointWriterOptions::recycle): a temporary entry that a writer holding
// the lock adopts instead of removing.
inline constexpr std::string_view kSpareName = ".tmp-spare";

inline std::string JoinPath(const std::string& dir, std::string_view name) {
  return dir + "/" + std::string(name);
}

// The directory part of `path` ("." when it has none).
inline std::string ParentDir(const std::string& path) {
  const size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return "/";
  const size_t slash = path.rfind('/', end);
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

inline std::string BaseName(const std::string& path) {
  const size_t end = path.find_last_not_of('/');
  if (end == std::string::npos) return path;
  const size_t slash = path.rfind('/', end);
  return path.substr(slash == std::string::npos ? 0 : slash + 1,
                     end - (slash == std::string::npos ? 0 : slash + 1) + 1);
}

// The checkpoint "latest" names: its file's contents without the newline.
// kNotFound when there is no "latest"; kCorruption when it names no
// "step-<N>".
StatusOr<std::string> ReadLatest(CheckpointFs& fs, const std::string& dir);

}  // namespace strata::ckpt

#endif  // STRATA_CKPT_PATHS_H_
