#!/usr/bin/env bash
# Installs what the tests need, builds (and checks the locking with clang),
# and runs the test suite.
#   scripts/test.sh                  every suite but `slow`
#   STRATA_TEST_LABELS=unit scripts/test.sh   only the chosen ctest labels
#                                    (`fuzz`: the fuzz targets' build-fuzz)
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
# The libFuzzer targets (fuzz/, docs/reliability.md): a clang build of them
# and what they link alone, Debug (the readers they exercise are built at -O1
# whatever the type). Their tests, label `fuzz`, run below after the others.
fuzz=0
if [[ -z "${STRATA_TEST_LABELS:-}" || "fuzz" =~ ${STRATA_TEST_LABELS} ]]; then
  fuzz=1
  cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
    -DSTRATA_BUILD_FUZZ=ON -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF \
    -DSTRATA_ENABLE_CUDA=OFF
  cmake --build build-fuzz -j "$(nproc)" --target strata_fuzz
fi
args=(--test-dir build --output-on-failure -j "$(nproc)")
if [[ -n "${STRATA_TEST_LABELS:-}" ]]; then
  args+=(-L "$STRATA_TEST_LABELS")
else
  args+=(-LE slow)
fi
ctest "${args[@]}"
if ((fuzz)); then
  ctest --test-dir build-fuzz --output-on-failure -j "$(nproc)" -L fuzz
fi
