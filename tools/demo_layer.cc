// `flashcte demo --layer` (demo_layer.h): the attention layer around the kernels
// (flashcte/layer.h), shaped as one Llama-3-8B layer (hidden 4096, 32 query / 8 KV heads,
// d = 128, rope_theta 500000, Llama-3 rope scaling), with random weights, through a prefill and
// decode steps on one KV cache, timed, then checked against the float64 layer oracle
// (src/reference/layer_reference.h).
//
// The oracle is O(T^2) in float64 one token and one head at a time, so it cannot redo the whole
// run in a demo's time; instead:
//  (a) it recomputes the first `prefix` prefill tokens from scratch (its own cache): their
//      outputs must match rows 0..prefix-1 of the timed prefill (causal: later tokens do not
//      change them), and its K/V cache slots must match the layer's;
//  (b) sampled rows past that prefix (8 prefill rows up to the last, and decode steps 0..3
//      and the last) run through the oracle as one batch of single tokens, each sequence's
//      cache seeded with the layer's K/V of the slots before its position: their outputs
//      check Q, RoPE at large positions, attention over the whole cache and o_proj, and the
//      K/V they write check the layer's cache slots at those positions.
#include "tools/demo_layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/layer.h"
#include "tools/attention_flags.h"
#include "tools/commands.h"
#include "tools/demo_layer_run.h"
#include "tools/tensors.h"

namespace flashcte::tools::demo {
namespace {

constexpr char kCommand[] = "demo";
constexpr int64_t kQueryWidth = kHeads * kHeadDim;  // q_proj's outputs, o_proj's inputs
constexpr int64_t kKvWidth = kKvHeads * kHeadDim;   // k_proj's and v_proj's outputs
// The four projections' weights; the layer keeps them as float32.
constexpr double kWeightCount = static_cast<double>(kHidden) * (2 * kQueryWidth + 2 * kKvWidth);

LayerDemoShape ShapeFromFlags(const ParsedFlags& f) {
  LayerDemoShape shape;
  shape.tokens = f.integer("tokens", 4096);
  shape.steps = f.integer("decode-steps", 64);
  shape.prefix = std::min(shape.tokens, f.integer("check-prefix", 256));
  shape.threads = static_cast<int>(f.integer("threads", 0));
  shape.dtype = DType::kBFloat16;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &shape.dtype);
  shape.element = dtype_size(shape.dtype);
  shape.max_len = shape.tokens + shape.steps;
  return shape;
}

// --- setup -------------------------------------------------------------------------------------

void PrintIntro(const LayerDemoShape& shape) {
  std::printf(
      "flashcte demo --layer: a Llama-3-8B-shaped attention layer, hidden %lld, %lld query heads "
      "/ %lld KV heads, d=%lld, rope_theta 500000 with Llama-3 scaling (factor 8, low 1, high 4, "
      "original 8192), %s\n",
      static_cast<long long>(kHidden), static_cast<long long>(kHeads),
      static_cast<long long>(kKvHeads), static_cast<long long>(kHeadDim), dtype_name(shape.dtype));
  std::printf(
      "  run         a %lld-token prefill, then %lld decode steps of 1 token, on one KV cache of "
      "%lld slots\n",
      static_cast<long long>(shape.tokens), static_cast<long long>(shape.steps),
      static_cast<long long>(shape.max_len));
  std::printf(
      "  inputs      x uniform [-sqrt(3), sqrt(3)) (unit variance), weights uniform with "
      "std 1/sqrt(fan-in), fixed seeds\n");
  std::printf("  SIMD target %s\n  GEMM        %s\n", simd_target().c_str(),
              layer_gemm_backend().c_str());
  std::fflush(stdout);
}

LayerConfig Llama3LayerConfig(DType dtype) {
  LayerConfig config;
  config.hidden_size = kHidden;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.rope_theta = 500000.0;
  config.rope_scaling = Llama3RopeScaling{};  // factor 8, low 1, high 4, original 8192
  config.dtype = dtype;
  return config;
}

// Deterministic uniform [-range, range) floats (splitmix64), for the weights.
void FillWeights(uint64_t seed, float range, std::vector<float>* w) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& value : *w) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const double unit = static_cast<double>(z >> 11) * 0x1.0p-53;  // [0, 1)
    value = static_cast<float>((2 * unit - 1) * range);
  }
}

