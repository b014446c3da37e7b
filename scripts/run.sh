#!/usr/bin/env bash
# The main job on an embedded default: installs what is needed, builds, and
# runs `strata-bench io` (tests are not built here: they need the packages
# of `install-deps.sh --test`) on a scratch directory in the checkout (override with
# STRATA_BENCH_DIR and STRATA_BENCH_SIZE, or pass strata-bench io options:
# a --dir, --size or --json given here replaces the default one).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build -DSTRATA_BUILD_TESTS=OFF
dir="${STRATA_BENCH_DIR:-strata-bench-data}"
defaults=()
has() {  # has OPTION ARGS...: whether ARGS name OPTION (as --opt or --opt=)
  local opt="$1" a
  shift
  for a in "$@"; do
    [[ "$a" == "$opt" || "$a" == "$opt="* ]] && return 0
  done
  return 1
}
has --dir "$@" || defaults+=(--dir "$dir")
has --size "$@" || defaults+=(--size "${STRATA_BENCH_SIZE:-1G}")
has --json "$@" || defaults+=(--json "$dir/strata-bench-io.json")
if ! has --dir "$@" || ! has --json "$@"; then
  mkdir -p "$dir"
fi
build/bench/strata-bench io "${defaults[@]}" "$@"
