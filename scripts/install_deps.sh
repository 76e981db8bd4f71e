#!/usr/bin/env bash
# Installs the Debian packages the build, the tests and the benchmarks need, when any is missing.
# Runs as root on the project's machines (apt-get works as is); elsewhere it uses sudo if present.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libhwy-dev          # Highway: portable SIMD with runtime dispatch
  libgtest-dev        # GoogleTest
  libcli11-dev        # CLI11: the command line's flag parsing and --help (tools/args.cc)
  nlohmann-json3-dev  # nlohmann-json: bench's --json output (tools/)
  libomp-dev clang    # clang + libomp: the ThreadSanitizer build and the libFuzzer targets
  libclang-rt-14-dev  # sanitizer and fuzzer runtimes for clang
  clang-format clang-tidy
  libopenblas-dev     # benchmarks only: the SGEMM roofline and the materialized peer
  libbenchmark-dev    # benchmarks only: bench/micro_kernels (Google Benchmark)
  python3 python3-venv python3-pip
)
# The aarch64 cross-build, run under QEMU (scripts/test_aarch64.sh): Debian's cross compiler, the
# arm64 multiarch packages of the libraries it links (cmake/aarch64-linux-gnu.cmake), qemu-user.
ARM64_PACKAGES=(
  g++-aarch64-linux-gnu
  libhwy-dev:arm64 libgomp1:arm64 libgtest-dev:arm64
  libopenblas-dev:arm64  # the CLI's bench peer, and the layer's projections at run time
  qemu-user
)
PACKAGES+=("${ARM64_PACKAGES[@]}")

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then SUDO=sudo; fi
echo "== installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# The :arm64 packages need dpkg to accept that architecture (before apt-get update fetches its
# package lists).
if [[ $(dpkg --print-architecture) != arm64 ]] &&
  ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
