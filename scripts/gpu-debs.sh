#!/usr/bin/env bash
# Downloads the Debian packages that strata's build and tests need into
# .gpu-debs/ (ignored by git), for a machine that has a compiler, CMake and
# CUDA but no package registry: the lent GPU machine. scripts/gpu-check.sh
# unpacks them there into a private prefix; nothing is installed system-wide.
#   scripts/gpu-debs.sh [DIR]      (DIR defaults to .gpu-debs)
# Run it here, where apt works; then carry DIR to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.gpu-debs}"

# The -dev packages of scripts/install-deps.sh, the runtime libraries they
# pull in that a CUDA image does not have, pkgconf (CMake finds liburing,
# hwloc and xxhash through pkg-config), and the fine-tune's default corpus.
packages=(
  liburing2 liburing-dev
  libaio1 libaio-dev
  libtbb12 libtbbmalloc2 libtbbbind-2-5 libtbb-dev
  libhwloc15 libhwloc-dev
  libxxhash0 libxxhash-dev
  libfmt9 libfmt-dev
  libspdlog1.10 libspdlog-dev
  nlohmann-json3-dev
  libcli11-dev
  googletest libgtest-dev libgmock-dev
  libseccomp2 libseccomp-dev
  libopenblas0 libopenblas0-pthread libopenblas-dev libopenblas-pthread-dev
  libgfortran5 libquadmath0
  pkgconf pkgconf-bin libpkgconf3
  fortunes fortunes-min
)

if [[ $(id -u) -eq 0 ]] && ! apt-cache show "${packages[0]}" >/dev/null 2>&1; then
  apt-get update -qq
fi
rm -rf "$dir"
mkdir -p "$dir"
# apt-get download writes into the current directory; as root it warns that
# the _apt user cannot write there, which is harmless.
(cd "$dir" && apt-get download -qq "${packages[@]}" 2>&1 |
  grep -v "_apt" || true)
for p in "${packages[@]}"; do
  if ! compgen -G "$dir/${p}_*.deb" >/dev/null; then
    echo "gpu-debs: $p was not downloaded" >&2
    exit 1
  fi
done
echo "gpu-debs: $(ls "$dir" | wc -l) packages, $(du -sh "$dir" | cut -f1) in $dir"
