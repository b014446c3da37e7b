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
# Steps run in order, most important first; a failed step is logged and the
# next still runs, so one call brings back as much as it can. The exit status
# is that of the worst step.
#   STRATA_GPU_STEPS    the steps to run (default: all but `tests`, `io`,
#                       `columns` and `sweeps`),
#                       e.g. "cputests adam" on a machine that already built
#   STRATA_GPU_BUDGET   seconds for the whole run (default 540, inside one
#                       10-minute call): a step gets what is left, and a step
#                       with under 20 s left is not started
#   STRATA_GPU_STEP_TIMEOUT  the most any step after the build may take
set -uo pipefail
cd "$(dirname "$0")/.."
for v in STRATA_GPU_BUDGET STRATA_GPU_STEP_TIMEOUT; do
  if [[ -n "${!v:-}" && ! "${!v}" =~ ^[1-9][0-9]{0,5}$ ]]; then
    echo "gpu-check: $v must be a whole number of seconds, 1..999999" >&2
    exit 2
  fi
done
default_steps="machine build gpu finetune copy cputests python memcheck racecheck tiers comm adam step"
all_steps="$default_steps tests io columns sweeps"
steps="${STRATA_GPU_STEPS:-$default_steps}"
for s in $steps; do
  if [[ " $all_steps " != *" $s "* ]]; then
    echo "gpu-check: STRATA_GPU_STEPS: '$s' is no step; the steps: $all_steps" >&2
    exit 2
  fi
done
out="$(mkdir -p "${1:-gpu-check-out}" && cd "${1:-gpu-check-out}" && pwd)"
debs="${STRATA_DEBS:-.gpu-debs}"
prefix="${STRATA_PREFIX:-/tmp/strata-prefix}"
build="${STRATA_GPU_BUILD:-build-gpu}"
deadline=$((SECONDS + ${STRATA_GPU_BUDGET:-540}))
step_cap="${STRATA_GPU_STEP_TIMEOUT:-240}"
jobs="$(nproc)"
worst=0
summary="$out/summary.txt"
: >"$summary"

note() { echo "gpu-check: $*" | tee -a "$summary"; }
want() { [[ " $steps " == *" $1 "* ]]; }
# step NAME CAP CMD...: runs CMD for at most CAP seconds and at most what is
# left of the budget, with its output in $out/NAME.log, records the result,
# and keeps going. A step that would get under 20 s is not started.
step() {
  local name="$1" cap="$2"
  shift 2
  local left=$((deadline - SECONDS - 5))
  ((cap > left)) && cap=$left
  if ((cap < 20)); then
    note "$name: not run, $((deadline - SECONDS)) s of the budget left"
    ((worst < 1)) && worst=1
    return 1
  fi
  local start=$SECONDS
  # In the background and waited for, so that a signal to this script
  # reaches it at once (on_signal) rather than after the step.
  timeout "$cap" "$@" >"$out/$name.log" 2>&1 &
  child=$!
  wait "$child"
  local rc=$?
  child=
  note "$name: rc=$rc in $((SECONDS - start)) s"
  if ((rc != 0)); then
    tail -n 40 "$out/$name.log"
    ((rc > worst)) && worst=$rc
  fi
  return $rc
}
capped() { local c="$1"; ((c > step_cap)) && c=$step_cap; echo "$c"; }
# INT or TERM: the running step gets TERM (timeout hands it on to its
# command, whose own handler removes what it created), then the script exits
# through its EXIT trap.
child=
on_signal() {
  [[ -n "$child" ]] && kill -TERM "$child" 2>/dev/null && wait "$child"
  exit "$1"
}
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

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
# The fine-tune's default corpus (Debian's fortunes), unpacked with the rest.
corpus="$prefix/usr/share/games/fortunes"

# pybind11 for the Python package: a wheel's CMake files, where Debian's
# pybind11-dev is not installed.
pybind=()
if d="$(python3 -m pybind11 --cmakedir 2>/dev/null)" && [[ -n "$d" ]]; then
  pybind=(-Dpybind11_DIR="$d")
fi

# NCCL: the toolkit's, else the one a Python wheel (nvidia-nccl-*) brought.
nccl=()
if [[ ! -e /usr/local/cuda/include/nccl.h ]]; then
  wheel="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' \
    2>/dev/null)"
  lib="$(compgen -G "$wheel/lib/libnccl.so*" | head -n 1)"
  if [[ -n "$wheel" && -e "$wheel/include/nccl.h" && -n "$lib" ]]; then
    nccl=(-DNCCL_INCLUDE_DIR="$wheel/include" -DNCCL_LIBRARY="$lib")
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$wheel/lib"
  fi
