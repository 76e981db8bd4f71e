#!/usr/bin/env bash
# Every test: formatting and lint, the Release build with warnings as errors and its CTest suite
# (GoogleTest grid, CLI tests, the installed-package consumer), the aarch64 cross-build's SIMD
# tests under QEMU, the manylinux wheel on a machine without the system libraries, the Python
# package's pytest suite on that wheel, and the sanitizer + fuzzing run. This is what CI runs
# (.ci/run).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
JOBS="$(nproc)"
start=$SECONDS
section() { printf '\n== %s (%ds)\n' "$1" $((SECONDS - start)); }

section "dependencies"
scripts/install_deps.sh

section "clang-format"
git ls-files '*.cc' '*.h' | xargs clang-format --dry-run --Werror

section "build (Release, -Werror)"
cmake -S . -B build/ci -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCTE_WERROR=ON >/dev/null
cmake --build build/ci -j "$JOBS"

section "clang-tidy"
scripts/lint.sh build/ci

section "ctest"
ctest --test-dir build/ci -LE long --no-tests=error --output-on-failure -j "$JOBS"
# What that run exercised: the SIMD targets compiled into the library and the ones this CPU ran
# (every target-iterating test runs exactly those); on a CPU without AVX-512 it says the AVX-512
# code did not run. Also a CTest entry (simd_report), which fails if a runnable target does not.
build/ci/tests/flashcte_simd_report

# On a CPU with AVX-512 the run above dispatches to AVX3 wherever a test does not pick the target
# itself; the whole suite runs again capped at AVX2 (FLASHCTE_SIMD_TARGET, src/simd/ops.cc), as
# it would on an AVX2-only CPU: the AVX2 kernels as the default path, bfloat16 widened. This is
# the library's dispatch capped, not another CPU (the CPU's other code still sees AVX-512).
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  section "ctest, dispatch capped at AVX2"
  FLASHCTE_SIMD_TARGET=AVX2 ctest --test-dir build/ci -LE long --no-tests=error --output-on-failure -j "$JOBS"
  FLASHCTE_SIMD_TARGET=AVX2 build/ci/tests/flashcte_simd_report
fi

# The `long` tests (full-size Neuron shapes, the 10,000 random configurations): a sample drawn
# from the commit hash, printed with the number that reproduces it; scripts/test_long.sh --all
# runs them all.
section "long tests (a sample)"
scripts/test_long.sh build/ci

# aarch64 without ARM hardware: the library cross-built with every aarch64 target (NEON, SVE,
# SVE2, SVE_256, SVE2_128), its SIMD tests run under qemu-aarch64 on a NEON-only CPU and on SVE
# CPUs with 128- and 512-bit vectors, with the report of what ran on each.
section "aarch64 (cross-built, run under qemu-aarch64)"
scripts/test_aarch64.sh

# The release wheel as a user installs it: built from the sdist (scripts/wheel.sh, auditwheel's
# manylinux tag), installed into a fresh venv and run with the system's libhwy, libgomp and
# libopenblas hidden (unshare -m).
section "wheel"
scripts/test_wheel.sh

# The Python package's whole pytest suite (torch, transformers and FlashAttention's interface
# included) on that same wheel: the wheel is what users install, and building the package a second
# time for this stage made it take 935 s (CI's run of 42f12a5, Xeon; ~220 s of that the torch
# install and pytest itself).
section "python (pytest on the wheel)"
wheels=(dist/flashcte-*.whl)
FLASHCTE_WHEEL="${wheels[0]}" python/run_tests.sh

section "sanitizers and fuzzing"
scripts/ci_sanitizers.sh

section "done"
