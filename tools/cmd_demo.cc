// `flashcte demo` (and `flashcte` alone): the library's main job on an embedded default, a
// Llama-3-8B-shaped prefill (32 query heads sharing 8 KV heads, d = 128, 4096 tokens, causal,
// bfloat16, scale 1/sqrt(d)) on random inputs. It times one run after a warm-up, then checks a
// sample of rows against the float64 reference with the Neuron suite's comparator.
//
// The check is cheap because the reference computes whole rows: one query row against the full
// K and V of its KV head is just views with offset data pointers, shape (1, 1, d), and the row's
// causal position restored through cp_offset (q_pos = cp_offset + 0).
//
// `flashcte demo --layer`: the attention layer around the kernels (flashcte/layer.h), shaped as
// one Llama-3-8B layer (hidden 4096, 32 query / 8 KV heads, d = 128, rope_theta 500000, Llama-3
// rope scaling), with random weights, through a prefill and decode steps on one KV cache, timed,
// then checked against the float64 layer oracle (src/reference/layer_reference.h) on a prefix of
// the prefill and on sampled rows (LayerDemo below says how).
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
#include "tools/args.h"
#include "tools/attention_flags.h"
#include "tools/commands.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "demo";
constexpr int64_t kHeads = 32;
constexpr int64_t kKvHeads = 8;
constexpr int64_t kHeadDim = 128;
constexpr int kSampleRows = 16;
// The Neuron suite's comparator: |a - b| <= atol + rtol * max|ref|.
constexpr double kAtol = 1e-5;
constexpr double kRtol = 2e-2;

std::vector<FlagSpec> DemoFlagSpecs() {
  return {
      {"seqlen", FlagKind::kInt, "tokens (default 4096)", 1, int64_t{1} << 20},
      {"dtype", FlagKind::kChoice, "compute dtype (default bfloat16)", 0, 0,
       "float32|bfloat16|float16|fp32|bf16|fp16"},
      {"threads", FlagKind::kInt, "worker threads (0: OpenMP's default)", 0, 4096},
      {"layer", FlagKind::kBool, "run the attention layer demo instead of the kernel's"},
      {"tokens", FlagKind::kInt, "--layer: prefill tokens (default 4096)", 1, int64_t{1} << 20},
      {"decode-steps", FlagKind::kInt, "--layer: decode steps after the prefill (default 64)", 0,
       int64_t{1} << 16},
      {"check-prefix", FlagKind::kInt,
       "--layer: prefill tokens the oracle recomputes from scratch (default 256)", 1,
       int64_t{1} << 20},
  };
}

// A view of `t`'s batches [b0, b0 + n) (dense row-major rank-3 tensors only).
TensorView Batches(const HostTensor& t, int64_t b0, int64_t n) {
  TensorView v = t.view();
  v.data = static_cast<const char*>(t.data()) + b0 * v.strides[0] * dtype_size(t.dtype());
  v.shape[0] = n;
  return v;
}

MutableTensorView MutableBatches(HostTensor& t, int64_t b0, int64_t n) {
  MutableTensorView v = t.mutable_view();
  v.data = static_cast<char*>(t.data()) + b0 * v.strides[0] * dtype_size(t.dtype());
  v.shape[0] = n;
  return v;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// --- `demo --layer` ---------------------------------------------------------------------------

constexpr int64_t kHidden = 4096;

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

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

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

// Tolerance: |a - b| <= 1e-5 + rtol * max|ref| per check group. bfloat16 takes the Neuron
// suite's 2e-2 (the kernel demo's); float16 the same ulp multiple (2e-2 * 2^-3, its ulp being 8x
// finer); float32 1e-4 (the Python layer tests' bound).
double LayerRtol(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 2e-2;
    case DType::kFloat16:
      return 2.5e-3;
    default:
      return 1e-4;
  }
}

// Element i of the fast layer's cache storage (dtype values) as a double.
double CacheElement(const void* data, DType dtype, int64_t i) {
  return reference::load_element(data, dtype, i);
}

