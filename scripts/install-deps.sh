#!/usr/bin/env bash
# Installs the Debian 12 packages strata needs. Idempotent: when everything is
# there already it only checks and returns.
#   scripts/install-deps.sh          build and run dependencies
#   scripts/install-deps.sh --test   also what the test suite uses
set -euo pipefail

build_pkgs=(
  cmake g++ make pkg-config git
  liburing-dev libaio-dev libtbb-dev libhwloc-dev
  nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev
  libopenblas-dev
  libopenmpi-dev openmpi-bin  # the MPI backend of comm/ (docs/comm.md); optional
  python3-dev pybind11-dev  # the Python package (python/, docs/python.md)
  fio
  fortunes  # the fine-tune example's default corpus (English text)
)
test_pkgs=(
  googletest libgtest-dev libgmock-dev libseccomp-dev
  python3 python3-numpy python3-torch python3-pytest util-linux clang-format clang
  python3-mpi4py  # a caller's MPI communicator into strata.Communicator (tests/python)
  libclang-rt-dev  # clang's libFuzzer and sanitizer runtimes (fuzz/)
  libsimde-dev  # portable AVX-512, for the AVX-512 kernels' tests on any host
)

pkgs=("${build_pkgs[@]}")
if [[ "${1:-}" == "--test" ]]; then
  pkgs+=("${test_pkgs[@]}")
fi

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#pkgs[@]} packages present"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
