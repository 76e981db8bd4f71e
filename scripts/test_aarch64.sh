#!/usr/bin/env bash
# aarch64: the library cross-built on this x86 machine (cmake/aarch64-linux-gnu.cmake, Release,
# warnings as errors) with Highway's aarch64 targets (NEON, SVE, SVE2, SVE_256, SVE2_128), and a
# subset of its tests run under qemu-aarch64 on three emulated CPUs:
#   cortex-a72                          NEON only (no SVE)
#   max,sve-default-vector-length=16    SVE and SVE2 at 128 bits (Highway picks SVE2_128)
#   max,sve-default-vector-length=64    SVE and SVE2 at 512 bits (Highway picks SVE2)
# On each, flashcte_simd_report says which targets were compiled and which ran. No emulated CPU
# here has 256-bit SVE, so SVE_256 is compiled but not run (the report says so).
#
# The subset (ctest regexes below), on each CPU:
#   ^Simd                every micro-kernel tester of tests/simd (label simd), and SimdTargets.*
#   EveryTarget          the core suite's tests that run each target the CPU has (SimdTargets,
#                        DecodeTargets, DecodePaged, DecodeKv8, Kv8Prior)
#   ^simd_report$        the report as a CTest entry: fails if a runnable target does not run
#   -L layer             the attention layer's suite (tests/layer: its projections through
#                        OpenBLAS, loaded from libopenblas0:arm64; RoPE, the KV cache and its
#                        pages, GQA weights and tensor-parallel ranks), in a ctest call of its own
#                        since CTest intersects -R and -L: 76 tests, 5 s, 5 s and 9 s on the
#                        three CPUs (this Xeon)
# and on the two 128-bit CPUs only, the head-dim grid's design check and two of its 14 shards
# (HeadDimGridSmall.causal: every d, dv up to 160; HeadDimGridLarge.noncausal: 176..576), each
# case on every target the CPU has.
# Measured in a clean-clone CI run on the 2-core Xeon: the build 159 s, bounded by
# src/simd/decode_pv.cc (148 s; decode_qk.cc 57 s on the other core); the runs (ctest -j 2) 11 s
# on cortex-a72, 26 s at 128 bits, 89 s at 512 bits. At 512 bits QEMU emulates SVE several times
# slower (16 float lanes a vector): two grid shards took 237 s and 209 s there (with another build
# sharing the cores), so that CPU runs no grid shard.
# Left out, with the reason:
#   - the rest of flashcte_tests and the reliability suite: each of their tests runs only the
#     CPU's best target, and they cost minutes under emulation (flashcte_tests ran 249 of its
#     1,147 tests in under 4 minutes on cortex-a72); the x86 run covers their logic.
#   - the other 12 grid shards: 7-15 s each on the 128-bit CPUs (up to 27 s under load), 200 s
#     and more at 512 bits.
#   - the CLI's GoogleTest suites (flashcte_cli_tests, flashcte_reliability_cli_tests): they
#     start the flashcte binary by path through std::system, whose x86 shell cannot exec an
#     aarch64 binary where binfmt_misc does not hand it to QEMU (as here). The flashcte_cli.*
#     entries would run (CTest prefixes the emulator to a target's command), but the CLI is not
#     built.
#   - install_consumer and the layering probes: they run the compiler and CMake, not the
#     library, and are the same on every architecture.
# Not built, for the same budget: the CLI, the benchmarks and the suites above.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
JOBS="$(nproc)"
BUILD=build/aarch64
SECONDS=0

# --no-warn-unused-cli: CMake reads the toolchain file on the first configure only, and would
# warn on every later one that CMAKE_TOOLCHAIN_FILE went unused.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHCTE_WERROR=ON \
  -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake --no-warn-unused-cli >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target flashcte_simd_tests flashcte_tests \
  flashcte_head_dim_grid_tests flashcte_layer_tests flashcte_simd_report
printf -- '-- (%ds) built\n' "$SECONDS"

TESTS='^Simd|EveryTarget|^simd_report$'
GRID='^HeadDimGridDesign\.Covers$|^HeadDimGridSmall\.causal$|^HeadDimGridLarge\.noncausal$'
run_on() {  # QEMU_CPU value, what it emulates, the ctest regex
  printf '\n-- (%ds) emulated CPU QEMU_CPU=%s (%s): simd_report, ctest -R "%s", the layer suite\n' \
    "$SECONDS" "$1" "$2" "$3"
  # QEMU_CPU is read by qemu-aarch64, which CTest runs every test under (the toolchain file's
  # CMAKE_CROSSCOMPILING_EMULATOR).
  QEMU_CPU="$1" qemu-aarch64 "$BUILD/tests/flashcte_simd_report"
  QEMU_CPU="$1" ctest --test-dir "$BUILD" -LE long -R "$3" --no-tests=error --output-on-failure -j "$JOBS"
  QEMU_CPU="$1" ctest --test-dir "$BUILD" -L layer --no-tests=error --output-on-failure -j "$JOBS"
}
run_on cortex-a72 "NEON only" "$TESTS|$GRID"
run_on max,sve-default-vector-length=16 "SVE and SVE2 at 128 bits" "$TESTS|$GRID"
run_on max,sve-default-vector-length=64 "SVE and SVE2 at 512 bits" "$TESTS"
printf '\n-- (%ds) aarch64 done\n' "$SECONDS"