int LayerDemo(const ParsedFlags& f) {
  const int64_t tokens = f.integer("tokens", 4096);
  const int64_t steps = f.integer("decode-steps", 64);
  const int64_t prefix = std::min(tokens, f.integer("check-prefix", 256));
  const int threads = static_cast<int>(f.integer("threads", 0));
  DType dtype = DType::kBFloat16;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &dtype);
  const int64_t element = dtype_size(dtype);

  LayerConfig config;
  config.hidden_size = kHidden;
  config.num_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.rope_theta = 500000.0;
  config.rope_scaling = Llama3RopeScaling{};  // factor 8, low 1, high 4, original 8192
  config.dtype = dtype;
  const int64_t q_out = kHeads * kHeadDim, kv_out = kKvHeads * kHeadDim;
  const int64_t max_len = tokens + steps;

  std::printf(
      "flashcte demo --layer: a Llama-3-8B-shaped attention layer, hidden %lld, %lld query heads "
      "/ %lld KV heads, d=%lld, rope_theta 500000 with Llama-3 scaling (factor 8, low 1, high 4, "
      "original 8192), %s\n",
      static_cast<long long>(kHidden), static_cast<long long>(kHeads),
      static_cast<long long>(kKvHeads), static_cast<long long>(kHeadDim), dtype_name(dtype));
  std::printf(
      "  run         a %lld-token prefill, then %lld decode steps of 1 token, on one KV cache of "
      "%lld slots\n",
      static_cast<long long>(tokens), static_cast<long long>(steps),
      static_cast<long long>(max_len));
  std::printf(
      "  inputs      x uniform [-sqrt(3), sqrt(3)) (unit variance), weights uniform with "
      "std 1/sqrt(fan-in), fixed seeds\n");
  std::printf("  SIMD target %s\n  GEMM        %s\n", simd_target().c_str(),
              layer_gemm_backend().c_str());
  std::fflush(stdout);

  // Weights in torch.nn.Linear layout (out_features, in_features); std 1/sqrt(fan-in) keeps
  // every projection's output at the input's scale. Both fan-ins are 4096.
  const float range = static_cast<float>(std::sqrt(3.0 / static_cast<double>(kHidden)));
  LayerWeights weights;
  weights.q_proj.resize(static_cast<size_t>(q_out * kHidden));
  weights.k_proj.resize(static_cast<size_t>(kv_out * kHidden));
  weights.v_proj.resize(static_cast<size_t>(kv_out * kHidden));
  weights.o_proj.resize(static_cast<size_t>(kHidden * q_out));
  FillWeights(21, range, &weights.q_proj);
  FillWeights(22, range, &weights.k_proj);
  FillWeights(23, range, &weights.v_proj);
  FillWeights(24, range, &weights.o_proj);
  auto start = std::chrono::steady_clock::now();
  std::unique_ptr<AttentionLayer> layer;
  Status status = AttentionLayer::create(config, weights, &layer);
  if (!status.ok) return RuntimeError(kCommand, "AttentionLayer::create: " + status.message);
  const double weight_params = static_cast<double>(kHidden) * (2 * q_out + 2 * kv_out);
  std::printf("layer:\n  built in %.2f s (%s weights, %.0f MB as float32)\n", Seconds(start),
              FormatG(weight_params, 4).c_str(), weight_params * 4 * 1e-6);

  HostTensor x(dtype, {1, tokens, kHidden});
  HostTensor out(dtype, {1, tokens, kHidden});
  const float unit = static_cast<float>(std::sqrt(3.0));
  FillUniform(&x, 11, -unit, unit);
  HostTensor x_step, out_step;  // (steps, 1, hidden): one decode input / output per step
  if (steps > 0) {
    x_step = HostTensor(dtype, {steps, 1, kHidden});
    out_step = HostTensor(dtype, {steps, 1, kHidden});
    FillUniform(&x_step, 12, -unit, unit);
  }
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) positions[static_cast<size_t>(i)] = i;
  const TensorView prefill_positions =
      TensorView::contiguous(positions.data(), DType::kInt64, {1, tokens});

  // Warm-up on a scratch cache (a 32-token prefill and a decode step): loads OpenBLAS, starts the
  // thread pools and faults in the code, without touching the demo's cache.
  {
    KvCache scratch;
    status = layer->new_cache(1, 64, &scratch);
    const int64_t n = std::min<int64_t>(32, tokens);
    TensorView xv = x.view();
    xv.shape[1] = n;
    MutableTensorView ov = out.mutable_view();
    ov.shape[1] = n;
    TensorView pv = prefill_positions;
    pv.shape[1] = n;
    if (status.ok) status = layer->forward(xv, pv, &scratch, ov, threads);
    if (status.ok && n < 64) {
      const int64_t at = n;
      xv.shape[1] = ov.shape[1] = 1;
      status = layer->forward(xv, TensorView::contiguous(&at, DType::kInt64, {1, 1}), &scratch, ov,
                              threads);
    }
    if (!status.ok) return RuntimeError(kCommand, "forward (warm-up): " + status.message);
  }

  KvCache cache;
  status = layer->new_cache(1, max_len, &cache);
  if (!status.ok) return RuntimeError(kCommand, "new_cache: " + status.message);
  start = std::chrono::steady_clock::now();
  status = layer->forward(x.view(), prefill_positions, &cache, out.mutable_view(), threads);
  const double prefill_seconds = Seconds(start);
  if (!status.ok) return RuntimeError(kCommand, "forward (prefill): " + status.message);

  std::vector<double> step_seconds;
  std::vector<int64_t> step_positions(static_cast<size_t>(steps));
  for (int64_t s = 0; s < steps; ++s) {
    step_positions[static_cast<size_t>(s)] = tokens + s;
    const TensorView pv =
        TensorView::contiguous(&step_positions[static_cast<size_t>(s)], DType::kInt64, {1, 1});
    start = std::chrono::steady_clock::now();
    status =
        layer->forward(Batches(x_step, s, 1), pv, &cache, MutableBatches(out_step, s, 1), threads);
    step_seconds.push_back(Seconds(start));
    if (!status.ok) {
      return RuntimeError(kCommand,
                          "forward (decode step " + std::to_string(s) + "): " + status.message);
    }
  }

  const double t = static_cast<double>(tokens);
  const double projection_flop = 2.0 * t * weight_params;
  const double attention_flop = 4.0 * kHeadDim * kHeads * UnmaskedPairs(tokens, tokens, true);
  std::printf(
      "prefill (%lld tokens, %s):\n  %.3f s, %.0f tokens/s, %.1f GFLOP/s (projections %s FLOP + "
      "attention %s FLOP)\n",
      static_cast<long long>(tokens),
      tokens > AttentionLayer::kMaxDecodeTokens ? "attention_cte" : "the decode kernel",
      prefill_seconds, t / prefill_seconds,
      (projection_flop + attention_flop) / prefill_seconds * 1e-9,
      FormatG(projection_flop, 3).c_str(), FormatG(attention_flop, 3).c_str());
  if (steps > 0) {
    const double median = Median(step_seconds);
    const double kv_bytes =
        2.0 * kKvHeads * kHeadDim * element * (t + 0.5 * static_cast<double>(steps));
    const double weight_bytes = 4.0 * weight_params;  // the layer keeps its weights as float32
    std::printf(
        "decode (%lld steps of 1 token at positions %lld..%lld, the decode kernel):\n  median %.2f "
        "ms per step (min %.2f, max %.2f), %.1f tokens/s\n  reads per step: weights %.0f MB "
        "(float32 in the layer) + K/V %.1f MB = %.1f GB/s at the median\n",
        static_cast<long long>(steps), static_cast<long long>(tokens),
        static_cast<long long>(max_len - 1), median * 1e3,
        *std::min_element(step_seconds.begin(), step_seconds.end()) * 1e3,
        *std::max_element(step_seconds.begin(), step_seconds.end()) * 1e3, 1.0 / median,
        weight_bytes * 1e-6, kv_bytes * 1e-6, (weight_bytes + kv_bytes) / median * 1e-9);
  }
  std::fflush(stdout);

  // The check. The oracle is O(T^2) in float64 one token and one head at a time, so it cannot
  // redo the whole run in a demo's time; instead:
  //  (a) it recomputes the first `prefix` prefill tokens from scratch (its own cache): their
  //      outputs must match rows 0..prefix-1 of the timed prefill (causal: later tokens do not
  //      change them), and its K/V cache slots must match the layer's;
  //  (b) sampled rows past that prefix (8 prefill rows up to the last, and decode steps 0..3
  //      and the last) run through the oracle as one batch of single tokens, each sequence's
  //      cache seeded with the layer's K/V of the slots before its position: their outputs
  //      check Q, RoPE at large positions, attention over the whole cache and o_proj, and the
  //      K/V they write check the layer's cache slots at those positions.
  const auto check_start = std::chrono::steady_clock::now();
  const DType t_in = dtype;
  Check prefix_out{"prefill outputs, from scratch", "rows 0.." + std::to_string(prefix - 1)};
  Check prefix_kv{"K/V cache slots, from scratch", "slots 0.." + std::to_string(prefix - 1)};
  {
    reference::LayerCache rc;
    status = reference::make_layer_cache(config, 1, prefix, &rc);
    TensorView xv = x.view();
    xv.shape[1] = prefix;
    TensorView pv = prefill_positions;
    pv.shape[1] = prefix;
    std::vector<double> want;
    if (status.ok) status = reference::layer_forward(config, weights, xv, pv, &rc, &want);
    if (!status.ok) return RuntimeError(kCommand, "reference::layer_forward: " + status.message);
    for (int64_t i = 0; i < prefix * kHidden; ++i) {
      prefix_out.add(ElementAsFloat(out, i), want[static_cast<size_t>(i)]);
    }
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < prefix; ++j) {
        for (int64_t c = 0; c < kHeadDim; ++c) {
          const int64_t fast = (h * max_len + j) * kHeadDim + c;
          const size_t slow = static_cast<size_t>((h * prefix + j) * kHeadDim + c);
          prefix_kv.add(CacheElement(cache.k_data(), t_in, fast), rc.k[slow]);
          prefix_kv.add(CacheElement(cache.v_data(), t_in, fast), rc.v[slow]);
        }
      }
    }
  }

  // (b): the sampled rows, as (position, input tensor, its row, output tensor).
  struct Sample {
    int64_t position;
    const HostTensor* x;
    const HostTensor* out;
    int64_t row;
  };
  std::vector<Sample> samples;
  if (tokens > prefix) {
    const int64_t count = std::min<int64_t>(8, tokens - prefix);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t p = count == 1 ? tokens - 1 : prefix + r * (tokens - 1 - prefix) / (count - 1);
      samples.push_back({p, &x, &out, p});
    }
  }
  for (int64_t s : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, steps - 1}) {
    if (s < 0 || s >= steps) continue;
    if (!samples.empty() && samples.back().x == &x_step && samples.back().row >= s) continue;
    samples.push_back({tokens + s, &x_step, &out_step, s});
  }
  Check sampled_out{"sampled rows, oracle on the layer's cache", ""};
  Check sampled_kv{"K/V the sampled rows wrote", ""};
  if (!samples.empty()) {
    const int64_t n = static_cast<int64_t>(samples.size());
    std::string prefill_part, decode_part;
    int64_t prefill_rows = 0;
    for (const Sample& s : samples) {
      if (s.x == &x) {
        ++prefill_rows;
      } else {
        decode_part += (decode_part.empty() ? "decode " : ",") + std::to_string(s.row);
      }
    }
    if (prefill_rows > 0) {
      prefill_part = "prefill rows " + std::to_string(samples.front().position) + ".." +
                     std::to_string(samples[static_cast<size_t>(prefill_rows - 1)].position) +
                     " (" + std::to_string(prefill_rows) + ")";
    }
    sampled_out.rows =
        prefill_part + (prefill_part.empty() || decode_part.empty() ? "" : " + ") + decode_part;
    sampled_kv.rows = "their " + std::to_string(n) + " slots";
    int64_t longest = 0;
    for (const Sample& s : samples) longest = std::max(longest, s.position + 1);
    reference::LayerCache rc;
    status = reference::make_layer_cache(config, n, longest, &rc);
    if (!status.ok) return RuntimeError(kCommand, "reference::make_layer_cache: " + status.message);
    HostTensor xs(dtype, {n, 1, kHidden});
    std::vector<int64_t> at(static_cast<size_t>(n));
    for (int64_t b = 0; b < n; ++b) {
      const Sample& s = samples[static_cast<size_t>(b)];
      at[static_cast<size_t>(b)] = s.position;
      rc.lengths[static_cast<size_t>(b)] = s.position;
      std::memcpy(static_cast<char*>(xs.data()) + b * kHidden * element,
                  static_cast<const char*>(s.x->data()) + s.row * kHidden * element,
                  static_cast<size_t>(kHidden * element));
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < s.position; ++j) {
          for (int64_t c = 0; c < kHeadDim; ++c) {
            const int64_t fast = (h * max_len + j) * kHeadDim + c;
            const size_t slow =
                static_cast<size_t>(((b * kKvHeads + h) * longest + j) * kHeadDim + c);
            rc.k[slow] = CacheElement(cache.k_data(), t_in, fast);
            rc.v[slow] = CacheElement(cache.v_data(), t_in, fast);
          }
        }
      }
    }
    std::vector<double> want;
    status = reference::layer_forward(config, weights, xs.view(),
                                      TensorView::contiguous(at.data(), DType::kInt64, {n, 1}), &rc,
                                      &want);
    if (!status.ok) return RuntimeError(kCommand, "reference::layer_forward: " + status.message);
    for (int64_t b = 0; b < n; ++b) {
      const Sample& s = samples[static_cast<size_t>(b)];
      for (int64_t c = 0; c < kHidden; ++c) {
        sampled_out.add(ElementAsFloat(*s.out, s.row * kHidden + c),
                        want[static_cast<size_t>(b * kHidden + c)]);
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t c = 0; c < kHeadDim; ++c) {
          const int64_t fast = (h * max_len + s.position) * kHeadDim + c;
          const size_t slow =
              static_cast<size_t>(((b * kKvHeads + h) * longest + s.position) * kHeadDim + c);
          sampled_kv.add(CacheElement(cache.k_data(), t_in, fast), rc.k[slow]);
          sampled_kv.add(CacheElement(cache.v_data(), t_in, fast), rc.v[slow]);
        }
      }
    }
  }

  const double rtol = LayerRtol(dtype);
  std::printf(
      "check against the float64 layer oracle (%.1f s; pass: |a-b| <= 1e-5 + %s * "
      "max|ref| per line):\n",
      Seconds(check_start), FormatG(rtol, 2).c_str());
  bool pass = true;
  for (const Check* c : {&prefix_out, &prefix_kv, &sampled_out, &sampled_kv}) {
    if (c->rows.empty()) continue;
    const double tolerance = kAtol + rtol * c->max_ref;
    const bool ok = c->max_err <= tolerance;
    pass = pass && ok;
    std::printf("  %-42s %-44s max|err| %-9s tol %-9s (max|ref| %s) %s\n", c->what, c->rows.c_str(),
                FormatG(c->max_err, 3).c_str(), FormatG(tolerance, 3).c_str(),
                FormatG(c->max_ref, 3).c_str(), ok ? "ok" : "FAIL");
  }
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitOk : kExitRuntime;
}

}  // namespace

