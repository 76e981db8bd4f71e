// What a test run must exercise on this CPU. A green run on a machine whose CPU has AVX-512 but
// whose AVX-512 code skipped says nothing about that code, so the fast paths the CPU has are
// required: a test that would skip one fails instead, and flashcte_simd_report exits non-zero
// when one did not run.
//
// Derived from the flags the OS reports in /proc/cpuinfo, not from Highway's or the library's own
// detection (which is what is being checked):
//   AVX3            avx512f (with avx512bw, avx512vl, avx512dq, avx512cd: Highway's AVX3)
//   native kernels  avx512_bf16 and avx512_vnni with AVX3: the vdpbf16ps prefill and decode kernels
//                   and the int8 vpdpwssd decode kernels, one table (src/simd/native_ops.h) that
//                   the library offers only where both extensions are present
// Not required, though the CPU may have it:
//   - under FLASHCTE_SIMD_TARGET capped below AVX3 (scripts/test.sh's AVX2 run): the cap is the
//     point of that run;
//   - what FLASHCTE_ALLOW_SKIP names (comma-separated: avx3, native, or all), the explicit
//     override for a machine that must skip (a broken extension, an emulator); every report of
//     a skip says it was allowed and by what.
// AMX (amx_bf16) becomes a requirement once the library has AMX kernels (issue 45); until then
// the report only says the CPU has it.
#ifndef FLASHCTE_TESTS_CPU_REQUIREMENTS_H_
#define FLASHCTE_TESTS_CPU_REQUIREMENTS_H_

#include <string>

namespace flashcte::test {

enum class FastPath { kAvx3, kNativeKernels };

// The name FLASHCTE_ALLOW_SKIP uses for `path`: "avx3", "native".
const char* fast_path_name(FastPath path);

// True when this run must exercise `path`. *reason says why, or why not (the CPU lacks it, the
// cap, the override), for the log either way.
bool must_run(FastPath path, std::string* reason);

// True when /proc/cpuinfo's x86 flags list `flag` (e.g. "amx_bf16").
bool cpu_has_flag(const std::string& flag);

}  // namespace flashcte::test

// Skips the current GoogleTest test with `message` where `path` is not required here, and fails it
// where it is (must_run): a required fast path that did not run is a failure, not a skip.
#define FLASHCTE_SKIP_UNLESS_REQUIRED(path, message)           \
  do {                                                         \
    std::string flashcte_reason;                               \
    if (::flashcte::test::must_run(path, &flashcte_reason)) {  \
      FAIL() << message << ", but " << flashcte_reason;        \
    }                                                          \
    GTEST_SKIP() << message << " (" << flashcte_reason << ")"; \
  } while (false)

#endif  // FLASHCTE_TESTS_CPU_REQUIREMENTS_H_
