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
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
