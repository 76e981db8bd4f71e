// flashcte_simd_report: which SIMD targets this build compiled and which of them this CPU ran, for
// the CI log (scripts/test.sh and scripts/ci_sanitizers.sh print it after their ctest). A test log
// that says "passed" says nothing about AVX-512 code on a machine without AVX-512; this says so.
//
// Compiled: HWY_TARGETS as seen here. This file is built by the same CMake project and compiler
// with the same flags as src/simd/ops.cc (no per-target -m options anywhere), so it is the set
// foreach_target.h expanded there. Run: hwy::SupportedAndGeneratedTargets(), the compiled targets
// whose CPUID bits and OS-enabled register state (XCR0) Highway found on x86, or on aarch64 the
// kernel's hardware capabilities (HWCAP: AES for NEON, SVE, SVE2) and the SVE vector length
// (SVE_256 and SVE2_128 need exactly 256 and 128 bits). Every test that iterates
// over targets (tests/simd, simd_targets_test, head_dim_grid_test, determinism_test) runs exactly
// these; this program also runs one small attention_cte call on each of them and checks that the
// kernel dispatched to it and returned a convex combination of the values, so "run" is literal.
//
// Output (one summary line, then one line per target; for AVX-512, which of its two bfloat16
// matmul paths ran, each also checked with a call):
//   SIMD targets: compiled AVX3 AVX2 SSE4 SSSE3 SCALAR; run AVX3 AVX2 SSE4 SSSE3 SCALAR; ...
//     AVX3 (AVX-512): compiled, run
//       AVX3 bfloat16 matmuls: native vdpbf16ps run (automatic choice); widened to float32 run
//     AVX3 (AVX-512): compiled, NOT run: this CPU lacks AVX-512      (on a CPU without it)
// On aarch64 each run target also runs a bfloat16 call, which is widened to float32 there (the
// native kernels, native_ops.h, are x86 only):
//     SVE2 bfloat16 matmuls: widened to float32 run (no native BFDOT/BFMMLA kernels built)
// Then the fast paths this CPU requires a test run to exercise (tests/cpu_requirements.h: AVX3
// where /proc/cpuinfo lists AVX-512, the native kernels where it also lists avx512_bf16 and
// avx512_vnni), each with whether it ran and why it is or is not required.
// Exit status 1 when a runnable target does not dispatch or its call fails, or a required fast
// path did not run.
//
// --simulate-no-avx512 (a CTest entry checks the wording with it): Highway is told to treat the
// AVX-512 targets as unsupported (hwy::DisableTargets), which is what it concludes on a CPU or OS
// without AVX-512, and the summary line says that it is a simulation.
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"
#include "tests/cpu_requirements.h"

