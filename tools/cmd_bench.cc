// `flashcte bench`: one configuration, timed for flashcte and, on request, for two peers
// (bench_impls.h): the materialized matmul-softmax-matmul, and the sgemm roofline with OpenBLAS's
// best kernels for the CPU (openblas_core.h: may re-exec itself).
// and, alone, the arithmetic limit of the cores (--impl peak, peak.h): no attention is timed.
// Attention impls report GFLOP/s over the useful FLOPs, 4*d*heads*(unmasked query-key pairs), so
// a dense peer that also computes the masked half is charged for it; sgemm reports 2MNK/time.
// With --impl all the reps are interleaved (A, B, C, A, B, C, ...) so drift of clocks and
// temperature hits every impl alike; each impl is warmed up once and the medians are reported.
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/args.h"
#include "tools/attention_flags.h"
#include "tools/bench_decode.h"
#include "tools/bench_impls.h"
#include "tools/commands.h"
#include "tools/json.h"
#include "tools/openblas_core.h"
#include "tools/peak.h"
#include "tools/tensors.h"

#if FLASHCTE_HAVE_OPENBLAS
#include <cblas.h>
#endif
#include <omp.h>

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "bench";
constexpr int64_t kMaxLength = int64_t{1} << 24;

double PeakRssMiB() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

std::vector<FlagSpec> BenchFlagSpecs() {
  return {
      {"sq", FlagKind::kInt, "query length (default 4096)", 1, kMaxLength},
      {"skv", FlagKind::kInt, "KV length (default --sq)", 1, kMaxLength},
      {"d", FlagKind::kInt, "head dim (default 128)", 1, 1024},
      {"heads", FlagKind::kInt, "query heads (default 32)", 1, 4096},
      {"kv-heads", FlagKind::kInt, "KV heads, dividing --heads (default 8)", 1, 4096},
      {"causal", FlagKind::kBool, "causal mask (default true)"},
      {"dtype", FlagKind::kChoice, "flashcte's compute dtype (default float32)", 0, 0,
       "float32|bfloat16|float16|fp32|bf16|fp16"},
      {"threads", FlagKind::kInt, "threads for every impl (0: OpenMP's default)", 0, 4096},
      {"reps", FlagKind::kInt, "timed repetitions per impl after one warm-up (default 5)", 1,
       100000},
      {"impl", FlagKind::kChoice, "what to time (default flashcte)", 0, 0,
       "flashcte|materialized|sgemm|all|peak|bandwidth"},
      {"json", FlagKind::kBool, "one JSON object per impl and line"},
      {"q-block", FlagKind::kInt, "flashcte's query rows per work item (0: automatic)", 0,
       kMaxLength},
      {"kv-tile", FlagKind::kInt, "flashcte's KV columns per tile (0: automatic)", 0, kMaxLength},
      {"openblas-core", FlagKind::kString,
       "OpenBLAS kernels: auto (default for sgemm, all), inherit (default for materialized), "
       "or a core name such as Haswell, Zen, SkylakeX, Cooperlake"},
  };
}

std::vector<FlagSpec> AllBenchFlagSpecs() {
  std::vector<FlagSpec> specs = BenchFlagSpecs();
  for (const FlagSpec& spec : DecodeBenchFlagSpecs()) specs.push_back(spec);
  return specs;
}

// The flags --impl peak has no use for: it times no attention and no OpenBLAS.
constexpr const char* kNotForPeak[] = {"sq",     "skv",   "d",       "heads",   "kv-heads",
                                       "causal", "dtype", "q-block", "kv-tile", "openblas-core"};

