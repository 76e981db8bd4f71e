#include "tools/openblas_core.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>
#include <vector>

#include "tools/commands.h"

namespace flashcte::tools {
namespace {

// The state carried across the re-exec. STAGE is "clean" (inherited OPENBLAS_* removed, so
// OpenBLAS's own choice is visible) or "set" (OPENBLAS_CORETYPE set by us: never re-exec again).
constexpr char kStageVar[] = "FLASHCTE_BENCH_OPENBLAS_STAGE";
constexpr char kDetectedVar[] = "FLASHCTE_BENCH_OPENBLAS_DETECTED";
constexpr char kReasonVar[] = "FLASHCTE_BENCH_OPENBLAS_REASON";
constexpr char kCoreTypeVar[] = "OPENBLAS_CORETYPE";
// OpenBLAS 0.3.21 does not read OPENBLAS_L2_SIZE; later releases size their blocking from it.
// An inherited value is for some other purpose, so the roofline drops it with the core type.
constexpr char kL2SizeVar[] = "OPENBLAS_L2_SIZE";

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

const char* Env(const char* name) { return std::getenv(name); }

std::string EnvText(const char* name) {
  const char* v = Env(name);
  return v ? v : "";
}

// The best core for a CPU tier, or "" where the rule does not override. The AVX-512 and
// AVX2 rows follow the ISA; what measurement decided is that only an older core is overridden.
// On AMD EPYC Zen 4 (family 19h model 11h, AVX-512 F/BW/DQ/VL + BF16, 2 cores under KVM),
// OpenBLAS 0.3.21 DYNAMIC_ARCH detects Cooperlake by itself. A 3072^3 sgemm (`flashcte bench
// --impl sgemm --heads 8 --kv-heads 8 --causal false`), best of 4 sweeps of 3-16 interleaved
// rounds on a machine shared with compiles, GFLOP/s at 1 / 2 threads: Zen 107-111 / 210-219,
// Haswell 108-111 / 211-212, SkylakeX 103-107 / 208-209, Cooperlake 105-106 / 202-207,
// Sandybridge 92 / 172, Prescott 40 / 78. An sgemm loop timed by thread CPU time (immune to
// preemption), 1 thread: Zen 107-108, Haswell 106-108, SkylakeX 105-107, Cooperlake 104-105. The
// four modern kernel sets are within 2-3% there, about the noise of that machine (paired rounds
// gave Zen/Cooperlake medians of 1.003 and 1.006): too little to override a correct detection,
// while an older core costs up to 5x: on a recent Xeon (issue 10) OpenBLAS detects Prescott and
// runs 57 GFLOP/s where SkylakeX/Cooperlake gives 312.
const char* BestCoreFor(IsaTier tier, CpuVendor vendor) {
  switch (tier) {
    case IsaTier::kAvx512Bf16:
      return "Cooperlake";
    case IsaTier::kAvx512:
      return "SkylakeX";
    case IsaTier::kAvx2Fma:
      return vendor == CpuVendor::kAmd ? "Zen" : "Haswell";
    case IsaTier::kAvx:
    case IsaTier::kSse:
    case IsaTier::kUnknown:
      return "";  // AVX-only and older CPUs: OpenBLAS has known them for a decade
  }
  return "";
}

std::vector<std::string> ReadCmdline() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  std::string cur;
  for (char c : all) {
    if (c == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return args;
}

// Re-executes this program with the same arguments after applying `changes` (a null value
// unsets the variable). Returns only on failure, with the environment restored.
std::string ReExec(const std::vector<std::pair<const char*, const char*>>& changes) {
  const std::vector<std::string> args = ReadCmdline();
  if (args.empty()) return "cannot read /proc/self/cmdline";
  std::vector<std::pair<const char*, std::string>> saved;
  std::vector<const char*> unset_before;
  for (const auto& [name, value] : changes) {
    if (const char* old = Env(name)) {
      saved.emplace_back(name, old);
    } else {
      unset_before.push_back(name);
    }
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  std::vector<char*> argv;
  argv.reserve(args.size() + 1);
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  execv("/proc/self/exe", argv.data());
  std::string error = std::string("cannot re-execute /proc/self/exe: ") + std::strerror(errno);
  for (const auto& [name, value] : saved) setenv(name, value.c_str(), 1);
  for (const char* name : unset_before) unsetenv(name);
  return error;
}

}  // namespace

CpuIsa DetectCpuIsa() {
  const internal::CpuFeatures& cpu = internal::cpu_features();
  CpuIsa isa;
  isa.vendor = cpu.vendor;
  isa.avx = cpu.avx;
  isa.avx2_fma = cpu.avx2_fma;
  isa.avx512 = cpu.avx512;
  isa.avx512_bf16 = cpu.avx512_bf16;
  return isa;
}

std::string DescribeIsa(const CpuIsa& isa) {
  if (isa.avx512_bf16) return "AVX-512 F/BW/DQ/VL + AVX512_BF16";
  if (isa.avx512) return "AVX-512 F/BW/DQ/VL";
  if (isa.avx2_fma) return "AVX2+FMA";
  if (isa.avx) return "AVX";
  return "no AVX";
}

IsaTier TierOfCpu(const CpuIsa& isa) {
  if (isa.avx512_bf16) return IsaTier::kAvx512Bf16;
  if (isa.avx512) return IsaTier::kAvx512;
  if (isa.avx2_fma) return IsaTier::kAvx2Fma;
  if (isa.avx) return IsaTier::kAvx;
  return IsaTier::kSse;
}

IsaTier TierOfOpenBlasCore(const std::string& core) {
  // OpenBLAS 0.3.21's x86-64 DYNAMIC_ARCH core names (driver/others/dynamic.c), by the newest
  // instructions their kernels use. Excavator has AVX2 and its own kernels.
  static const std::pair<const char*, IsaTier> kCores[] = {
      {"unknown", IsaTier::kSse},
      {"katmai", IsaTier::kSse},
      {"coppermine", IsaTier::kSse},
      {"northwood", IsaTier::kSse},
      {"prescott", IsaTier::kSse},
      {"banias", IsaTier::kSse},
      {"atom", IsaTier::kSse},
      {"core2", IsaTier::kSse},
      {"penryn", IsaTier::kSse},
      {"dunnington", IsaTier::kSse},
      {"nehalem", IsaTier::kSse},
      {"athlon", IsaTier::kSse},
      {"opteron", IsaTier::kSse},
      {"opteron_sse3", IsaTier::kSse},
      {"barcelona", IsaTier::kSse},
      {"nano", IsaTier::kSse},
      {"bobcat", IsaTier::kSse},
      {"sandybridge", IsaTier::kAvx},
      {"bulldozer", IsaTier::kAvx},
      {"piledriver", IsaTier::kAvx},
      {"steamroller", IsaTier::kAvx},
      {"excavator", IsaTier::kAvx2Fma},
      {"haswell", IsaTier::kAvx2Fma},
      {"zen", IsaTier::kAvx2Fma},
      {"skylakex", IsaTier::kAvx512},
      {"cooperlake", IsaTier::kAvx512Bf16},
      {"sapphirerapids", IsaTier::kAvx512Bf16},
  };
  const std::string name = Lower(core);
  for (const auto& [n, tier] : kCores) {
    if (name == n) return tier;
  }
  return IsaTier::kUnknown;
}

CoreChoice ChooseOpenBlasCore(const std::string& detected, const CpuIsa& isa) {
  const IsaTier cpu = TierOfCpu(isa);
  const IsaTier core = TierOfOpenBlasCore(detected);
  const std::string cpu_text = "this CPU's ISA (" + DescribeIsa(isa) + ")";
  if (core == IsaTier::kUnknown) {
    return {"", "OpenBLAS's own choice " + detected + " is a core this rule does not rank: kept"};
  }
  if (core >= cpu) {
    return {"", "OpenBLAS's own choice " + detected + " is not older than " + cpu_text + ": kept"};
  }
  const std::string best = BestCoreFor(cpu, isa.vendor);
  if (best.empty()) {
    return {"", "OpenBLAS's own choice " + detected + " kept: no override below AVX2+FMA"};
  }
  return {best, "OpenBLAS chose " + detected + ", older than " + cpu_text +
                    ": OPENBLAS_CORETYPE=" + best};
}

int SelectOpenBlasCore(const std::string& mode, const std::string& current_core, bool dynamic_arch,
                       OpenBlasSelection* out, std::string* error) {
  const std::string stage = EnvText(kStageVar);
  out->used = current_core;
  if (!dynamic_arch) {  // one kernel set, fixed when OpenBLAS was built
    if (mode != "auto" && mode != "inherit") {
      *error = "--openblas-core " + mode +
               ": this OpenBLAS is built without DYNAMIC_ARCH, so its kernels (" + current_core +
               ") cannot be changed";
      return kExitRuntime;
    }
    out->detected = current_core;
    out->overridden = false;
    out->reason = "OpenBLAS built without DYNAMIC_ARCH: its one kernel set is " + current_core;
    return kExitOk;
  }
  if (mode == "inherit") {
    const char* inherited = Env(kCoreTypeVar);
    out->detected = inherited ? "" : current_core;
    out->overridden = false;
    out->reason = inherited ? std::string("--openblas-core inherit: OPENBLAS_CORETYPE=") +
                                  inherited + " from the environment"
                            : "--openblas-core inherit: OpenBLAS's own choice";
    return kExitOk;
  }
  if (stage == "set") {  // the re-executed process: report, never re-exec again
    out->detected = EnvText(kDetectedVar);
    out->overridden = true;
    out->reason = EnvText(kReasonVar);
    const std::string wanted = EnvText(kCoreTypeVar);
    if (Lower(wanted) != Lower(current_core)) {
      const std::string what =
          "OpenBLAS did not take OPENBLAS_CORETYPE=" + wanted + " (it runs " + current_core + ")";
      if (mode != "auto") {
        *error = "--openblas-core " + mode + ": " + what;
        return kExitRuntime;
      }
      out->overridden = false;
      out->reason += "; " + what;
    }
    return kExitOk;
  }

  const CpuIsa isa = DetectCpuIsa();
  if (mode != "auto") {  // an explicit core name
    const IsaTier tier = TierOfOpenBlasCore(mode);
    if (tier != IsaTier::kUnknown && tier > TierOfCpu(isa)) {
      *error = "--openblas-core " + mode +
               ": its kernels need instructions this CPU lacks (it has " + DescribeIsa(isa) + ")";
      return kExitUsage;
    }
    const std::string detected = Env(kCoreTypeVar) ? "" : current_core;
    const std::string reason = "--openblas-core " + mode;
    *error = ReExec({{kCoreTypeVar, mode.c_str()},
                     {kL2SizeVar, nullptr},
                     {kStageVar, "set"},
                     {kDetectedVar, detected.c_str()},
                     {kReasonVar, reason.c_str()}});
    return kExitRuntime;
  }

  // auto. First make OpenBLAS's own choice visible: drop inherited settings.
  std::string removed;
  if (stage.empty()) {
    for (const char* var : {kCoreTypeVar, kL2SizeVar}) {
      if (const char* v = Env(var)) {
        removed += std::string(removed.empty() ? "" : " and ") + var + "=" + v;
      }
    }
    if (!removed.empty()) {
      removed = "removed " + removed + " from the environment; ";
      const std::string failed = ReExec({{kCoreTypeVar, nullptr},
                                         {kL2SizeVar, nullptr},
                                         {kStageVar, "clean"},
                                         {kReasonVar, removed.c_str()}});
      std::fprintf(stderr, "flashcte bench: %s; measuring with the inherited OpenBLAS settings\n",
                   failed.c_str());
      out->detected = "";
      out->overridden = false;
      out->reason = "inherited OPENBLAS_* kept (" + failed + ")";
      return kExitOk;
    }
  } else {
    removed = EnvText(kReasonVar);  // stage "clean": what the first process removed
  }
  const CoreChoice choice = ChooseOpenBlasCore(current_core, isa);
  out->detected = current_core;
  if (!choice.coretype.empty()) {
    const std::string reason = removed + choice.reason;
    const std::string failed = ReExec({{kCoreTypeVar, choice.coretype.c_str()},
                                       {kStageVar, "set"},
                                       {kDetectedVar, current_core.c_str()},
                                       {kReasonVar, reason.c_str()}});
    std::fprintf(stderr, "flashcte bench: %s; measuring with OpenBLAS's choice %s\n",
                 failed.c_str(), current_core.c_str());
    out->overridden = false;
    out->reason = reason + " (not applied: " + failed + ")";
    return kExitOk;
  }
  out->overridden = false;
  out->reason = removed + choice.reason;
  return kExitOk;
}

}  // namespace flashcte::tools
