#!/usr/bin/env bash
# The main job on an embedded default: installs what is needed, builds, and
# runs strata-finetune with no model flags: on a machine without a GPU, a
# small GPT-style model whose training state is over ten times the device
# memory it is given, trained for a few minutes on Debian's fortunes (tests
# are not built here: they need the packages of `install-deps.sh --test`).
# Its JSON and loss curve go to ./strata-finetune-out (STRATA_OUT_DIR
# overrides); strata-finetune options may be passed, and a --json or --plot
# given here replaces the default one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build -DSTRATA_BUILD_TESTS=OFF
out="${STRATA_OUT_DIR:-strata-finetune-out}"
defaults=()
has() {  # has OPTION ARGS...: whether ARGS name OPTION (as --opt or --opt=)
  local opt="$1" a
  shift
  for a in "$@"; do
    [[ "$a" == "$opt" || "$a" == "$opt="* ]] && return 0
  done
  return 1
}
has --json "$@" || defaults+=(--json "$out/strata-finetune.json")
has --plot "$@" || defaults+=(--plot "$out/strata-finetune-loss.svg")
if ((${#defaults[@]} > 0)); then
  mkdir -p "$out"
fi
build/examples/finetune/strata-finetune "${defaults[@]}" "$@"