void PrintBenchHelp(const std::vector<FlagSpec>& specs) {
  std::printf(
      "usage: flashcte bench [--sq N --skv N --d N --heads N --kv-heads N --causal B "
      "--dtype D\n                       --threads T --reps R --impl I --json --q-block N "
      "--kv-tile N\n                       --openblas-core C]\n"
      "       flashcte bench --impl peak [--threads T --reps R --json]\n"
      "       flashcte bench --impl bandwidth [--threads T --reps R --json]\n"
      "       flashcte bench --decode [--batch B --heads N --kv-heads N --d N --cached N\n"
      "                       --new T --dtype D --threads T --reps R --cold B --block-size N\n"
      "                       --kv-dtype K --json]\n\n"
      "Times one configuration (q (heads, Sq, d), k (kv_heads, d, Skv), v (kv_heads, Skv, d),\n"
      "uniform [0, 1) inputs, scale 1/sqrt(d)). Reports the median over --reps after one\n"
      "warm-up; GFLOP/s counts 4*d*heads*(unmasked query-key pairs) for attention impls and\n"
      "2MNK for sgemm. peak_rss_mib is the process's ru_maxrss after the impl's warm-up (impls\n"
      "are set up in the order flashcte, materialized, sgemm, so a later impl's figure\n"
      "includes the earlier ones' buffers).\n\n"
      "sgemm is the roofline, so it runs with OpenBLAS's best kernels for this CPU: with\n"
      "--openblas-core auto it drops OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE inherited from the\n"
      "environment and, when OpenBLAS's own choice of core is older than the CPU's ISA\n"
      "(AVX-512 -> SkylakeX, with AVX512_BF16 Cooperlake; AVX2+FMA -> Haswell, on AMD Zen),\n"
      "re-executes itself with OPENBLAS_CORETYPE set. The core used and why are printed\n"
      "(JSON: openblas_core, openblas_core_detected, openblas_core_overridden,\n"
      "openblas_core_reason).\n\n"
      "--impl peak measures the arithmetic limit of the cores instead: back-to-back independent\n"
      "fp32 multiply-adds per SIMD target the CPU runs (2 FLOPs per lane), and the native bf16\n"
      "dot product vdpbf16ps when the CPU has AVX512_BF16 (64 FLOPs per zmm instruction: 32\n"
      "bf16 products and 32 adds), on 1 thread and on --threads (default: all), median and\n"
      "best of --reps rounds of about 0.1 s per measurement. JSON lines: impl \"peak\", kind\n"
      "(fma_f32, bf16_dot), target, threads, gflops (median), best_gflops, counting.\n\n"
      "--impl bandwidth measures the streaming read bandwidth of memory: 1 and --threads\n"
      "threads sum a buffer of 8x the L3 cache (at least 256 MiB), --reps passes each.\n\n"
      "--decode times decode_attention: --new tokens per sequence at positions --cached ..\n"
      "against a (batch, kv_heads, cached + new, d) K/V cache, scale 1/sqrt(d). It prints the\n"
      "median time per call, the K/V bytes a call reads (batch x kv_heads x (cached + new) x\n"
      "2d x dtype size), their GB/s, the read bandwidth measured on --threads threads and the\n"
      "ratio. With --cold (default) a timed bandwidth pass before each call evicts the caches\n"
      "from L3 and is the bandwidth sample (the two are interleaved). With --block-size N the\n"
      "same call also runs on a paged copy of the cache (pages of N slots in vLLM's "
      "(num_blocks,\n"
      "kv_heads, block_size, d) layout, at shuffled places), interleaved with the dense call,\n"
      "and vs_dense is the median of the per-rep dense/paged time ratios. With --kv-dtype the\n"
      "cache is 8-bit (int8, float8_e4m3fn, float8_e5m2; one scale per tensor) and q and out\n"
      "are --dtype; the dtype column names the cache's.\n\n"
      "flags:\n%s",
      FlagsHelp(specs).c_str());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The first flag given that --impl `which` (or the prefill bench) does not use, as a message;
// "" when there is none.
std::string MisplacedFlag(const ParsedFlags& f, const std::string& which) {
  for (const FlagSpec& spec : DecodeBenchFlagSpecs()) {
    if (f.has(spec.name) && std::string(spec.name) != "decode") {
      return std::string("--") + spec.name + ": only used with --decode";
    }
  }
  if (which != "bandwidth" && which != "peak") return "";
  for (const char* flag : kNotForPeak) {
    if (f.has(flag)) {
      return std::string("--") + flag +
             (which == "peak" ? ": not used by --impl peak, which times no attention and no "
                                "OpenBLAS (it takes --threads, --reps and --json)"
                              : ": not used by --impl bandwidth (it takes --threads, --reps and "
                                "--json)");
    }
  }
  return "";
}

// The prefill bench's configuration from the flags; false with a usage error's message.
bool ReadConfig(const ParsedFlags& f, const std::string& which, int threads, BenchConfig* out,
                std::string* error) {
  BenchConfig& c = *out;
  c.sq = f.integer("sq", 4096);
  c.skv = f.integer("skv", c.sq);
  c.d = f.integer("d", 128);
  c.heads = f.integer("heads", 32);
  c.kv_heads = f.integer("kv-heads", 8);
  c.causal = f.boolean("causal", true);
  c.dtype = DType::kFloat32;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &c.dtype);
  c.threads = threads;
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  c.tiles.q_block = f.integer("q-block", 0);
  c.tiles.kv_tile = f.integer("kv-tile", 0);
  if (c.heads % c.kv_heads != 0) {
    *error = "--kv-heads: " + std::to_string(c.kv_heads) +
             " must divide --heads = " + std::to_string(c.heads);
    return false;
  }
  if (f.has("openblas-core") && which == "flashcte") {
    *error = "--openblas-core: --impl flashcte does not use OpenBLAS";
    return false;
  }
  if (const std::string& core = f.text("openblas-core");
      !std::all_of(core.begin(), core.end(), [](char ch) {
        return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_';
      })) {
    *error =
        "--openblas-core: expected auto, inherit or an OpenBLAS core name (letters, "
        "digits, '_'), got '" +
        core + "'";
    return false;
  }
  return true;
}