namespace {

// Every target bit Highway 1.0 defines for x86 and aarch64, best first (as Highway ranks them),
// with what it needs from the CPU.
struct Known {
  int64_t bit;
  const char* what;  // the instruction set, for the log
  const char* lack;  // why a CPU may not run it
};

std::vector<Known> known_targets() {
  std::vector<Known> k;
#if HWY_ARCH_X86
  k.push_back({HWY_AVX3_DL, "AVX-512 + VNNI/VBMI2/BITALG/VPOPCNTDQ/VAES/GFNI",
               "this CPU lacks the AVX-512 extensions of Ice Lake"});
  k.push_back({HWY_AVX3, "AVX-512", "this CPU lacks AVX-512"});
  k.push_back({HWY_AVX2, "AVX2 + FMA + F16C", "this CPU lacks AVX2/FMA/F16C/BMI2"});
  k.push_back({HWY_SSE4, "SSE4.2 + CLMUL/AES, 128-bit", "this CPU lacks SSE4.2"});
  k.push_back({HWY_SSSE3, "SSSE3, 128-bit", "this CPU lacks SSSE3"});
#endif
#if HWY_ARCH_ARM_A64
  // SVE2_128 and SVE_256 are SVE2 and SVE compiled for one vector length (Neoverse N2 and V1):
  // Highway picks them only where the CPU's vectors are exactly that long.
  k.push_back({HWY_SVE2_128, "SVE2, 128-bit vectors",
               "this CPU lacks SVE2, or its SVE vectors are not 128 bits"});
  k.push_back({HWY_SVE_256, "SVE, 256-bit vectors",
               "this CPU lacks SVE, or its SVE vectors are not 256 bits"});
  k.push_back({HWY_SVE2, "SVE2, any vector length", "this CPU lacks SVE2"});
  k.push_back({HWY_SVE, "SVE, any vector length", "this CPU lacks SVE"});
  k.push_back({HWY_NEON, "NEON + AES, 128-bit", "this CPU lacks NEON or AES"});
#endif
  k.push_back({HWY_EMU128, "portable 128-bit emulation", "not available"});
  k.push_back({HWY_SCALAR, "no SIMD", "not available"});
  return k;
}

// A small call on the current target: 2 heads of 5 x 64 keys, d = dv = 64 (a whole number of
// vectors on every target), values in [1, 2], so every output must lie in [1, 2]. Every input is
// a multiple of 1/128 below 2, exact in bfloat16 too.
bool smoke_call(flashcte::DType dtype, std::string* why) {
  const int64_t sq = 5, skv = 64, d = 64, bs = 2;
  std::vector<float> q(bs * sq * d), k(bs * d * skv), v(bs * skv * d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>((i * 37) % 128) / 128.0f;
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>((i * 53) % 128) / 128.0f;
  for (size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + static_cast<float>((i * 29) % 128) / 128.0f;
  // bfloat16: the upper half of the float32 bits (exact for these values).
  auto to_bf16 = [](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &x[i], 4);
      b[i] = static_cast<uint16_t>(bits >> 16);
    }
    return b;
  };
  const bool bf16 = dtype == flashcte::DType::kBFloat16;
  const std::vector<uint16_t> qb = to_bf16(q), kb = to_bf16(k), vb = to_bf16(v);
  std::vector<float> out(bs * sq * d, NAN);
  std::vector<uint16_t> out_b(bs * sq * d, 0x7FC0);  // NaN
  flashcte::Options options;
  options.scale = 0.125f;
  flashcte::Outputs outputs;
  outputs.out = flashcte::MutableTensorView::contiguous(
      bf16 ? static_cast<void*>(out_b.data()) : out.data(), dtype, {bs, sq, d});
  const flashcte::Status s = flashcte::attention_cte(
      flashcte::TensorView::contiguous(bf16 ? static_cast<const void*>(qb.data()) : q.data(), dtype,
                                       {bs, sq, d}),
      flashcte::TensorView::contiguous(bf16 ? static_cast<const void*>(kb.data()) : k.data(), dtype,
                                       {bs, d, skv}),
      flashcte::TensorView::contiguous(bf16 ? static_cast<const void*>(vb.data()) : v.data(), dtype,
                                       {bs, skv, d}),
      outputs, options);
  if (!s.ok) {
    *why = s.message;
    return false;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    float x = out[i];
    if (bf16) {
      const uint32_t bits = static_cast<uint32_t>(out_b[i]) << 16;
      std::memcpy(&x, &bits, 4);
    }
    if (!(x >= 1.0f && x <= 2.0f)) {
      *why = "an output outside the values' range [1, 2]: " + std::to_string(x);
      return false;
    }
  }
  return true;
}

// For an AVX-512 target: which of the two bfloat16 matmul paths ran (src/simd/native_ops.h), as a
// line of the report. Native needs AVX512_BF16; the automatic policy picks it on AMD only.
std::string bf16_line(const std::string& target, bool* ok, bool* native_ran) {
  namespace simd = flashcte::simd;
  std::string line = "    " + target + " bfloat16 matmuls: ";
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
  const bool auto_native = simd::native_ops_for(simd::ops()) != nullptr;
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  const bool native = simd::native_ops_for(simd::ops()) != nullptr;
  std::string why;
  if (native) {
    if (smoke_call(flashcte::DType::kBFloat16, &why)) {
      *native_ran = true;
      line += std::string("native vdpbf16ps run") + (auto_native ? " (automatic choice)" : "");
    } else {
      *ok = false;
      line += "native vdpbf16ps FAILED to run: " + why;
    }
  } else {
    line += "native vdpbf16ps NOT run: this CPU lacks AVX512_BF16";
  }
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kWiden);
  why.clear();
  if (smoke_call(flashcte::DType::kBFloat16, &why)) {
    line += std::string("; widened to float32 run") + (auto_native ? "" : " (automatic choice)");
  } else {
    *ok = false;
    line += "; widened to float32 FAILED to run: " + why;
  }
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
  return line;
}

#if HWY_ARCH_ARM_A64
// For an aarch64 target: bfloat16 is widened to float32 (no native kernel table may be offered),
// checked with a call.
std::string arm_bf16_line(const std::string& target, bool* ok) {
  std::string line = "    " + target + " bfloat16 matmuls: ";
  std::string why;
  if (flashcte::simd::native_ops_for(flashcte::simd::ops()) != nullptr) {
    why = "a native kernel table was offered";
  } else if (smoke_call(flashcte::DType::kBFloat16, &why)) {
    return line + "widened to float32 run (no native BFDOT/BFMMLA kernels built)";
  }
  *ok = false;
  return line + "widened to float32 FAILED to run: " + why;
}
#endif

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : " ") + n;
  return s.empty() ? "none" : s;
}

}  // namespace

