#!/usr/bin/env bash
# Installs what the tests need, builds (and checks the locking with clang),
# and runs the test suite.
#   scripts/test.sh                  every suite but `slow`
#   STRATA_TEST_LABELS=unit scripts/test.sh   only the chosen ctest labels
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --test
scripts/build.sh build -DSTRATA_BUILD_TESTS=ON
# Clang's thread-safety analysis over the library (gcc has none): shared state
# read or written without the lock its annotation names fails the build. A
# Debug build of the library alone, since only the check matters here.
CMAKE_BUILD_TYPE=Debug scripts/build.sh build-clang-check \
  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
  -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF -DSTRATA_BUILD_EXAMPLES=OFF \
  -DSTRATA_ENABLE_CUDA=OFF
args=(--test-dir build --output-on-failure -j "$(nproc)")
if [[ -n "${STRATA_TEST_LABELS:-}" ]]; then
  args+=(-L "$STRATA_TEST_LABELS")
else
  args+=(-LE slow)
fi
ctest "${args[@]}"