fi

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
  findmnt -T /tmp || true
  echo "NCCL flags: ${nccl[*]:-none, NCCL from the toolkit if any}"
}

# Warnings are not errors there: that machine's compiler may be newer than
# Debian 12's and warn where ours does not; this run checks behaviour, and
# the build log keeps the warnings. CMAKE_POLICY_VERSION_MINIMUM lets a
# CMake 4 read the Debian packages' CMake files.
configure() {
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DPKG_CONFIG_EXECUTABLE="$pkgconfig" \
    -DCMAKE_CUDA_ARCHITECTURES="${STRATA_CUDA_ARCHS:-90}" "${nccl[@]}" \
    "${pybind[@]}" \
    -DSTRATA_BUILD_TESTS=ON -DSTRATA_BUILD_BENCH=ON \
    -DSTRATA_WERROR=OFF -DCMAKE_POLICY_VERSION_MINIMUM=3.5
}
# The programs the steps run; the whole tree only for the whole suite.
cpu_tests=(tests/cpu_adam/cpu_adam_test tests/cpu_adam/cpu_adam_torch_test
  tests/cpu_adam/cpu_adam_factored_reference_test tests/util/util_test
  tests/finetune/finetune_torch_test)
targets=(strata-bench strata-finetune gpu_cuda_conformance_test
  gpu_cuda_header_test finetune_cuda_test comm_nccl_test strata_python)
for t in "${cpu_tests[@]}"; do targets+=("${t##*/}"); done
compile() {
  if ! grep -q "strata: CUDA=ON" "$out/configure.log"; then
    echo "CMake did not enable CUDA (no nvcc found?): see configure.log"
    return 1
  fi
  local pick=()
  if ! want tests; then
    # Only the targets this configuration has (comm_nccl_test needs NCCL).
    local have
    have="$(cmake --build "$build" --target help 2>/dev/null)"
    for t in "${targets[@]}"; do
      grep -qE "(^|[ .])$t(:| |$)" <<<"$have" && pick+=(--target "$t")
    done
  fi
  # Keep going past a failed file: another compiler may reject one, and the
  # steps that need none of it can still run.
  local keep=(-k)
  [[ -f "$build/build.ninja" ]] && keep=(-k 0)
  cmake --build "$build" -j "$jobs" "${pick[@]}" -- "${keep[@]}"
  local rc=$?
  echo "compiler warnings: $(grep -c "warning:" "$out/build.log")"
  return $rc
}
# The CPU kernels' suites, whose AVX-512 and PyTorch cases skip where CI runs.
cputests() {
  local rc=0
  for t in "${cpu_tests[@]}"; do
    echo "== $t"
    "$build/$t" --gtest_brief=1 || rc=1
  done
  return $rc
}
# The widest CPU kernel variant strata-bench adam can run here.
best_variant() {
  local f
  f=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  if [[ $f == *" avx512f "* && $f == *" avx512bw "* && $f == *" avx512vl "* &&
    $f == *" avx512dq "* ]]; then
    [[ $f == *" avx512_bf16 "* ]] && echo avx512bf16 || echo avx512
  else
    echo avx2
  fi
}
bench="$build/bench/strata-bench"
# SM3 and Adafactor on one thread over 32768 x 4096 and over 524288 x 256
# (where the per-column arrays are 1 KiB each, always in L1), alternating,
# twice: what reading and rewriting the column arrays for every row costs
# on this core.
columns() {
  local r c rc=0
  for r in 1 2; do
    for c in 4096 256; do
      echo "== pass $r, $c columns"
      "$bench" adam --params 128M --optimizer sm3,adafactor --moments fp32 \
        --cols "$c" --variants "$(best_variant)" --threads 1 --reps 3 \
        --torch off --json "$out/columns-$c-$r.json" || rc=1
    done
  done
  return $rc
}
# The 8-bit update in one sweep over each block against two (the form AVX2
# takes by default; --block8-sweeps), AdamW and Lion beside their fp32 rows,
# on one thread and on all of them, alternating, twice: whether this core's
# out-of-order window wants the two sweeps too.
sweeps() {
  local r s rc=0
  for r in 1 2; do
    for s in 1 2; do
      echo "== pass $r, $s sweeps"
      "$bench" adam --params 64M --optimizer adamw,lion --moments fp32,int8 \
        --block8-sweeps "$s" --variants "$(best_variant)" --threads "1,$jobs" \
        --reps 3 --torch off --json "$out/sweeps-$s-$r.json" || rc=1
    done
  done
  return "$rc"
}
# `timeout` runs programs, not functions: a step that is a function runs in a
# child bash given the function and what it reads.
fn() {
  echo "$(declare -p generator prefix pkgconfig nccl pybind targets cpu_tests \
    build out steps jobs bench)"
  declare -f machine configure compile cputests columns sweeps best_variant \
    want
  echo "$1"
}

