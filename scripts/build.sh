#!/usr/bin/env bash
# Configures and builds strata.
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# BUILD_DIR defaults to build/. CMAKE_BUILD_TYPE defaults to RelWithDebInfo.
# Sanitizer builds: scripts/build.sh build-asan -DSTRATA_SANITIZE=address,undefined
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-build}"
shift || true
jobs="$(nproc)"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-RelWithDebInfo}" "$@"
cmake --build "$dir" -j "$jobs"