// Weights in torch.nn.Linear layout (out_features, in_features); std 1/sqrt(fan-in) keeps
// every projection's output at the input's scale. Both fan-ins are 4096.
LayerWeights RandomWeights() {
  const float range = static_cast<float>(std::sqrt(3.0 / static_cast<double>(kHidden)));
  LayerWeights weights;
  weights.q_proj.resize(static_cast<size_t>(kQueryWidth * kHidden));
  weights.k_proj.resize(static_cast<size_t>(kKvWidth * kHidden));
  weights.v_proj.resize(static_cast<size_t>(kKvWidth * kHidden));
  weights.o_proj.resize(static_cast<size_t>(kHidden * kQueryWidth));
  FillWeights(21, range, &weights.q_proj);
  FillWeights(22, range, &weights.k_proj);
  FillWeights(23, range, &weights.v_proj);
  FillWeights(24, range, &weights.o_proj);
  return weights;
}

Status BuildLayer(LayerRun* run) {
  const auto start = std::chrono::steady_clock::now();
  Status status = AttentionLayer::create(run->config, run->weights, &run->layer);
  if (!status.ok) return Explained("AttentionLayer::create", status);
  std::printf("layer:\n  built in %.2f s (%s weights, %.0f MB as float32)\n", Seconds(start),
              FormatG(kWeightCount, 4).c_str(), kWeightCount * 4 * 1e-6);
  return status;
}

// x uniform [-sqrt(3), sqrt(3)): unit variance, like the normalized hidden states a layer sees.
void MakeInputs(const LayerDemoShape& shape, LayerRun* run) {
  run->x = HostTensor(shape.dtype, {1, shape.tokens, kHidden});
  run->out = HostTensor(shape.dtype, {1, shape.tokens, kHidden});
  const float unit = static_cast<float>(std::sqrt(3.0));
  FillUniform(&run->x, 11, -unit, unit);
  if (shape.steps > 0) {
    run->x_step = HostTensor(shape.dtype, {shape.steps, 1, kHidden});
    run->out_step = HostTensor(shape.dtype, {shape.steps, 1, kHidden});
    FillUniform(&run->x_step, 12, -unit, unit);
  }
  run->positions.resize(static_cast<size_t>(shape.tokens));
  for (int64_t i = 0; i < shape.tokens; ++i) run->positions[static_cast<size_t>(i)] = i;
  run->prefill_positions =
      TensorView::contiguous(run->positions.data(), DType::kInt64, {1, shape.tokens});
}

// --- the timed run -----------------------------------------------------------------------------

// A short prefill (up to 32 tokens) and a decode step on a scratch cache of 64 slots: loads
// OpenBLAS, starts the thread pools and faults in the code, without touching the demo's cache.
Status WarmUp(const LayerDemoShape& shape, LayerRun* run) {
  KvCache scratch;
  Status status = run->layer->new_cache(1, 64, &scratch);
  const int64_t n = std::min<int64_t>(32, shape.tokens);
  TensorView xv = FirstTokens(run->x.view(), n);
  MutableTensorView ov = FirstTokens(run->out.mutable_view(), n);
  const TensorView pv = FirstTokens(run->prefill_positions, n);
  if (status.ok) status = run->layer->forward(xv, pv, &scratch, ov, shape.threads);
  if (status.ok) {
    const int64_t at = n;
    xv.shape[1] = ov.shape[1] = 1;
    status = run->layer->forward(xv, TensorView::contiguous(&at, DType::kInt64, {1, 1}), &scratch,
                                 ov, shape.threads);
  }
  return Explained("forward (warm-up)", status);
}

Status TimePrefill(const LayerDemoShape& shape, LayerRun* run) {
  Status status = run->layer->new_cache(1, shape.max_len, &run->cache);
  if (!status.ok) return Explained("new_cache", status);
  const auto start = std::chrono::steady_clock::now();
  status = run->layer->forward(run->x.view(), run->prefill_positions, &run->cache,
                               run->out.mutable_view(), shape.threads);
  run->prefill_seconds = Seconds(start);
  return Explained("forward (prefill)", status);
}