want machine && step machine 30 bash -c "$(fn machine)"
if want build; then
  if ! step configure 120 bash -c "$(fn configure)"; then
    note "CMake failed; nothing else can run"
    exit $worst
  fi
  step build 420 bash -c "$(fn compile)" ||
    note "the build failed in part: the steps that need what did build still run"
fi
# STRATA_REQUIRE_CUDA=1 turns "CUDA unavailable" skips into failures: a run
# whose CUDA cases all skipped must not pass for a tested one.
want gpu && step gpu "$(capped 120)" env STRATA_REQUIRE_CUDA=1 \
  ctest --test-dir "$build" -L gpu --output-on-failure --no-tests=error -j 4
# The fine-tune over NCCL on one rank (the engine runs no collective there;
# several GPUs are needed for that).
want finetune && step finetune "$(capped 150)" \
  "$build/examples/finetune/strata-finetune" --device cuda --comm nccl \
  --data "$corpus" --steps 200 --stop-after 50 --json "$out/finetune-nccl.json"
want copy && step copy "$(capped 90)" "$bench" copy --device cuda \
  --json "$out/copy.json"
want cputests && step cputests "$(capped 150)" bash -c "$(fn cputests)"
# The Python package's suite with the machine's torch: strata.torch.offload
# on CUDA tensors (a GPU case, failing rather than skipping here).
want python && step python "$(capped 180)" env STRATA_REQUIRE_CUDA=1 \
  ctest --test-dir "$build" -L python -LE "mpi|install" --output-on-failure \
  --no-tests=error -j 4
# The CUDA suite again under compute-sanitizer (memcheck, then racecheck).
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    want $tool && step $tool "$(capped 120)" env STRATA_REQUIRE_CUDA=1 \
      compute-sanitizer --tool $tool --error-exitcode 1 \
      "$build/tests/gpu/gpu_cuda_conformance_test"
  done
fi
# The benchmarks' scratch directories; each benchmark removes its own files,
# and the directories go when the run ends, however it ends (on_signal ends
# it through exit).
tiers_dir=/tmp/strata-bench-tiers step_dir=/tmp/strata-bench-step
io_dir=/tmp/strata-bench-io
mkdir -p "$tiers_dir" "$step_dir" "$io_dir"
trap 'rmdir "$tiers_dir" "$step_dir" "$io_dir" 2>/dev/null' EXIT
# The engine's hops and end-to-end moves on the GPU.
want tiers && step tiers "$(capped 120)" "$bench" tiers --device cuda \
  --size 2G --reps 2 --dir "$tiers_dir" --json "$out/tiers.json"
want comm && step comm "$(capped 60)" "$bench" comm --backend nccl \
  --sizes 1M,64M,256M --json "$out/comm-nccl.json"
# The CPU optimizers on this machine's cores and widest vectors: one thread,
# half of them and all of them (each once). 128M parameters (512 MiB an fp32
# array, far past any cache): at 256M this step took 231 s on 16 cores, and
# with the python step the whole run would overrun its budget.
threads="1"
((jobs / 2 > 1)) && threads+=",$((jobs / 2))"
((jobs > 1)) && threads+=",$jobs"
want adam && step adam "$(capped 240)" "$bench" adam --params 128M \
  --optimizer adamw,lion,adafactor,sm3 --moments fp32,bf16,int8 \
  --variants "$(best_variant)" --threads "$threads" --reps 3 \
  --torch off --json "$out/adam.json"
want step && step step "$(capped 180)" "$bench" step --params 256M \
  --moments fp32,int8 --reps 1 --dir "$step_dir" \
  --json "$out/step.json"
want tests && step tests "$step_cap" ctest --test-dir "$build" \
  -LE "slow|install" --output-on-failure -j "$jobs"
want io && step io "$(capped 120)" "$bench" io --dir "$io_dir" \
  --size 4G --json "$out/io.json"
want columns && step columns "$(capped 240)" bash -c "$(fn columns)"
want sweeps && step sweeps "$(capped 240)" bash -c "$(fn sweeps)"
note "done; worst rc=$worst; logs in $out"
exit $worst
