#!/usr/bin/env bash
# Builds strata on a GPU machine that has a compiler, CMake and the CUDA
# toolkit but no package registry, then runs the CUDA suites and the GPU
# benchmarks, writing every log and JSON result into OUT_DIR.
#   scripts/gpu-check.sh [OUT_DIR]     (default: ./gpu-check-out)
# The Debian packages come from scripts/gpu-debs.sh (run where apt works) in
# .gpu-debs/, or STRATA_DEBS; they are unpacked into a private prefix
# (STRATA_PREFIX, default /tmp/strata-prefix), never into /.
# With the device tool, one call does it all:
#   carry [".gpu-debs"], command "bash scripts/gpu-check.sh $OUT"
# Steps run in order; a failed step is logged and the next still runs, so one
# call brings back as much as it can. The exit status is that of the worst
# step. STRATA_GPU_STEPS picks steps (default: all), e.g. "build gpu copy".
set -uo pipefail
cd "$(dirname "$0")/.."
out="$(mkdir -p "${1:-gpu-check-out}" && cd "${1:-gpu-check-out}" && pwd)"
debs="${STRATA_DEBS:-.gpu-debs}"
prefix="${STRATA_PREFIX:-/tmp/strata-prefix}"
build="${STRATA_GPU_BUILD:-build-gpu}"
steps="${STRATA_GPU_STEPS:-machine build gpu sanitizer copy tests adam io tiers step comm finetune}"
jobs="$(nproc)"
worst=0
summary="$out/summary.txt"
: >"$summary"

note() { echo "gpu-check: $*" | tee -a "$summary"; }
want() { [[ " $steps " == *" $1 "* ]]; }
# step NAME CMD...: runs CMD (at most STRATA_GPU_STEP_TIMEOUT seconds, 240 by
# default, so that one call of the device tool fits its 10 minutes) with its
# output in $out/NAME.log, records the result, and keeps going.
step() {
  local name="$1"
  shift
  local start=$SECONDS
  if declare -F "$1" >/dev/null; then
    "$@" >"$out/$name.log" 2>&1
  else
    timeout "${STRATA_GPU_STEP_TIMEOUT:-240}" "$@" >"$out/$name.log" 2>&1
  fi
  local rc=$?
  note "$name: rc=$rc in $((SECONDS - start)) s"
  if ((rc != 0)); then
    tail -n 40 "$out/$name.log"
    ((rc > worst)) && worst=$rc
  fi
  return $rc
}

# ---- The private prefix ------------------------------------------------------
if [[ ! -d "$debs" ]] || ! compgen -G "$debs/*.deb" >/dev/null; then
  note "no packages in $debs: run scripts/gpu-debs.sh where apt works, and carry $debs"
  exit 2
fi
rm -rf "$prefix"
mkdir -p "$prefix"
for f in "$debs"/*.deb; do dpkg -x "$f" "$prefix" || exit 2; done
# The packages' .pc files say prefix=/usr; point them at the private prefix.
for pc in "$prefix"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc \
  "$prefix"/usr/lib/x86_64-linux-gnu/openblas-pthread/pkgconfig/*.pc \
  "$prefix"/usr/share/pkgconfig/*.pc; do
  sed -i -E "s#^([A-Za-z_]+)=/usr#\1=$prefix/usr#" "$pc"
done
libdir="$prefix/usr/lib/x86_64-linux-gnu"
# OpenBLAS lives in its own directory (Debian selects it by alternatives,
# which unpacking does not run).
blasdir="$libdir/openblas-pthread"
export LD_LIBRARY_PATH="$libdir:$blasdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_LIBDIR="$libdir/pkgconfig:$blasdir/pkgconfig:$prefix/usr/share/pkgconfig"
pkgconfig="$(command -v pkg-config || echo "$prefix/usr/bin/pkgconf")"
# nvcc and compute-sanitizer, where the toolkit is not on PATH.
[[ -d /usr/local/cuda/bin ]] && export PATH="$PATH:/usr/local/cuda/bin"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

machine() {
  nvidia-smi || true
  nvidia-smi topo -m || true
  nvcc --version
  cmake --version
  c++ --version
  uname -a
  lscpu
  free -g
  df -h /tmp .
}

# Warnings are not errors there: that machine's compiler may be newer than
# Debian 12's and warn where ours does not; this run checks behaviour, and
# the build log keeps the warnings. CMAKE_POLICY_VERSION_MINIMUM lets a
# CMake 4 read the Debian packages' CMake files.
configure() {
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DPKG_CONFIG_EXECUTABLE="$pkgconfig" \
    -DCMAKE_CUDA_ARCHITECTURES="${STRATA_CUDA_ARCHS:-90}" \
    -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCH=ON \
    -DSTRATA_WERROR=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5
}
compile() {
  if ! grep -q "strata: CUDA=ON" "$out/configure.log"; then
    echo "CMake did not enable CUDA (no nvcc found?): see configure.log"
    return 1
  fi
  cmake --build "$build" -j "$jobs" || return
  echo "compiler warnings: $(grep -c "warning:" "$out/build.log")"
}

bench="$build/bench/strata-bench"

want machine && step machine machine
if want build; then
  { step configure configure && step build compile; } || {
    note "the build failed; nothing else can run"
    exit $worst
  }
fi
if want gpu; then
  # STRATA_REQUIRE_CUDA=1 turns "CUDA unavailable" skips into failures: a run
  # whose CUDA cases all skipped must not pass for a tested one.
  step gpu env STRATA_REQUIRE_CUDA=1 ctest --test-dir "$build" -L gpu \
    --output-on-failure --no-tests=error -j 4
fi
# The CUDA suite again under compute-sanitizer (memcheck, then racecheck).
if want sanitizer && command -v compute-sanitizer >/dev/null; then
  step memcheck env STRATA_REQUIRE_CUDA=1 compute-sanitizer --tool memcheck \
    --error-exitcode 1 "$build/tests/gpu/gpu_cuda_conformance_test"
  step racecheck env STRATA_REQUIRE_CUDA=1 compute-sanitizer --tool racecheck \
    --error-exitcode 1 "$build/tests/gpu/gpu_cuda_conformance_test"
fi
want tests && step tests ctest --test-dir "$build" -LE "slow|install" \
  --output-on-failure -j "$jobs"
want copy && step copy "$bench" copy --device cuda --json "$out/copy.json"
want adam && step adam "$bench" adam --json "$out/adam.json"
want io && step io "$bench" io --dir "/tmp/strata-bench-io" --size 4G \
  --json "$out/io.json"
# The engine's hops and end-to-end moves on the GPU, and its optimizer step.
mkdir -p /tmp/strata-bench-tiers /tmp/strata-bench-step
want tiers && step tiers "$bench" tiers --device cuda --size 4G \
  --dir "/tmp/strata-bench-tiers" --json "$out/tiers.json"
want step && step step "$bench" step --params 512M --reps 1 \
  --dir "/tmp/strata-bench-step" --json "$out/step.json"
# NCCL on one rank: the collectives' bandwidth on device memory, and the
# fine-tune with the engine's communicator made by NCCL (one rank: the
# engine runs no collective; several GPUs are needed for that).
want comm && step comm "$bench" comm --backend nccl --sizes 1M,64M,256M \
  --json "$out/comm-nccl.json"
finetune="$build/examples/finetune/strata-finetune"
want finetune && step finetune "$finetune" --device cuda --comm nccl \
  --steps 200 --stop-after 50 --json "$out/finetune-nccl.json"
note "done; worst rc=$worst; logs in $out"
exit $worst