// Sets up and warms up each impl in turn, noting the process's peak RSS after each, then times
// --reps rounds of them interleaved; false with a runtime error's message.
bool TimeImpls(const std::vector<std::unique_ptr<Impl>>& impls, int reps,
               std::vector<std::vector<double>>* ms_out, std::vector<double>* rss,
               std::string* error) {
  rss->assign(impls.size(), 0.0);
  for (size_t i = 0; i < impls.size(); ++i) {
    if (!impls[i]->Setup(error) || !impls[i]->Run(error)) {
      *error = std::string(impls[i]->name()) + ": " + *error;
      return false;
    }
    (*rss)[i] = PeakRssMiB();
  }
  std::vector<std::vector<double>>& ms = *ms_out;
  ms.assign(impls.size(), {});
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < impls.size(); ++i) {
      // OpenBLAS's idle workers spin for up to ~0.1 s after a call, and OpenMP's for a moment;
      // when impls alternate, let them go to sleep so they do not steal cores from the next one.
      if (impls.size() > 1) std::this_thread::sleep_for(std::chrono::milliseconds(150));
      const auto start = std::chrono::steady_clock::now();
      if (!impls[i]->Run(error)) {
        *error = std::string(impls[i]->name()) + ": " + *error;
        return false;
      }
      ms[i].push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
  }
  return true;
}

void PrintResults(const BenchConfig& c, const std::vector<std::unique_ptr<Impl>>& impls, int reps,
                  bool json, const std::vector<std::vector<double>>& ms,
                  const std::vector<double>& rss) {
  if (!json) {
    std::printf("%-13s %-9s %6s %6s %5s %5s/%-3s %3s %11s %9s %9s\n", "impl", "dtype", "sq", "skv",
                "d", "heads", "kv", "thr", "median_ms", "GFLOP/s", "rss_MiB");
  }
  for (size_t i = 0; i < impls.size(); ++i) {
    const double median = Median(ms[i]);
    const double gflops = impls[i]->Flops() / (median * 1e-3) * 1e-9;
    if (json) {
      Json j = {{"impl", impls[i]->name()},
                {"dtype", dtype_name(c.dtype)},
                {"causal", c.causal},
                {"sq", c.sq},
                {"skv", c.skv},
                {"d", c.d},
                {"heads", c.heads},
                {"kv_heads", c.kv_heads},
                {"threads", c.threads},
                {"median_ms", median},
                {"gflops", gflops},
                {"peak_rss_mib", rss[i]},
                {"reps", reps},
                {"min_ms", *std::min_element(ms[i].begin(), ms[i].end())},
                {"flops", impls[i]->Flops()}};
      impls[i]->AddJson(&j);
      PrintJsonLine(j);
    } else {
      std::printf("%-13s %-9s %6lld %6lld %5lld %5lld/%-3lld %3d %11.3f %9.2f %9.1f\n",
                  impls[i]->name(), dtype_name(c.dtype), static_cast<long long>(c.sq),
                  static_cast<long long>(c.skv), static_cast<long long>(c.d),
                  static_cast<long long>(c.heads), static_cast<long long>(c.kv_heads), c.threads,
                  median, gflops, rss[i]);
    }
  }
  const bool openblas_used = std::any_of(impls.begin(), impls.end(),
                                         [](const auto& impl) { return impl->UsesOpenBlas(); });
  if (!json && openblas_used) {
    std::printf("\nOpenBLAS core: %s (%s%s)\n", c.openblas.used.c_str(),
                c.openblas.overridden ? "OPENBLAS_CORETYPE set by this command: " : "",
                c.openblas.reason.c_str());
  }
}

