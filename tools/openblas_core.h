// Which OpenBLAS kernel set (OPENBLAS_CORETYPE) the SGEMM roofline of `flashcte bench` runs
// with. OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels from CPUID when the library
// loads, and older releases misdetect newer CPUs: OpenBLAS 0.3.21 calls a recent Xeon
// `Prescott`, whose SSE3 SGEMM ran at 57 GFLOP/s where the same machine's SkylakeX/Cooperlake
// kernels ran at 312. A roofline measured with the wrong kernels makes every ratio to it look
// better than it is, so the bench checks OpenBLAS's choice against the CPU's ISA and, when the
// choice is older, re-executes itself with OPENBLAS_CORETYPE set (OpenBLAS reads it only at load
// time). This is done only by the benchmark command that measures the roofline; tests and CI
// never set OPENBLAS_CORETYPE.
#ifndef FLASHCTE_TOOLS_OPENBLAS_CORE_H_
#define FLASHCTE_TOOLS_OPENBLAS_CORE_H_

#include <string>

#include "src/core/cpu.h"

namespace flashcte::tools {

using internal::CpuVendor;

struct CpuIsa {
  CpuVendor vendor = CpuVendor::kOther;
  bool avx = false;
  bool avx2_fma = false;     // AVX2 and FMA3
  bool avx512 = false;       // AVX-512 F, BW, DQ and VL, with the OS saving zmm state
  bool avx512_bf16 = false;  // AVX512_BF16 as well
};

// This CPU, from the library's probe (src/core/cpu.h).
CpuIsa DetectCpuIsa();

// "AVX-512 F/BW/DQ/VL + AVX512_BF16", "AVX2+FMA", ...
std::string DescribeIsa(const CpuIsa& isa);

// Kernel generations, in order: what an OpenBLAS core's kernels need, and what a CPU offers.
enum class IsaTier {
  kUnknown = -1,
  kSse = 0,
  kAvx = 1,
  kAvx2Fma = 2,
  kAvx512 = 3,
  kAvx512Bf16 = 4
};

IsaTier TierOfCpu(const CpuIsa& isa);
// The ISA an OpenBLAS core name's kernels use (case-insensitive); kUnknown for a name this table
// does not list (a core newer than OpenBLAS 0.3.21, or a typo).
IsaTier TierOfOpenBlasCore(const std::string& core);

struct CoreChoice {
  std::string coretype;  // the OPENBLAS_CORETYPE to run with; empty: keep OpenBLAS's choice
  std::string reason;    // one sentence, for the table and the JSON line
};

// The rule: keep `detected` unless its kernels are older than what `isa` supports, then use the
// best core for the ISA (see the measurements in openblas_core.cc).
CoreChoice ChooseOpenBlasCore(const std::string& detected, const CpuIsa& isa);

// What the benchmark process ended up with.
struct OpenBlasSelection {
  std::string used;         // openblas_get_corename() in the process that measures
  std::string detected;     // OpenBLAS's own choice, when known (empty otherwise)
  bool overridden = false;  // OPENBLAS_CORETYPE was set by this command
  std::string reason;
};

// Applies `mode` to this process, whose OpenBLAS reports `current_core` (and was built with
// DYNAMIC_ARCH, i.e. reads OPENBLAS_CORETYPE, when `dynamic_arch`; without it nothing can change
// and a core name is a runtime error):
//   "auto"     OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE inherited from the environment are removed
//              (re-exec), then ChooseOpenBlasCore decides (re-exec when it overrides);
//   "inherit"  the environment as it is, no re-exec;
//   a name     OPENBLAS_CORETYPE=name (re-exec), checked against the CPU's ISA first.
// Re-executes /proc/self/exe with the same arguments when the kernels must change, so on success
// that branch does not return. Returns 0 with *out filled when this process should measure,
// 2 (usage) or 1 (runtime) with *error set. Environment variables FLASHCTE_BENCH_OPENBLAS_*
// carry the state across the re-exec and stop a second one.
int SelectOpenBlasCore(const std::string& mode, const std::string& current_core, bool dynamic_arch,
                       OpenBlasSelection* out, std::string* error);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_OPENBLAS_CORE_H_
