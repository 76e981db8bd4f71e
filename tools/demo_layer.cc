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
#include "src/reference/layer_reference.h"
#include "src/reference/reference.h"
#include "tools/attention_flags.h"
#include "tools/commands.h"
#include "tools/tensors.h"

namespace flashcte::tools::demo {
namespace {

constexpr char kCommand[] = "demo";
constexpr int64_t kHidden = 4096;
constexpr int64_t kQueryWidth = kHeads * kHeadDim;  // q_proj's outputs, o_proj's inputs
constexpr int64_t kKvWidth = kKvHeads * kHeadDim;   // k_proj's and v_proj's outputs
// The four projections' weights; the layer keeps them as float32.
constexpr double kWeightCount = static_cast<double>(kHidden) * (2 * kQueryWidth + 2 * kKvWidth);

// What the flags ask for.
struct LayerDemoShape {
  int64_t tokens;  // prefill tokens
  int64_t steps;   // single-token decode steps after the prefill
  int64_t prefix;  // prefill tokens the oracle recomputes from scratch (at most `tokens`)
  int threads;
  DType dtype;
  int64_t element;  // bytes per dtype value
  int64_t max_len;  // KV cache slots: the prefill's, then one per decode step
};

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

// The layer, its inputs, and what the timed run leaves behind for the check.
struct LayerRun {
  LayerConfig config;
  LayerWeights weights;
  std::unique_ptr<AttentionLayer> layer;
  HostTensor x, out;               // (1, tokens, hidden): the prefill's input and output
  HostTensor x_step, out_step;     // (steps, 1, hidden): one decode input / output per step
  std::vector<int64_t> positions;  // the prefill's: 0..tokens-1
  TensorView prefill_positions;    // (1, tokens) over `positions`
  KvCache cache;                   // max_len slots, filled by the prefill and the decode steps
  double prefill_seconds = 0;
  std::vector<double> step_seconds;
};

// The first n tokens of a (1, tokens, ...) view (TensorView or MutableTensorView).
template <typename View>
View FirstTokens(View v, int64_t n) {
  v.shape[1] = n;
  return v;
}

// Turns a failed step's status into the message the user sees, "<step>: <library message>".
Status Explained(const std::string& step, Status status) {
  if (!status.ok) status.message = step + ": " + status.message;
  return status;
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

// --- the check against the oracle --------------------------------------------------------------

// |fast - oracle| against the demo's comparator over one group of checked values.
struct Check {
  const char* what;
  std::string rows;
  double max_err = 0, max_ref = 0;
  void add(double got, double want) {
    const double err = std::fabs(got - want);
    if (!(err <= max_err)) max_err = err;  // also catches NaN
    max_ref = std::max(max_ref, std::fabs(want));
  }
};

// Where channel c of KV head h's slot j sits in the layer's cache (one sequence, max_len slots).
int64_t LayerCacheIndex(const LayerDemoShape& shape, int64_t h, int64_t j, int64_t c) {
  return (h * shape.max_len + j) * kHeadDim + c;
}

// The same in the oracle's cache: sequence b of `slots` slots.
size_t OracleCacheIndex(int64_t slots, int64_t b, int64_t h, int64_t j, int64_t c) {
  return static_cast<size_t>(((b * kKvHeads + h) * slots + j) * kHeadDim + c);
}

// (a): the first `prefix` tokens through the oracle from scratch.
Status CheckPrefixFromScratch(const LayerDemoShape& shape, const LayerRun& run,
                              std::vector<Check>* checks) {
  const int64_t prefix = shape.prefix;
  Check outputs{"prefill outputs, from scratch", "rows 0.." + std::to_string(prefix - 1)};
  Check kv{"K/V cache slots, from scratch", "slots 0.." + std::to_string(prefix - 1)};
  reference::LayerCache rc;
  Status status = reference::make_layer_cache(run.config, 1, prefix, &rc);
  std::vector<double> want;
  if (status.ok) {
    status = reference::layer_forward(run.config, run.weights, FirstTokens(run.x.view(), prefix),
                                      FirstTokens(run.prefill_positions, prefix), &rc, &want);
  }
  if (!status.ok) return Explained("reference::layer_forward", status);
  for (int64_t i = 0; i < prefix * kHidden; ++i) {
    outputs.add(ElementAsFloat(run.out, i), want[static_cast<size_t>(i)]);
  }
  for (int64_t h = 0; h < kKvHeads; ++h) {
    for (int64_t j = 0; j < prefix; ++j) {
      for (int64_t c = 0; c < kHeadDim; ++c) {
        const int64_t fast = LayerCacheIndex(shape, h, j, c);
        const size_t slow = OracleCacheIndex(prefix, 0, h, j, c);
        kv.add(reference::load_element(run.cache.k_data(), shape.dtype, fast), rc.k[slow]);
        kv.add(reference::load_element(run.cache.v_data(), shape.dtype, fast), rc.v[slow]);
      }
    }
  }
  checks->push_back(outputs);
  checks->push_back(kv);
  return status;
}

// (b): a token the oracle checks past the prefix, at `position`: row `row` of the prefill's x and
// out, or of the decode steps' x_step and out_step.
struct SampledRow {
  int64_t position;
  bool decode;
  int64_t row;
};

// Up to 8 prefill rows spread from the prefix to the last token, then decode steps 0..3 and the
// last (each once).
std::vector<SampledRow> SampleRows(const LayerDemoShape& shape) {
  std::vector<SampledRow> samples;
  if (shape.tokens > shape.prefix) {
    const int64_t count = std::min<int64_t>(8, shape.tokens - shape.prefix);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t p = count == 1
                            ? shape.tokens - 1
                            : shape.prefix + r * (shape.tokens - 1 - shape.prefix) / (count - 1);
      samples.push_back({p, false, p});
    }
  }
  for (int64_t s : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, shape.steps - 1}) {
    if (s < 0 || s >= shape.steps) continue;
    if (!samples.empty() && samples.back().decode && samples.back().row >= s) continue;
    samples.push_back({shape.tokens + s, true, s});
  }
  return samples;
}

// E.g. "prefill rows 40..79 (8) + decode 0,1,2,3".
std::string DescribeSampledRows(const std::vector<SampledRow>& samples) {
  std::string prefill_part, decode_part;
  int64_t prefill_rows = 0;
  for (const SampledRow& s : samples) {
    if (!s.decode) {
      ++prefill_rows;
    } else {
      decode_part += (decode_part.empty() ? "decode " : ",") + std::to_string(s.row);
    }
  }
  if (prefill_rows > 0) {
    prefill_part = "prefill rows " + std::to_string(samples.front().position) + ".." +
                   std::to_string(samples[static_cast<size_t>(prefill_rows - 1)].position) + " (" +
                   std::to_string(prefill_rows) + ")";
  }
  return prefill_part + (prefill_part.empty() || decode_part.empty() ? "" : " + ") + decode_part;
}

// The sampled tokens as one (n, 1, hidden) batch for the oracle, with their positions, and its
// cache seeded with the layer's K/V of the slots before each one's position, so that the oracle
// attends over exactly what the layer had cached.
HostTensor PrepareOracleBatch(const LayerDemoShape& shape, const LayerRun& run,
                              const std::vector<SampledRow>& samples,
                              std::vector<int64_t>* positions, reference::LayerCache* rc) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t row_bytes = kHidden * shape.element;
  HostTensor xs(shape.dtype, {n, 1, kHidden});
  for (int64_t b = 0; b < n; ++b) {
    const SampledRow& s = samples[static_cast<size_t>(b)];
    const HostTensor& x = s.decode ? run.x_step : run.x;
    positions->push_back(s.position);
    rc->lengths[static_cast<size_t>(b)] = s.position;
    std::memcpy(static_cast<char*>(xs.data()) + b * row_bytes,
                static_cast<const char*>(x.data()) + s.row * row_bytes,
                static_cast<size_t>(row_bytes));
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < s.position; ++j) {
        for (int64_t c = 0; c < kHeadDim; ++c) {
          const int64_t fast = LayerCacheIndex(shape, h, j, c);
          const size_t slow = OracleCacheIndex(rc->max_len, b, h, j, c);
          rc->k[slow] = reference::load_element(run.cache.k_data(), shape.dtype, fast);
          rc->v[slow] = reference::load_element(run.cache.v_data(), shape.dtype, fast);
        }
      }
    }
  }
  return xs;
}