// --impl flashcte, materialized, sgemm or all.
int PrefillBench(const ParsedFlags& f, const std::string& which, int threads, int reps, bool json) {
  BenchConfig c;
  std::string error;
  if (!ReadConfig(f, which, threads, &c, &error)) return UsageError(kCommand, error);
  std::vector<std::unique_ptr<Impl>> impls;
  if (which == "flashcte" || which == "all") impls.push_back(MakeFlashImpl(c));
#if FLASHCTE_HAVE_OPENBLAS
  if (which != "flashcte") {
    // Before anything is set up: this may re-execute the program with other OpenBLAS kernels.
    const std::string mode = f.text("openblas-core", which == "materialized" ? "inherit" : "auto");
    const bool dynamic_arch = std::strstr(openblas_get_config(), "DYNAMIC_ARCH") != nullptr;
    if (int rc =
            SelectOpenBlasCore(mode, openblas_get_corename(), dynamic_arch, &c.openblas, &error);
        rc != kExitOk) {
      return rc == kExitUsage ? UsageError(kCommand, error) : RuntimeError(kCommand, error);
    }
  }
  openblas_set_num_threads(c.threads);
  const double attention_flops = 4.0 * c.d * c.heads * UnmaskedPairs(c.sq, c.skv, c.causal);
  if (which == "materialized" || which == "all") {
    impls.push_back(MakeMaterializedImpl(c));
  }
  if (which == "sgemm" || which == "all") {
    impls.push_back(MakeSgemmImpl(c, attention_flops));
  }
#else
  if (which != "flashcte" && which != "all") {
    return RuntimeError(kCommand, "--impl " + which + ": this build has no OpenBLAS");
  }
  if (which == "all") {
    std::fprintf(stderr, "flashcte bench: no OpenBLAS in this build; timing flashcte only\n");
  }
#endif

  std::vector<std::vector<double>> ms;
  std::vector<double> rss;
  if (!TimeImpls(impls, reps, &ms, &rss, &error)) return RuntimeError(kCommand, error);
  PrintResults(c, impls, reps, json, ms, rss);
  return kExitOk;
}

}  // namespace

int BenchCommand(const std::vector<std::string>& args) {
  ParsedFlags f;
  if (int rc = ParseCommandFlags(kCommand, args, AllBenchFlagSpecs(), PrintBenchHelp, &f);
      rc != kContinue) {
    return rc;
  }
  const std::string which = f.text("impl", "flashcte");
  const int reps = static_cast<int>(f.integer("reps", 5));
  const bool json = f.boolean("json", false);
  int threads = static_cast<int>(f.integer("threads", 0));
  if (threads == 0) threads = omp_get_max_threads();
  if (f.boolean("decode", false)) return DecodeBench(f);
  if (std::string misplaced = MisplacedFlag(f, which); !misplaced.empty()) {
    return UsageError(kCommand, misplaced);
  }
  if (which == "bandwidth") return BandwidthBench(threads, reps, json);
  if (which == "peak") {
    PrintPeak(MeasurePeak(threads, reps), reps, json);
    return kExitOk;
  }
  return PrefillBench(f, which, threads, reps, json);
}

}  // namespace flashcte::tools
