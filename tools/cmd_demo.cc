// `flashcte demo` (and `flashcte` alone): the library's main job on an embedded default, a
// Llama-3-8B-shaped prefill (32 query heads sharing 8 KV heads, d = 128, 4096 tokens, causal,
// bfloat16, scale 1/sqrt(d)) on random inputs. It times one run after a warm-up, then checks a
// sample of rows against the float64 reference with the Neuron suite's comparator.
//
// The check is cheap because the reference computes whole rows: one query row against the full
// K and V of its KV head is just views with offset data pointers, shape (1, 1, d), and the row's
// causal position restored through cp_offset (q_pos = cp_offset + 0).
//
// `flashcte demo --layer` runs the attention layer instead (demo_layer.cc); the flags and the
// help of both modes live here.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/reference/reference.h"
#include "tools/args.h"
#include "tools/attention_flags.h"
#include "tools/commands.h"
#include "tools/demo_layer.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

using demo::Batches;
using demo::kAtol;
using demo::kHeadDim;
using demo::kHeads;
using demo::kKvHeads;
using demo::MutableBatches;
using demo::Seconds;

constexpr char kCommand[] = "demo";
constexpr int kSampleRows = 16;
// The Neuron suite's bfloat16 rtol, which the kernel demo applies in every dtype.
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

void PrintDemoHelp(const std::vector<FlagSpec>& specs) {
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
}

// The check: rows spread over heads (every KV group) and positions, first and last included.
int CheckKernelRows(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                    const HostTensor& out, float scale, int64_t seqlen, DType dtype) {
  const int64_t group = kHeads / kKvHeads;
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
    row_options.scale = scale;
    row_options.causal_mask = true;
    row_options.cp_offset = i;  // the row's own position, so the causal bound stays at key i
    reference::Result ref, plain;
    Status status = reference::attention(q_row, Batches(k, b / group, 1), Batches(v, b / group, 1),
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

// The kernel on the Llama-3-8B prefill: plan, warm-up, one timed run, then the check.
int KernelDemo(const ParsedFlags& f) {
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

  return CheckKernelRows(q, k, v, out, o.scale, seqlen, dtype);
}

}  // namespace

int DemoCommand(const std::vector<std::string>& args) {
  ParsedFlags f;
  if (int rc = ParseCommandFlags(kCommand, args, DemoFlagSpecs(), PrintDemoHelp, &f);
      rc != kContinue) {
    return rc;
  }
  if (f.boolean("layer", false)) {
    if (f.has("seqlen")) return UsageError(kCommand, "--seqlen: not with --layer (use --tokens)");
    return demo::LayerDemo(f);
  }
  for (const char* flag : {"tokens", "decode-steps", "check-prefix"}) {
    if (f.has(flag)) {
      return UsageError(kCommand, std::string("--") + flag + ": only with --layer");
    }
  }
  return KernelDemo(f);
}

}  // namespace flashcte::tools
