#!/usr/bin/env bash
# Sanitizers and fuzzing (issue 6). Three stages, each in its own build directory:
#
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (GCC, libgomp): the whole test suite,
#         default labels (ctest -LE long). Leak checking is on. install_consumer is left out: it
#         links the installed static library into a fresh project without the sanitizer
#         runtimes, which cannot link (it is a packaging test, run by scripts/test.sh).
#   tsan  ThreadSanitizer on the threaded tests (ctest -L threads, all in one executable):
#         attention_cte's determinism across thread counts and SIMD targets and its concurrent
#         callers (determinism_test.cc), and every serving path on 1, 3 and the default thread count
#         (threads_serving_test.cc: decode over dense, paged and 8-bit caches, the KV-cache call,
#         the varlen mixed batch, rank-4 batches, merges, the attention layer), built with clang +
#         LLVM's libomp and run with Archer, LLVM's OMPT tool that tells TSan about OpenMP's
#         synchronization.
#   fuzz  the two libFuzzer targets of tools/fuzz (.npy parser, flag parser) with clang, for
#         FLASHCTE_FUZZ_SECONDS each (default 60), both at once (one per core).
#
# Why clang + libomp + Archer for TSan: GCC's libgomp is not TSan-instrumented, so TSan cannot see
# the barriers and the dynamic-schedule hand-off inside it and reports races between OpenMP
# workers that are ordered by those barriers (the known libgomp false positives). A suppressions
# file would have to silence every report whose stack passes through libgomp, which also hides
# real races in our parallel region. With libomp, Archer (shipped with LLVM's OpenMP runtime as
# libarcher.so) annotates the runtime's happens-before edges (parallel begin/end, barriers,
# tasks, locks) for TSan, and ignore_noninstrumented_modules=1 keeps the runtime's own internals
# out of the report; races in our code are still reported. The stage checks that Archer loaded.
#
# Usage: scripts/ci_sanitizers.sh [asan] [tsan] [fuzz]      (no argument: all three)
# Environment: JOBS (default nproc), FLASHCTE_FUZZ_SECONDS (default 60).
# Build directories: build-asan/, build-tsan/, build-fuzz/ (gitignored); the fuzzing corpora
# persist in build-fuzz/corpus-*/ between runs.
# Time on 2 cores (measured on a shared machine under a load average of ~10, so an upper bound):
# asan build ~26 min and ctest ~11 min for ~1,200 tests (the head-dim grid, added since, ~105 s
# of CPU more), tsan 6.2 min build from scratch + 19 s ctest for 17 tests, 10 s of it the 12
# serving-path tests (`time scripts/ci_sanitizers.sh tsan`: 6 min 31 s on an AMD EPYC Zen 4 with
# 2 cores under a load average of ~3.5), fuzz ~25 s build + 2 x 60 s in parallel. Most of the
# asan time is the GoogleTest grid under ASan; FLASHCTE_ASAN_CTEST_ARGS (e.g.
# "-R Reliability|BadInput|Numerics") narrows that stage.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
JOBS="${JOBS:-$(nproc)}"
FUZZ_SECONDS="${FLASHCTE_FUZZ_SECONDS:-60}"
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(asan tsan fuzz)
start=$SECONDS
section() { printf '\n== %s (%ds)\n' "$1" $((SECONDS - start)); }
summary=()

