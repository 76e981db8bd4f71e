// The matmul micro-kernels alone, hot in cache, at the shapes the kernel layer calls them with
// (a 48-row sub-block against a 256-key tile, d = dv = 128 unless given): GFLOP/s per call for
// each SIMD target this CPU runs, and for the native bf16 kernels where the CPU has them. The
// ratio to `flashcte bench --impl peak` says how far a kernel is from the arithmetic limit.
//
//   build/.../bench/flashcte_micro_kernels [--benchmark_filter=...] [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>
#include <hwy/targets.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "src/simd/bf16_dot.h"
#include "src/simd/ops.h"

namespace {

using flashcte::simd::Bf16DotOps;
using flashcte::simd::Ops;

constexpr int64_t kRows = 48, kKeys = 256;

std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Sets the target for one benchmark and restores the best one after it.
struct TargetScope {
  explicit TargetScope(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~TargetScope() { hwy::SetSupportedTargetsForTest(0); }
};

void QkFloat(benchmark::State& state, int64_t target) {
  const TargetScope scope(target);
  const Ops& ops = flashcte::simd::ops();
  const int64_t d = state.range(0), ld = flashcte::simd::leading_dim(kKeys);
  const std::vector<float> q = random_floats(kRows * d, 1), k = random_floats(d * ld, 2);
  std::vector<float> s(kRows * ld), row_max(kRows, -1e30f);
  for (auto _ : state) {
    ops.qk(q.data(), d, kRows, k.data(), ld, kKeys, d, s.data(), ld, row_max.data());
    benchmark::DoNotOptimize(s.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * kRows * kKeys * d * state.iterations(), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

void PvFloat(benchmark::State& state, int64_t target) {
  const TargetScope scope(target);
  const Ops& ops = flashcte::simd::ops();
  const int64_t dv = state.range(0), dv_pad = flashcte::simd::padded(dv);
  const int64_t ldv = flashcte::simd::odd_cache_lines(dv_pad), ldp = kKeys;
  const std::vector<float> p = random_floats(kRows * ldp, 3), v = random_floats(kKeys * ldv, 4);
  std::vector<float> o(kRows * ldv, 0.0f), alpha(kRows, 0.5f);
  for (auto _ : state) {
    ops.pv(p.data(), ldp, kRows, kKeys, v.data(), ldv, dv_pad, alpha.data(), o.data(), ldv);
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * kRows * kKeys * dv * state.iterations(), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  const std::vector<float> f = random_floats(n, seed);
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f[i], sizeof bits);
    h[i] = static_cast<uint16_t>(bits >> 16);
  }
  return h;
}

void QkNative(benchmark::State& state, const Bf16DotOps* dot) {
  const int64_t d = state.range(0), ld = flashcte::simd::leading_dim(kKeys);
  const std::vector<uint16_t> q = random_bf16(kRows * d, 5), k = random_bf16(d * ld, 6);
  std::vector<float> s(kRows * ld), row_max(kRows, -1e30f);
  const auto* k2 = reinterpret_cast<const uint32_t*>(k.data());
  for (auto _ : state) {
    dot->qk(q.data(), d, kRows, k2, ld, kKeys, d, 0.1f, s.data(), ld, row_max.data());
    benchmark::DoNotOptimize(s.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * kRows * kKeys * d * state.iterations(), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

void PvNative(benchmark::State& state, const Bf16DotOps* dot) {
  const int64_t dv = state.range(0), dv_pad = flashcte::simd::padded(dv);
  const int64_t ldv = flashcte::simd::odd_cache_lines(dv_pad), ldp = kKeys;
  const std::vector<uint16_t> p = random_bf16(kRows * ldp, 7), v = random_bf16(kKeys * ldv, 8);
  std::vector<float> o(kRows * ldv, 0.0f), alpha(kRows, 0.5f);
  const auto* v2 = reinterpret_cast<const uint32_t*>(v.data());
  for (auto _ : state) {
    dot->pv(p.data(), ldp, kRows, kKeys, v2, ldv, dv_pad, alpha.data(), o.data(), ldv);
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * kRows * kKeys * dv * state.iterations(), benchmark::Counter::kIsRate,
                         benchmark::Counter::kIs1000);
}

void Register() {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (target == HWY_SCALAR || target == HWY_EMU128) continue;  // not worth timing
    const std::string name = hwy::TargetName(target);
    benchmark::RegisterBenchmark(("qk_f32/" + name).c_str(), QkFloat, target)->Arg(64)->Arg(128);
    benchmark::RegisterBenchmark(("pv_f32/" + name).c_str(), PvFloat, target)->Arg(64)->Arg(128);
  }
  flashcte::simd::set_bf16_dot_policy_for_test(flashcte::simd::Bf16Dot::kNative);
  const Bf16DotOps* dot = flashcte::simd::bf16_dot_for(flashcte::simd::ops());
  flashcte::simd::set_bf16_dot_policy_for_test(flashcte::simd::Bf16Dot::kAuto);
  if (dot) {
    benchmark::RegisterBenchmark("qk_bf16_native", QkNative, dot)->Arg(64)->Arg(128);
    benchmark::RegisterBenchmark("pv_bf16_native", PvNative, dot)->Arg(64)->Arg(128);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Register();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
