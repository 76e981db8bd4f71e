// The matmul micro-kernels alone, hot in cache, at the shapes the kernel layer calls them with
// (a 48-row sub-block against a 256-key tile, d = dv = 128 unless given): GFLOP/s per call for
// each SIMD target this CPU runs, and for the native bf16 kernels where the CPU has them. The
// ratio to `flashcte bench --impl peak` says how far a kernel is from the arithmetic limit.
//
//   build/.../bench/flashcte_micro_kernels [--benchmark_filter=...] [--benchmark_repetitions=5]
#include <benchmark/benchmark.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "src/core/kv8.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"

namespace {

using flashcte::simd::NativeOps;
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

void QkNative(benchmark::State& state, const NativeOps* dot) {
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

void PvNative(benchmark::State& state, const NativeOps* dot) {
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

// The decode kernels on one block of kDecodeSlots cache slots in L1 (decode.cc's kBlockSlots),
// for the rows of one KV head (32/8 heads, one new token: 4 rows), d = dv = 128: ns per slot.
constexpr int64_t kDecodeSlots = 64, kDecodeD = 128;

void set_ns_per_slot(benchmark::State& state) {
  state.counters["ns/slot"] = benchmark::Counter(
      static_cast<double>(kDecodeSlots) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// A block of cache rows of `dtype` (bfloat16 or an 8-bit format: random codes, NaN codes
// replaced by 0) as bytes.
std::vector<unsigned char> decode_rows(flashcte::DType dtype, int64_t d, uint64_t seed) {
  if (dtype == flashcte::DType::kBFloat16) {
    const std::vector<uint16_t> h = random_bf16(kDecodeSlots * d, seed);
    std::vector<unsigned char> bytes(h.size() * 2);
    std::memcpy(bytes.data(), h.data(), bytes.size());
    return bytes;
  }
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> codes(kDecodeSlots * d);
  for (unsigned char& c : codes) {
    c = static_cast<unsigned char>(rng());
    if (std::isnan(flashcte::kv8::decode(dtype, c))) c = 0;
  }
  return codes;
}

// range(0): rows; range(1): the cache's DType.
void DecodeQkBf16(benchmark::State& state, const NativeOps* dot) {
  const auto dtype = static_cast<flashcte::DType>(state.range(1));
  const int64_t rows = state.range(0), d = kDecodeD, ld = flashcte::simd::leading_dim(kDecodeSlots);
  const std::vector<uint16_t> q = random_bf16(rows * d, 9);
  const std::vector<unsigned char> k = decode_rows(dtype, d, 10);
  const auto k_rows =
      flashcte::simd::DecodeRows::strided(k.data(), flashcte::dtype_size(dtype) * d, kDecodeSlots);
  std::vector<float> s(rows * ld);
  for (auto _ : state) {
    dot->decode_qk(q.data(), d, rows, k_rows, dtype, kDecodeSlots, d, 0.1f, s.data(), ld);
    benchmark::DoNotOptimize(s.data());
  }
  set_ns_per_slot(state);
}

void DecodePvBf16(benchmark::State& state, const NativeOps* dot) {
  const auto dtype = static_cast<flashcte::DType>(state.range(1));
  const int64_t rows = state.range(0), d = kDecodeD, ldp = kDecodeSlots;
  std::vector<float> p(rows * ldp);
  const std::vector<uint16_t> pb = random_bf16(rows * ldp, 11);
  for (size_t i = 0; i < p.size(); ++i) {
    const uint32_t bits = static_cast<uint32_t>(pb[i]) << 16;
    std::memcpy(&p[i], &bits, sizeof bits);
  }
  const std::vector<unsigned char> v = decode_rows(dtype, d, 12);
  const auto v_rows =
      flashcte::simd::DecodeRows::strided(v.data(), flashcte::dtype_size(dtype) * d, kDecodeSlots);
  std::vector<float> o(rows * d, 0.0f), alpha(rows, 0.5f);
  for (auto _ : state) {
    dot->decode_pv(p.data(), ldp, rows, kDecodeSlots, v_rows, dtype, d, alpha.data(), o.data(), d);
    benchmark::DoNotOptimize(o.data());
  }
  set_ns_per_slot(state);
}

void Register() {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    if (target == HWY_SCALAR || target == HWY_EMU128) continue;  // not worth timing
    const std::string name = hwy::TargetName(target);
    benchmark::RegisterBenchmark(("qk_f32/" + name).c_str(), QkFloat, target)->Arg(64)->Arg(128);
    benchmark::RegisterBenchmark(("pv_f32/" + name).c_str(), PvFloat, target)->Arg(64)->Arg(128);
  }
  flashcte::simd::set_bf16_dot_policy_for_test(flashcte::simd::Bf16Dot::kNative);
  const NativeOps* dot = flashcte::simd::native_ops_for(flashcte::simd::ops());
  flashcte::simd::set_bf16_dot_policy_for_test(flashcte::simd::Bf16Dot::kAuto);
  if (dot) {
    benchmark::RegisterBenchmark("qk_bf16_native", QkNative, dot)->Arg(64)->Arg(128);
    benchmark::RegisterBenchmark("pv_bf16_native", PvNative, dot)->Arg(64)->Arg(128);
  }
  if (dot) {
    // rows: 32/8 heads x 1, 2, 4 tokens; the cache bfloat16 or 8-bit.
    for (flashcte::DType cache : {flashcte::DType::kBFloat16, flashcte::DType::kInt8,
                                  flashcte::DType::kFloat8E4M3, flashcte::DType::kFloat8E5M2}) {
      const std::string tag = std::string("/") + flashcte::dtype_name(cache);
      for (const auto& [name, fn] : {std::pair{"decode_qk_bf16", &DecodeQkBf16},
                                     std::pair{"decode_pv_bf16", &DecodePvBf16}}) {
        auto* b = benchmark::RegisterBenchmark((name + tag).c_str(), fn, dot);
        for (int64_t rows : {4, 8, 16}) b->Args({rows, static_cast<int64_t>(cache)});
      }
    }
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