// The layer's outputs and the K/V slots the samples wrote against the oracle's (`want`, `rc`).
void CompareSampledRows(const LayerDemoShape& shape, const LayerRun& run,
                        const std::vector<SampledRow>& samples, const reference::LayerCache& rc,
                        const std::vector<double>& want, Check* outputs, Check* kv) {
  for (int64_t b = 0; b < static_cast<int64_t>(samples.size()); ++b) {
    const SampledRow& s = samples[static_cast<size_t>(b)];
    const HostTensor& out = s.decode ? run.out_step : run.out;
    for (int64_t c = 0; c < kHidden; ++c) {
      outputs->add(ElementAsFloat(out, s.row * kHidden + c),
                   want[static_cast<size_t>(b * kHidden + c)]);
    }
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t c = 0; c < kHeadDim; ++c) {
        const int64_t fast = LayerCacheIndex(shape, h, s.position, c);
        const size_t slow = OracleCacheIndex(rc.max_len, b, h, s.position, c);
        kv->add(reference::load_element(run.cache.k_data(), shape.dtype, fast), rc.k[slow]);
        kv->add(reference::load_element(run.cache.v_data(), shape.dtype, fast), rc.v[slow]);
      }
    }
  }
}

// (b): the sampled rows through the oracle seeded with the layer's cache; adds nothing when no
// row lies past the prefix.
Status CheckSampledRows(const LayerDemoShape& shape, const LayerRun& run,
                        std::vector<Check>* checks) {
  const std::vector<SampledRow> samples = SampleRows(shape);
  if (samples.empty()) return Status::Ok();
  const int64_t n = static_cast<int64_t>(samples.size());
  Check outputs{"sampled rows, oracle on the layer's cache", DescribeSampledRows(samples)};
  Check kv{"K/V the sampled rows wrote", "their " + std::to_string(n) + " slots"};
  int64_t longest = 0;
  for (const SampledRow& s : samples) longest = std::max(longest, s.position + 1);
  reference::LayerCache rc;
  Status status = reference::make_layer_cache(run.config, n, longest, &rc);
  if (!status.ok) return Explained("reference::make_layer_cache", status);
  std::vector<int64_t> positions;
  const HostTensor xs = PrepareOracleBatch(shape, run, samples, &positions, &rc);
  std::vector<double> want;
  status = reference::layer_forward(run.config, run.weights, xs.view(),
                                    TensorView::contiguous(positions.data(), DType::kInt64, {n, 1}),
                                    &rc, &want);
  if (!status.ok) return Explained("reference::layer_forward", status);
  CompareSampledRows(shape, run, samples, rc, want, &outputs, &kv);
  checks->push_back(outputs);
  checks->push_back(kv);
  return status;
}

