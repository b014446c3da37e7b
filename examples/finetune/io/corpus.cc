#include "examples/finetune/io/corpus.h"

#include <filesystem>
#include <system_error>

namespace strata::finetune {

StatusOr<std::string> DefaultCorpusPath(std::string_view root) {
  std::filesystem::path dir(root);
  dir /= std::filesystem::path(kDefaultCorpusDir).relative_path();
  // "cookie" is one of the package's own files: the directory alone could be
  // left from another fortune package.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(dir / "cookie", ec)) {
    return Status::NotFound(
        "the default corpus is not installed: Debian package '" +
        std::string(kDefaultCorpusPackage) + "' puts it in " + dir.string() +
        "; install it with scripts/install-deps.sh, or name a text file or "
        "directory with --data");
  }
  return dir.string();
}

}  // namespace strata::finetune
