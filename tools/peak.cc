// `flashcte bench --impl peak` (peak.h): the per-target FMA loop, compiled once per Highway
// target, and the driver that times it and the bf16 dot on 1 and T threads.
//
// The loop keeps kChains accumulators and updates each once per iteration, acc = acc * m + a, so
// every multiply-add depends only on the same chain's previous one. To run at the FMA units'
// throughput a core needs latency x issue width independent chains in flight: 4-cycle FMAs on
// 2 pipes (Zen 3/4, Skylake-X, Golden Cove) need 8; 4 pipes (Neoverse V1/V2) need 16. kChains
// is 12 where there are 16 vector registers (SSE, AVX2: 12 accumulators and the two constants
// fit without spilling) and 16 where there are 32 (AVX-512, Arm). m < 1 makes every chain
// converge to a / (1 - m), so values stay normal: no overflow and no denormal slow path.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "tools/peak.cc"
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "src/core/cpu.h"
#include "src/simd/tile-inl.h"
#include "tools/commands.h"
#include "tools/json.h"
#include "tools/peak.h"

#ifndef FLASHCTE_TOOLS_PEAK_ONCE_
#define FLASHCTE_TOOLS_PEAK_ONCE_
namespace flashcte::tools {
// What each target's code exports to the driver.
struct FmaKernel {
  float (*run)(int64_t iters, float mul, float add);  // returns a checksum of the accumulators
  int64_t target;                                     // HWY_TARGET the code was compiled for
  int lanes;                                          // fp32 lanes per vector
  int chains;
};
}  // namespace flashcte::tools
#endif  // FLASHCTE_TOOLS_PEAK_ONCE_

