#!/usr/bin/env bash
# Installs what the tests need, builds, and runs the test suite.
#   scripts/test.sh                  every suite but `slow`
#   STRATA_TEST_LABELS=unit scripts/test.sh   only the chosen ctest labels
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --test
scripts/build.sh build -DSTRATA_BUILD_TESTS=ON
args=(--test-dir build --output-on-failure -j "$(nproc)")
if [[ -n "${STRATA_TEST_LABELS:-}" ]]; then
  args+=(-L "$STRATA_TEST_LABELS")
else
  args+=(-LE slow)
fi
ctest "${args[@]}"