int main(int argc, char** argv) {
  // The simulation exists on x86 only (elsewhere it would report a CPU it did not simulate).
  const bool simulate = HWY_ARCH_X86 && argc == 2 && std::string(argv[1]) == "--simulate-no-avx512";
  if (argc > 1 && !simulate) {
    std::fprintf(stderr, "usage: %s%s\n", argv[0], HWY_ARCH_X86 ? " [--simulate-no-avx512]" : "");
    return 2;
  }
#if HWY_ARCH_X86
  if (simulate) {
    hwy::DisableTargets(HWY_AVX3 | HWY_AVX3_DL);
    // Highway 1.0 keeps the dispatch's chosen target across DisableTargets; a mock of what is
    // left makes it choose again, as it would have on such a CPU.
    hwy::SetSupportedTargetsForTest(hwy::SupportedTargets());
  }
#endif
  // The kernel's choice first, as a caller of the library makes it: Highway 1.0.3's first
  // hwy::SupportedTargets() call, when it is not made by the dispatch itself, leaves the dispatch
  // choosing without SVE_256 and SVE2_128 (it adds them after updating the chosen target).
  const std::string chosen = flashcte::simd_target();
  const int64_t compiled = HWY_TARGETS;
  const int64_t supported = hwy::SupportedTargets();
  int64_t runnable = 0;
  for (int64_t t : hwy::SupportedAndGeneratedTargets()) runnable |= t;

  std::vector<std::string> compiled_names, run_names, lines;
  bool ok = true, native_ran = false;
  for (const Known& t : known_targets()) {
    const std::string name = hwy::TargetName(t.bit);
    const std::string label = "  " + name + " (" + t.what + "): ";
    if (compiled & t.bit) compiled_names.push_back(name);
    if (runnable & t.bit) {
      hwy::SetSupportedTargetsForTest(t.bit);
      std::string why;
      if (flashcte::simd_target() != name) {
        why = "the kernel dispatched to " + flashcte::simd_target() + " instead";
      } else {
        smoke_call(flashcte::DType::kFloat32, &why);
      }
      if (why.empty()) {
        run_names.push_back(name);
        lines.push_back(label + "compiled, run");
        if (name.rfind("AVX3", 0) == 0) lines.push_back(bf16_line(name, &ok, &native_ran));
#if HWY_ARCH_ARM_A64
        lines.push_back(arm_bf16_line(name, &ok));
#endif
      } else {
        ok = false;
        lines.push_back(label + "compiled, FAILED to run: " + why);
      }
      hwy::SetSupportedTargetsForTest(0);
    } else if (compiled & t.bit) {
      const char* cap = std::getenv("FLASHCTE_SIMD_TARGET");
      const bool capped = cap != nullptr && *cap != '\0' && !simulate;
      lines.push_back(label + "compiled, NOT run: " +
                      (capped ? std::string("FLASHCTE_SIMD_TARGET=") + cap +
                                    " disabled it (the CPU may have it)"
                              : t.lack));
    } else if ((supported & t.bit) && t.bit != HWY_EMU128 && t.bit != HWY_SCALAR) {
      // e.g. AVX3_DL, which Highway 1.0 compiles only with HWY_WANT_AVX3_DL.
      lines.push_back(label + "not compiled (this CPU could run it)");
    }
  }
  std::printf("SIMD targets%s: compiled %s; run %s; the kernel picks %s on this CPU\n",
              simulate ? " (SIMULATED CPU without AVX-512)" : "", join(compiled_names).c_str(),
              join(run_names).c_str(), chosen.c_str());
  for (const std::string& line : lines) std::printf("%s\n", line.c_str());

  // What this CPU requires a run to exercise (tests/cpu_requirements.h), and whether it ran.
  // A simulated CPU without AVX-512 requires nothing of it.
  using flashcte::test::FastPath;
  std::printf("Required fast paths:\n");
  const bool avx3_ran = std::find(run_names.begin(), run_names.end(), "AVX3") != run_names.end();
  for (const auto& [path, ran] :
       {std::pair{FastPath::kAvx3, avx3_ran}, std::pair{FastPath::kNativeKernels, native_ran}}) {
    std::string reason;
    const bool required = !simulate && flashcte::test::must_run(path, &reason);
    if (simulate) reason = "not required: simulated CPU without AVX-512";
    const char* status = ran ? "run" : required ? "REQUIRED but NOT run" : "not run";
    std::printf("  %s: %s; %s\n", flashcte::test::fast_path_name(path), status, reason.c_str());
    if (required && !ran) ok = false;
  }
  if (flashcte::test::cpu_has_flag("amx_bf16")) {
    std::printf("  amx: not run; the CPU lists amx_bf16, the library has no AMX kernels yet\n");
  }
  return ok ? 0 : 1;
}