// One token per step at positions tokens, tokens + 1, ..., each step timed on its own.
Status TimeDecodeSteps(const LayerDemoShape& shape, LayerRun* run) {
  for (int64_t s = 0; s < shape.steps; ++s) {
    const int64_t position = shape.tokens + s;
    const TensorView pv = TensorView::contiguous(&position, DType::kInt64, {1, 1});
    const auto start = std::chrono::steady_clock::now();
    const Status status = run->layer->forward(Batches(run->x_step, s, 1), pv, &run->cache,
                                              MutableBatches(run->out_step, s, 1), shape.threads);
    run->step_seconds.push_back(Seconds(start));
    if (!status.ok) return Explained("forward (decode step " + std::to_string(s) + ")", status);
  }
  return Status::Ok();
}

void PrintPrefillRate(const LayerDemoShape& shape, const LayerRun& run) {
  const double t = static_cast<double>(shape.tokens);
  const double projection_flop = 2.0 * t * kWeightCount;
  const double attention_flop =
      4.0 * kHeadDim * kHeads * UnmaskedPairs(shape.tokens, shape.tokens, true);
  const double seconds = run.prefill_seconds;
  std::printf(
      "prefill (%lld tokens, %s):\n  %.3f s, %.0f tokens/s, %.1f GFLOP/s (projections %s FLOP + "
      "attention %s FLOP)\n",
      static_cast<long long>(shape.tokens),
      shape.tokens > AttentionLayer::kMaxDecodeTokens ? "attention_cte" : "the decode kernel",
      seconds, t / seconds, (projection_flop + attention_flop) / seconds * 1e-9,
      FormatG(projection_flop, 3).c_str(), FormatG(attention_flop, 3).c_str());
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// A decode step reads every weight and the K/V of every cached slot; the K/V term takes the
// steps' mean cache length.
void PrintDecodeRate(const LayerDemoShape& shape, const LayerRun& run) {
  const std::vector<double>& seconds = run.step_seconds;
  const double median = Median(seconds);
  const double kv_bytes =
      2.0 * kKvHeads * kHeadDim * shape.element *
      (static_cast<double>(shape.tokens) + 0.5 * static_cast<double>(shape.steps));
  const double weight_bytes = 4.0 * kWeightCount;  // the layer keeps its weights as float32
  std::printf(
      "decode (%lld steps of 1 token at positions %lld..%lld, the decode kernel):\n  median %.2f "
      "ms per step (min %.2f, max %.2f), %.1f tokens/s\n  reads per step: weights %.0f MB "
      "(float32 in the layer) + K/V %.1f MB = %.1f GB/s at the median\n",
      static_cast<long long>(shape.steps), static_cast<long long>(shape.tokens),
      static_cast<long long>(shape.max_len - 1), median * 1e3,
      *std::min_element(seconds.begin(), seconds.end()) * 1e3,
      *std::max_element(seconds.begin(), seconds.end()) * 1e3, 1.0 / median, weight_bytes * 1e-6,
      kv_bytes * 1e-6, (weight_bytes + kv_bytes) / median * 1e-9);
}

}  // namespace

int LayerDemo(const ParsedFlags& flags) {
  const LayerDemoShape shape = ShapeFromFlags(flags);
  PrintIntro(shape);
  LayerRun run;
  run.config = Llama3LayerConfig(shape.dtype);
  run.weights = RandomWeights();
  Status status = BuildLayer(&run);
  if (status.ok) {
    MakeInputs(shape, &run);
    status = WarmUp(shape, &run);
  }
  if (status.ok) status = TimePrefill(shape, &run);
  if (status.ok) status = TimeDecodeSteps(shape, &run);
  if (!status.ok) return RuntimeError(kCommand, status.message);
  PrintPrefillRate(shape, run);
  if (shape.steps > 0) PrintDecodeRate(shape, run);
  std::fflush(stdout);

  bool pass = false;
  status = CheckAgainstOracle(shape, run, &pass);
  if (!status.ok) return RuntimeError(kCommand, status.message);
  return pass ? kExitOk : kExitRuntime;
}

}  // namespace flashcte::tools::demo