// Tolerance: |a - b| <= 1e-5 + rtol * max|ref| per check group. bfloat16 takes the Neuron
// suite's 2e-2 (the kernel demo's); float16 the same ulp multiple (2e-2 * 2^-3, its ulp being 8x
// finer); float32 1e-4 (the Python layer tests' bound).
double LayerRtol(DType dtype) {
  return dtype == DType::kBFloat16 ? 2e-2 : dtype == DType::kFloat16 ? 2.5e-3 : 1e-4;
}

// One line per check group, then PASS or FAIL; returns whether every group passed.
bool PrintCheckReport(DType dtype, double check_seconds, const std::vector<Check>& checks) {
  const double rtol = LayerRtol(dtype);
  std::printf(
      "check against the float64 layer oracle (%.1f s; pass: |a-b| <= 1e-5 + %s * "
      "max|ref| per line):\n",
      check_seconds, FormatG(rtol, 2).c_str());
  bool pass = true;
  for (const Check& c : checks) {
    const double tolerance = kAtol + rtol * c.max_ref;
    const bool ok = c.max_err <= tolerance;
    pass = pass && ok;
    std::printf("  %-42s %-44s max|err| %-9s tol %-9s (max|ref| %s) %s\n", c.what, c.rows.c_str(),
                FormatG(c.max_err, 3).c_str(), FormatG(tolerance, 3).c_str(),
                FormatG(c.max_ref, 3).c_str(), ok ? "ok" : "FAIL");
  }
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass;
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

  const auto check_start = std::chrono::steady_clock::now();
  std::vector<Check> checks;
  status = CheckPrefixFromScratch(shape, run, &checks);
  if (status.ok) status = CheckSampledRows(shape, run, &checks);
  if (!status.ok) return RuntimeError(kCommand, status.message);
  return PrintCheckReport(shape.dtype, Seconds(check_start), checks) ? kExitOk : kExitRuntime;
}

}  // namespace flashcte::tools::demo
