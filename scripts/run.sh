#!/usr/bin/env bash
# The main job on an embedded default: installs what is needed, builds, and
# runs `strata-bench io` (tests are not built here: they need the packages
# of `install-deps.sh --test`) on a scratch directory in the checkout (override with
# STRATA_BENCH_DIR and STRATA_BENCH_SIZE, or pass strata-bench io options).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh build -DSTRATA_BUILD_TESTS=OFF
dir="${STRATA_BENCH_DIR:-strata-bench-data}"
mkdir -p "$dir"
build/bench/strata-bench io --dir "$dir" --size "${STRATA_BENCH_SIZE:-1G}" \
  --json "$dir/strata-bench-io.json" "$@"