for stage in "${STAGES[@]}"; do
  case "$stage" in
    asan)
      section "asan+ubsan: build"
      # -O1: the instrumented build of every test file at -O2 took 27 of the stage's 40 minutes
      # on 2 busy cores; -O1 is what the sanitizer documentation recommends anyway. -g1: line
      # tables, all a report's stack trace needs. With full -g, GCC's variable tracking over the
      # decode kernels' inlined register tiles (src/simd/decode_*.cc) ran out of its size limit
      # and started over, function by function: decode_qk.cc took 312 s against 164 s with -g1
      # (Xeon, two compiles side by side), and decode_pv.cc was still compiling after 12 minutes.
      # On a CPU without AVX-512 the AVX3 target is not compiled into this build: no test could run
      # it under the sanitizers, and it was over half of the SIMD files' instrumented compile
      # (decode_qk.cc + ops.cc: 223 s with it, 101 s without, one core each, AMD EPYC Zen 3).
      # The Release build (scripts/test.sh) still compiles it, and the report below says so.
      # simd_report_without_avx512 checks the report's line for a compiled AVX3 target that does
      # not run, so it runs in the Release build's ctest only, where AVX3 is compiled.
      asan_cxx_flags=""
      asan_exclude='^install_consumer$|PairTest.*_(bfloat16|float16)$|^LargeD/'
      if ! grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
        asan_cxx_flags="-DHWY_DISABLED_TARGETS=HWY_AVX3"
        asan_exclude+='|^simd_report_without_avx512$'
      fi
      cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
        -DCMAKE_CXX_FLAGS="$asan_cxx_flags" -DFLASHCTE_SANITIZE=address,undefined >/dev/null
      cmake --build build-asan -j "$JOBS"
      section "asan+ubsan: ctest -LE long"
      # halt_on_error and -fno-sanitize-recover (root CMakeLists) make every report a failure.
      # The pairwise mode grid runs in float32 only here: its bfloat16/float16 pairs run the same
      # kernel code behind other packers, which the low-precision tests that stay in (head dims,
      # lengths, modifiers, random configurations) exercise; all three would triple the stage.
      # The large-head-dim shapes (S = 2048, d up to 576) take 15 s each instrumented; the d-tiled
      # MM1 path they cover also runs in ValueDim (d = 576, 1024), the random configurations and
      # HeadDimGridLarge (d and dv 176..576 at short lengths).
      # The head-dim grid runs whole (label head_dim_grid, 15 entries): every d and dv in 1..160
      # and every 16th to 576, every dtype and masking path, on every target this CPU runs. It
      # costs ~105 s of CPU here (HeadDimGridSmall 70 s, HeadDimGridLarge 36 s; 109 s wall at
      # -j 2 under a load average of 6). To trim it to every d, dv <= 160 on every target:
      # FLASHCTE_ASAN_CTEST_ARGS="-LE long|head_dim_grid_large" (ctest keeps only the last -LE).
      ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1:check_initialization_order=1 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        ctest --test-dir build-asan -LE long --no-tests=error \
        -E "$asan_exclude" \
        -j "$JOBS" --output-on-failure \
        --timeout 1200 ${FLASHCTE_ASAN_CTEST_ARGS:-}
      # The targets the instrumented run covered (the head-dim grid, tests/simd and the
      # determinism tests run every one this CPU runs), stated plainly: an AVX-512 target this
      # CPU cannot run is left out of the build (above) or reported as NOT run.
      report="$(build-asan/tests/flashcte_simd_report)"
      printf '%s\n' "$report"
      summary+=("asan+ubsan: ctest -LE long passed" "asan+ubsan: ${report%%$'\n'*}")
      while IFS= read -r line; do
        if [[ $line == *"NOT run"* ]]; then summary+=("asan+ubsan: ${line#  }"); fi
      done <<<"$report"
      ;;

    tsan)
      section "tsan: build (clang, libomp)"
      archer="$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | sort -V | tail -1 || true)"
      if [[ -z "$archer" ]]; then
        echo "libarcher.so not found (Debian: libomp-dev)" >&2
        exit 1
      fi
      # -g1 (line tables) as in the ASan build: all a report needs.
      CC=clang CXX=clang++ cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
        -DFLASHCTE_SANITIZE=thread -DFLASHCTE_BUILD_TOOLS=OFF >/dev/null
      # Only the threaded tests (the rest of the suite runs under ASan). One executable holds
      # them all; it links the layer's float64 oracle (flashcte_layer_reference) for the layer's.
      cmake --build build-tsan -j "$JOBS" --target flashcte_reliability_threads_tests
      section "tsan: ctest -L threads (Archer: $archer)"
      log=build-tsan/tsan.log
      # The layer's projections run in OpenBLAS (loaded at run time, not instrumented:
      # ignore_noninstrumented_modules keeps its interceptor calls out of the reports). The tests'
      # GEMMs are below OpenBLAS's own threading threshold, so they run on the calling thread, and
      # OPENBLAS_NUM_THREADS=1 would not keep OpenBLAS's threads away anyway: the layer sets
      # OpenBLAS's thread count to its own num_threads on every call (src/layer/blas.cc).
      OMP_TOOL_LIBRARIES="$archer" ARCHER_OPTIONS="verbose=1" \
      TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1" \
        ctest --test-dir build-tsan -L threads --no-tests=error --output-on-failure -V --timeout 1800 >"$log" 2>&1 ||
        { tail -n 200 "$log"; exit 1; }
      grep -E "tests passed|Total Test time" "$log"
      # Without Archer the run would be meaningless (or full of libgomp-style false positives).
      if ! grep -q "Archer detected OpenMP application with TSan" "$log"; then
        echo "Archer did not load: the TSan run does not see OpenMP's synchronization" >&2
        exit 1
      fi
      if grep -q "WARNING: ThreadSanitizer" "$log"; then
        grep -A 30 "WARNING: ThreadSanitizer" "$log" | head -n 120
        exit 1
      fi
      summary+=("tsan: ctest -L threads passed, Archer active, no reports")
      ;;

    fuzz)
      section "fuzz: build (clang, libFuzzer + ASan + UBSan)"
      CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DFLASHCTE_BUILD_FUZZERS=ON -DFLASHCTE_BUILD_TESTS=OFF >/dev/null
      cmake --build build-fuzz -j "$JOBS" --target flashcte_npy_fuzzer flashcte_args_fuzzer
      # Seeds: well-formed .npy files of every dtype and both orders, and argument vectors with
      # every flag kind (the fuzzer splits its input at NUL bytes).
      seeds=build-fuzz/seeds
      mkdir -p "$seeds/npy" "$seeds/args" build-fuzz/corpus-npy build-fuzz/corpus-args \
        build-fuzz/artifacts
      npy() {  # npy FILE DESCR FORTRAN SHAPE DATA_BYTES
        local dict="{'descr': '$2', 'fortran_order': $3, 'shape': $4, }"
        local len=$(( (10 + ${#dict} + 1 + 63) / 64 * 64 - 10 ))
        {
          printf '\x93NUMPY\x01\x00'
          printf "\\x$(printf %02x $((len & 255)))\\x$(printf %02x $((len >> 8)))"
          printf '%-*s\n' $((len - 1)) "$dict"
          head -c "$5" /dev/zero
        } >"$1"
      }
      npy "$seeds/npy/f4.npy" '<f4' False '(2, 3, 4)' 96
      npy "$seeds/npy/f2_fortran.npy" '<f2' True '(3, 5)' 30
      npy "$seeds/npy/f8.npy" '<f8' False '(4,)' 32
      npy "$seeds/npy/i4.npy" '<i4' False '(7, 1)' 28
      npy "$seeds/npy/i8_scalar.npy" '<i8' False '()' 8
      npy "$seeds/npy/empty.npy" '<f4' False '(0, 8)' 0
      printf -- '--path\0/tmp/x.npy\0--flag\0--n\0-5\0--x\0-1.5e3' >"$seeds/args/1"
      printf -- '--list\x001,2,3\0--dtype\0bfloat16\0--flag=false\0--n=1000' >"$seeds/args/2"
      printf -- '--help' >"$seeds/args/3"
      section "fuzz: ${FUZZ_SECONDS}s per target, in parallel"
      fuzz() {  # fuzz NAME: runs build-fuzz/tools/flashcte_NAME_fuzzer
        ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
          "build-fuzz/tools/flashcte_$1_fuzzer" -max_total_time="$FUZZ_SECONDS" \
          -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
          -artifact_prefix="build-fuzz/artifacts/$1-" -dict="tests/reliability/fuzz/$1.dict" \
          "build-fuzz/corpus-$1" "$seeds/$1" >"build-fuzz/fuzz-$1.log" 2>&1
      }
      rc_npy=0 rc_args=0
      fuzz npy &
      pid_npy=$!
      fuzz args &
      pid_args=$!
      wait "$pid_npy" || rc_npy=$?
      wait "$pid_args" || rc_args=$?
      for name in npy args; do
        runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "build-fuzz/fuzz-$name.log" |
          grep -o '[0-9]*$' || echo "?")
        corpus=$(ls "build-fuzz/corpus-$name" | wc -l)
        echo "$name fuzzer: $runs executions, corpus of $corpus inputs"
        summary+=("fuzz $name: $runs executions in ${FUZZ_SECONDS}s, corpus $corpus")
      done
      if [[ $rc_npy -ne 0 || $rc_args -ne 0 ]]; then
        for name in npy args; do tail -n 60 "build-fuzz/fuzz-$name.log"; done
        echo "a fuzzer found a crash; reproducer in build-fuzz/artifacts/" >&2
        exit 1
      fi
      ;;

    *)
      echo "unknown stage '$stage' (asan, tsan, fuzz)" >&2
      exit 2
      ;;
  esac
done

section "done"
printf '%s\n' "${summary[@]}"
