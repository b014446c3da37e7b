// The default training corpus: English text from a Debian package that
// scripts/install-deps.sh installs with the build dependencies, so that the
// example trains on real prose with no flag and the repository carries no
// text of its own.
//
// The package is "fortunes" (with its dependency "fortunes-min"): about
// 2.5 MB of short English prose, quotations, poems and jokes in plain-text
// files, in Debian main, about 1 MB to download. Its directory also holds
// the strfile indexes (*.dat, binary) and a ".u8" symbolic link per file,
// which the directory walk of data.h skips.
#ifndef STRATA_EXAMPLES_FINETUNE_IO_CORPUS_H_
#define STRATA_EXAMPLES_FINETUNE_IO_CORPUS_H_

#include <string>
#include <string_view>

#include "strata/status.h"

namespace strata::finetune {

// The Debian package and the directory where it installs its text.
inline constexpr std::string_view kDefaultCorpusPackage = "fortunes";
inline constexpr std::string_view kDefaultCorpusDir =
    "/usr/share/games/fortunes";

// The directory of the default corpus (kDefaultCorpusDir under `root`, "/"
// for this system; another root for a system image), when it holds the
// package's files. kNotFound otherwise, saying which package provides it and
// to install it with scripts/install-deps.sh.
StatusOr<std::string> DefaultCorpusPath(std::string_view root = "/");

}  // namespace strata::finetune

#endif  // STRATA_EXAMPLES_FINETUNE_IO_CORPUS_H_