int DemoCommand(const std::vector<std::string>& args) {
  ParsedFlags f;
  std::string error;
  const std::vector<FlagSpec> specs = DemoFlagSpecs();
  if (!ParseFlags(args, specs, &f, &error)) return UsageError(kCommand, error);
  if (f.help_requested()) {
    std::printf(
        "usage: flashcte [demo] [--seqlen N] [--dtype D] [--threads T]\n"
        "       flashcte demo --layer [--tokens N] [--decode-steps S] [--check-prefix P] "
        "[--dtype D] [--threads T]\n\n"
        "A Llama-3-8B-shaped prefill (32 query heads, 8 KV heads, d=128, causal, scale\n"
        "1/sqrt(d)) on uniform [0, 1) inputs with a fixed seed: one timed run after a warm-up,\n"
        "then %d rows checked against the float64 reference (pass: |a-b| <= 1e-5 + 2e-2 *\n"
        "max|ref|). Exits 1 if the check fails.\n\n"
        "--layer: the attention layer (flashcte/layer.h) shaped as one Llama-3-8B layer (hidden\n"
        "4096, 32/8 heads, d=128, rope_theta 500000, Llama-3 rope scaling) with random weights:\n"
        "an N-token prefill and S single-token decode steps on one KV cache, timed (after a\n"
        "warm-up on a scratch cache), then checked against the float64 layer oracle: the first\n"
        "P prefill tokens recomputed from scratch (outputs and cache slots), and sampled rows\n"
        "past them (8 prefill rows, decode steps 0-3 and the last) through the oracle seeded\n"
        "with the layer's cached K/V (outputs and the slots they write). Pass: |a-b| <= 1e-5 +\n"
        "rtol * max|ref|, rtol 2e-2 (bf16), 2.5e-3 (fp16), 1e-4 (fp32). Exits 1 on failure.\n"
        "\nflags:\n%s",
        kSampleRows, FlagsHelp(specs).c_str());
    return kExitOk;
  }
  if (f.boolean("layer", false)) {
    if (f.has("seqlen")) return UsageError(kCommand, "--seqlen: not with --layer (use --tokens)");
    return LayerDemo(f);
  }
  for (const char* flag : {"tokens", "decode-steps", "check-prefix"}) {
    if (f.has(flag)) {
      return UsageError(kCommand, std::string("--") + flag + ": only with --layer");
    }
  }
  const int64_t seqlen = f.integer("seqlen", 4096);
  DType dtype = DType::kBFloat16;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &dtype);
  const int64_t group = kHeads / kKvHeads;

  Options o;
  o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHeadDim)));
  o.causal_mask = true;
  o.num_threads = static_cast<int>(f.integer("threads", 0));

  std::printf(
      "flashcte demo: Llama-3-8B-shaped prefill, %lld query heads / %lld KV heads, d=%lld, "
      "%lld tokens, causal, %s, scale 1/sqrt(%lld)\n",
      static_cast<long long>(kHeads), static_cast<long long>(kKvHeads),
      static_cast<long long>(kHeadDim), static_cast<long long>(seqlen), dtype_name(dtype),
      static_cast<long long>(kHeadDim));
  std::printf(
      "  inputs      uniform [0, 1), seeds 1/2/3; q (%lld, %lld, %lld), k (%lld, %lld, "
      "%lld), v (%lld, %lld, %lld)\n",
      static_cast<long long>(kHeads), static_cast<long long>(seqlen),
      static_cast<long long>(kHeadDim), static_cast<long long>(kKvHeads),
      static_cast<long long>(kHeadDim), static_cast<long long>(seqlen),
      static_cast<long long>(kKvHeads), static_cast<long long>(seqlen),
      static_cast<long long>(kHeadDim));
  std::printf("  SIMD target %s\n", simd_target().c_str());
  std::fflush(stdout);

  HostTensor q(dtype, {kHeads, seqlen, kHeadDim});
  HostTensor k(dtype, {kKvHeads, kHeadDim, seqlen});
  HostTensor v(dtype, {kKvHeads, seqlen, kHeadDim});
  HostTensor out(dtype, {kHeads, seqlen, kHeadDim});
  FillUniform(&q, 1, 0.0f, 1.0f);
  FillUniform(&k, 2, 0.0f, 1.0f);
  FillUniform(&v, 3, 0.0f, 1.0f);

  PlanSummary plan;
  Status status = plan_attention(q.view(), k.view(), v.view(), o, &plan);
  if (!status.ok) return RuntimeError(kCommand, "plan_attention: " + status.message);
  std::printf("plan:\n%s", DescribePlan(plan).c_str());
  std::fflush(stdout);

  // Warm-up on the first KV head's group only (1/8 of the work): it starts the thread pool and
  // faults in code and buffers without doubling the demo's run time.
  {
    Outputs warm;
    warm.out = MutableBatches(out, 0, group);
    status = attention_cte(Batches(q, 0, group), Batches(k, 0, 1), Batches(v, 0, 1), warm, o);
    if (!status.ok) return RuntimeError(kCommand, "attention_cte (warm-up): " + status.message);
  }
  Outputs outputs;
  outputs.out = out.mutable_view();
  const auto start = std::chrono::steady_clock::now();
  status = attention_cte(q.view(), k.view(), v.view(), outputs, o);
  const double seconds = Seconds(start);
  if (!status.ok) return RuntimeError(kCommand, "attention_cte: " + status.message);
  const double useful = 4.0 * kHeadDim * kHeads * UnmaskedPairs(seqlen, seqlen, true);
  std::printf(
      "time:\n  %.3f s for one run after a warm-up, %.1f GFLOP/s (useful FLOPs %s = "
      "4*d*heads*unmasked pairs)\n",
      seconds, useful / seconds * 1e-9, FormatG(useful).c_str());
  std::fflush(stdout);

  // The check: rows spread over heads (every KV group) and positions, first and last included.
  double max_err = 0, max_ref = 0, max_err_plain = 0;
  int64_t worst_head = 0, worst_row = 0;
  const auto check_start = std::chrono::steady_clock::now();
  for (int r = 0; r < kSampleRows; ++r) {
    const int64_t b = r * (kHeads - 1) / (kSampleRows - 1);
    const int64_t i = r * (seqlen - 1) / (kSampleRows - 1);
    TensorView q_row = q.view();
    q_row.data =
        static_cast<const char*>(q.data()) + (b * seqlen + i) * kHeadDim * dtype_size(dtype);
    q_row.shape = {1, 1, kHeadDim};
    Options row_options;
    row_options.scale = o.scale;
    row_options.causal_mask = true;
    row_options.cp_offset = i;  // the row's own position, so the causal bound stays at key i
    reference::Result ref, plain;
    status = reference::attention(q_row, Batches(k, b / group, 1), Batches(v, b / group, 1),
                                  row_options, &ref);
    if (!status.ok) return RuntimeError(kCommand, "reference::attention: " + status.message);
    status = reference::attention_plain(q_row, Batches(k, b / group, 1), Batches(v, b / group, 1),
                                        row_options, &plain);
    if (!status.ok) return RuntimeError(kCommand, "reference::attention_plain: " + status.message);
    for (int64_t c = 0; c < kHeadDim; ++c) {
      const double want = ref.out_at(0, 0, c);
      const double got = ElementAsFloat(out, (b * seqlen + i) * kHeadDim + c);
      const double err = std::fabs(got - want);
      if (!(err <= max_err)) {  // also catches NaN
        max_err = err;
        worst_head = b;
        worst_row = i;
      }
      max_err_plain = std::max(max_err_plain, std::fabs(plain.out_at(0, 0, c) - want));
      max_ref = std::max(max_ref, std::fabs(want));
    }
  }
  const double tolerance = kAtol + kRtol * max_ref;
  const bool pass = max_err <= tolerance;
  std::printf(
      "check (%d rows over heads 0..%lld and positions 0..%lld, float64 reference, %.2f s):\n",
      kSampleRows, static_cast<long long>(kHeads - 1), static_cast<long long>(seqlen - 1),
      Seconds(check_start));
  std::printf("  max |err|   %s (head %lld, row %lld); a plain %s implementation: %s\n",
              FormatG(max_err, 3).c_str(), static_cast<long long>(worst_head),
              static_cast<long long>(worst_row), dtype_name(dtype),
              FormatG(max_err_plain, 3).c_str());
  std::printf("  tolerance   %s = 1e-5 + 2e-2 * max|ref| (max|ref| = %s)\n",
              FormatG(tolerance, 3).c_str(), FormatG(max_ref, 4).c_str());
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? kExitOk : kExitRuntime;
}

}  // namespace flashcte::tools