HWY_BEFORE_NAMESPACE();
namespace flashcte::tools {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_ARCH_ARM
constexpr int64_t kChains = 16;
#else
constexpr int64_t kChains = 12;
#endif

float FmaChains(int64_t iters, float mul, float add) {
  using DF = hn::ScalableTag<float>;
  const DF df;
  const hn::Vec<DF> m = hn::Set(df, mul);
  const hn::Vec<DF> a = hn::Set(df, add);
  float checksum = 0.0f;
  simd::HWY_NAMESPACE::WithVectors<kChains>(df, [&](auto&... acc) FLASHCTE_TILE_LAMBDA {
    simd::HWY_NAMESPACE::ForEach(
        [&](auto c, auto& v) FLASHCTE_TILE_LAMBDA { v = hn::Set(df, static_cast<float>(c)); },
        acc...);
    for (int64_t i = 0; i < iters; ++i) ((acc = hn::MulAdd(acc, m, a)), ...);
    auto sum = hn::Zero(df);
    ((sum = hn::Add(sum, acc)), ...);
    checksum = hn::GetLane(hn::SumOfLanes(df, sum));
  });
  return checksum;
}

const FmaKernel* GetFmaKernel() {
  static const FmaKernel kernel = {&FmaChains, HWY_TARGET,
                                   static_cast<int>(hn::Lanes(hn::ScalableTag<float>())),
                                   static_cast<int>(kChains)};
  return &kernel;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::tools
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

// The native bf16 dot product needs an x86-64 compiler that knows AVX512_BF16 (GCC 10, clang 9).
#if HWY_ARCH_X86_64 && ((defined(__clang__) && __clang_major__ >= 9) || \
                        (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define FLASHCTE_PEAK_BF16_DOT 1
#include <immintrin.h>
#else
#define FLASHCTE_PEAK_BF16_DOT 0
#endif

namespace flashcte::tools {

HWY_EXPORT(GetFmaKernel);

namespace {

using Clock = std::chrono::steady_clock;

// One measurement lasts about this long: 25 scheduler ticks (4 ms at 250 Hz), so one preemption
// by another process costs a few percent, not the whole figure; long against the OpenMP barrier
// and the clock (microseconds); and the whole table (12 measurements x 5 rounds on an AVX-512
// machine with AVX512_BF16) takes about 6 s.
constexpr double kMeasureSeconds = 0.1;
// Calibration quadruples the iteration count until one run takes at least this long.
constexpr double kCalibrateSeconds = 0.02;

constexpr char kFmaCounting[] =
    "2 FLOPs per fp32 lane per multiply-add (one FMA instruction on AVX2, AVX3 and Arm; "
    "SSSE3, SSE4 and the EMU128/SCALAR fallback have no FMA and issue a multiply and an add)";
constexpr char kBf16Counting[] =
    "64 FLOPs per zmm vdpbf16ps: 32 bf16 products and 32 adds into 16 fp32 lanes "
    "(2 FLOPs per bf16 pair product)";

// Keeps the checksums observable so the loops cannot be removed.
volatile float g_sink = 0;

struct Probe {
  std::string kind, target;
  int vector_bits, chains;
  double flops_per_instruction;
  double flops_per_iteration;         // per thread
  std::function<float(int64_t)> run;  // iters -> checksum
};

// Runs probe.run(iters) on `threads` OpenMP threads released together; returns the wall time
// from the release to the last thread's finish, and how many threads ran.
double TimeOnThreads(const Probe& probe, int64_t iters, int threads, int* ran) {
  Clock::time_point start, stop;
  int team = 1;
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#pragma omp barrier
#pragma omp single
    {
      team = omp_get_num_threads();
      start = Clock::now();
    }  // the implied barrier releases every thread together
    sink += probe.run(iters);
#pragma omp barrier
#pragma omp single
    stop = Clock::now();
  }
  g_sink = g_sink + sink;
  *ran = team;
  return std::chrono::duration<double>(stop - start).count();
}

int64_t CalibrateIterations(const Probe& probe) {
  int ran = 1;
  for (int64_t iters = 1 << 12;; iters *= 4) {
    const double s = TimeOnThreads(probe, iters, 1, &ran);
    if (s >= kCalibrateSeconds || iters >= (int64_t{1} << 40)) {
      return std::max<int64_t>(1, static_cast<int64_t>(iters * (kMeasureSeconds / s)));
    }
  }
}

#if FLASHCTE_PEAK_BF16_DOT
// 16 chains (there are 32 zmm registers) cover latency x throughput up to 16 instructions. On
// the Zen 4 EPYC this was written on it measured one vdpbf16ps per cycle: 234 GFLOP/s on one core,
// where the fp32 FMA measured 117 (32 FLOPs per cycle at about 3.7 GHz).
constexpr int kBf16Chains = 16;

__attribute__((target("avx512f,avx512bf16"))) float Bf16DotChains(int64_t iters) {
  // Each instruction adds 1 * 2^-10 twice per lane; once a lane's sum is large the adds round to
  // nothing, which costs the same (vdpbf16ps has no denormal or rounding slow path).
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10f), _mm512_set1_ps(0x1p-10f));
  __m512 acc[kBf16Chains];
  for (int c = 0; c < kBf16Chains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  for (int64_t i = 0; i < iters; ++i) {
    for (int c = 0; c < kBf16Chains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kBf16Chains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  return _mm512_reduce_add_ps(sum);
}

// src/core/cpu.h: AVX512_BF16 with the OS saving zmm state.
bool HasBf16Dot() { return internal::cpu_features().avx512_bf16; }
#endif

std::vector<Probe> Probes(std::vector<PeakResult>* unavailable) {
  std::vector<Probe> probes;
  // Collect every target's kernel, then restore Highway's own choice before anything runs.
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const FmaKernel* k = HWY_DYNAMIC_DISPATCH(GetFmaKernel)();
    if (k->target != target) continue;  // the table fell back to another target
    const auto run = k->run;
    probes.push_back({"fma_f32", hwy::TargetName(target), 32 * k->lanes, k->chains, 2.0 * k->lanes,
                      2.0 * k->lanes * k->chains,
                      [run](int64_t iters) { return run(iters, 0.999f, 0.001f); }});
  }
  hwy::SetSupportedTargetsForTest(0);
  // Widest first: the order of the table.
  std::stable_sort(probes.begin(), probes.end(),
                   [](const Probe& x, const Probe& y) { return x.vector_bits > y.vector_bits; });

  PeakResult bf16;
  bf16.kind = "bf16_dot";
  bf16.target = "AVX512_BF16";
#if FLASHCTE_PEAK_BF16_DOT
  if (HasBf16Dot()) {
    probes.push_back({bf16.kind, bf16.target, 512, kBf16Chains, 64.0, 64.0 * kBf16Chains,
                      [](int64_t iters) { return Bf16DotChains(iters); }});
  } else {
    bf16.available = false;
    bf16.note =
        "not available: this CPU has no AVX512_BF16 (no native bf16 dot product, vdpbf16ps)";
  }
#else
  bf16.available = false;
  bf16.note = "not available: this build is not for x86-64 or its compiler lacks AVX512_BF16";
#endif
  if (!bf16.available) unavailable->push_back(bf16);
  return probes;
}

}  // namespace

double PeakResult::median() const {
  if (gflops.empty()) return 0;
  std::vector<double> v = gflops;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double PeakResult::best() const {
  return gflops.empty() ? 0 : *std::max_element(gflops.begin(), gflops.end());
}

const char* PeakCounting(const std::string& kind) {
  return kind == "bf16_dot" ? kBf16Counting : kFmaCounting;
}

std::vector<PeakResult> MeasurePeak(int threads, int reps) {
  std::vector<PeakResult> unavailable;
  const std::vector<Probe> probes = Probes(&unavailable);
  std::vector<int> thread_counts = {1};
  if (threads > 1) thread_counts.push_back(threads);

  std::vector<PeakResult> results;
  std::vector<int64_t> iters;  // per result
  std::vector<const Probe*> probe_of;
  for (const Probe& p : probes) {
    const int64_t n = CalibrateIterations(p);  // also the warm-up
    for (int t : thread_counts) {
      PeakResult r;
      r.kind = p.kind;
      r.target = p.target;
      r.vector_bits = p.vector_bits;
      r.chains = p.chains;
      r.flops_per_instruction = p.flops_per_instruction;
      r.threads = t;
      results.push_back(r);
      iters.push_back(n);
      probe_of.push_back(&p);
    }
  }
  // Rounds interleave the measurements (A, B, C, A, B, C, ...) so that drift in clocks and in
  // the load of a shared machine hits each alike.
  for (int rep = 0; rep < reps; ++rep) {
    for (size_t i = 0; i < results.size(); ++i) {
      int ran = 1;
      const double s = TimeOnThreads(*probe_of[i], iters[i], results[i].threads, &ran);
      results[i].threads = ran;
      results[i].gflops.push_back(ran * static_cast<double>(iters[i]) *
                                  probe_of[i]->flops_per_iteration / s * 1e-9);
    }
  }
  for (PeakResult& u : unavailable) results.push_back(u);
  return results;
}

void PrintPeak(const std::vector<PeakResult>& results, int reps, bool json) {
  if (json) {
    for (const PeakResult& r : results) {
      Json j = {{"impl", "peak"}, {"kind", r.kind}, {"target", r.target}};
      j["available"] = r.available;
      if (!r.available) {
        j["note"] = r.note;
      } else {
        j["threads"] = r.threads;
        j["gflops"] = r.median();
        j["best_gflops"] = r.best();
        j["reps"] = reps;
        j["vector_bits"] = r.vector_bits;
        j["chains"] = r.chains;
        j["flops_per_instruction"] = r.flops_per_instruction;
      }
      j["counting"] = PeakCounting(r.kind);
      PrintJsonLine(j);
    }
    return;
  }
  std::printf(
      "Arithmetic limit of this CPU's cores: GFLOP/s of independent back-to-back vector\n"
      "instructions, median and best of %d interleaved rounds.\n\n",
      reps);
  std::printf("%-9s %-12s %5s %7s %8s %11s %9s\n", "kind", "target", "bits", "chains", "threads",
              "GFLOP/s", "best");
  const PeakResult* best_fma = nullptr;
  const PeakResult* best_bf16 = nullptr;
  for (const PeakResult& r : results) {
    if (!r.available) continue;
    std::printf("%-9s %-12s %5d %7d %8d %11.1f %9.1f\n", r.kind.c_str(), r.target.c_str(),
                r.vector_bits, r.chains, r.threads, r.median(), r.best());
    // The summary: the most threads, then the best target by its best round (noise on a shared
    // machine only lowers a rate, so the best round is the closer estimate of the limit).
    const PeakResult*& best = r.kind == "bf16_dot" ? best_bf16 : best_fma;
    if (best == nullptr || r.threads > best->threads ||
        (r.threads == best->threads && r.best() > best->best())) {
      best = &r;
    }
  }
  std::printf("\ncounting: fma_f32: %s.\n          bf16_dot: %s.\n", kFmaCounting, kBf16Counting);
  for (const PeakResult& r : results) {
    if (!r.available) std::printf("%s: %s.\n", r.kind.c_str(), r.note.c_str());
  }
  std::printf("\n");
  for (const auto& [label, r] :
       {std::pair<const char*, const PeakResult*>{"fp32 FMA", best_fma}, {"bf16 dot", best_bf16}}) {
    if (r == nullptr) continue;
    std::printf("%s peak: %.1f GFLOP/s best, %.1f median (%s, %d thread%s)\n", label, r->best(),
                r->median(), r->target.c_str(), r->threads, r->threads > 1 ? "s" : "");
  }
}

}  // namespace flashcte::tools
#endif  // HWY_ONCE
