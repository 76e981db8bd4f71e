// `flashcte bench --decode` (bench_decode.h): one decode_attention shape, the median time per
// call over --reps after a warm-up, the K/V bytes a call must read (every attended slot of every
// KV head, K and V: batch x kv_heads x (cached + new) x 2d x the dtype's bytes), the GB/s that
// makes, and the machine's read bandwidth measured by the same program on the same threads.
//
// With --cold (the default) each rep first streams the bandwidth buffer (8x L3) on --threads
// threads, timed: that pass is both the bandwidth sample and the eviction of the caches from L3,
// as a model's other layers evict them in real use; bandwidth and decode reps are therefore
// interleaved (B, D, B, D, ...). Without --cold the bandwidth reps run first, then the decode
// reps back to back on warm caches (whatever of K/V fits in L3 stays there).
//
// With --block-size N the same call also runs on a paged copy of the cache (pages of N slots,
// vLLM's (num_blocks, kv_heads, block_size, d), the pages of each sequence at shuffled places in
// the pool), interleaved with the dense call rep by rep, and the paged/dense speed ratio is the
// median of the per-rep ratios. Before each paged call the bandwidth buffer is read as runs of
// one head's page (N x d x the dtype's bytes) in a shuffled order (ReadBandwidth::MeasureRuns):
// scattered runs read slower than one stream (on the Zen 5 EPYC KVM guest, 4 KiB runs at 0.7-0.8
// of the sequential rate, prefetched or not), and that pass is the ceiling of the paged call.
#include "tools/bench_decode.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcte/decode.h"
#include "tools/bandwidth.h"
#include "tools/commands.h"
#include "tools/json.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "bench";

struct DecodeConfig {
  int64_t batch, heads, kv_heads, d, cached, tokens, block_size;
  DType dtype;
  DType cache_dtype;  // dtype, or an 8-bit format with --kv-dtype
  int threads, reps;
  bool cold, json;
  int64_t max_len() const { return cached + tokens; }
  // K and V of every slot the last new token attends, for every sequence and KV head.
  double kv_bytes() const {
    return static_cast<double>(batch * kv_heads * max_len() * 2 * d) * dtype_size(cache_dtype);
  }
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One row: the dense cache (block_size 0) or the paged one. Paged rows: `speed_ratio` is the
// median over reps of the dense time over the paged time of the same rep, `runs_bandwidth` the
// shuffled-runs read rate (ReadBandwidth::MeasureRuns).
void PrintRow(const DecodeConfig& c, int64_t block_size, const std::vector<double>& ms,
              double bandwidth, double speed_ratio, double runs_bandwidth, bool header) {
  const bool paged = block_size > 0;
  const double median_ms = Median(ms);
  const double gbps = c.kv_bytes() / (median_ms * 1e-3) * 1e-9;
  // A call cannot read faster than memory: a ratio above 1 says the measurement is the one wrong
  // (a guest whose bandwidth moved between the passes, or a read pattern the pass does not
  // reach), and is printed with a warning, never alone.
  const bool above = gbps > bandwidth || (paged && gbps > runs_bandwidth);
  if (c.json) {
    PrintJsonLine({{"impl", "flashcte-decode"},
                   {"dtype", dtype_name(c.dtype)},
                   {"kv_dtype", dtype_name(c.cache_dtype)},
                   {"batch", c.batch},
                   {"heads", c.heads},
                   {"kv_heads", c.kv_heads},
                   {"d", c.d},
                   {"cached", c.cached},
                   {"new", c.tokens},
                   {"block_size", block_size},
                   {"threads", c.threads},
                   {"cold", c.cold},
                   {"reps", c.reps},
                   {"median_ms", median_ms},
                   {"min_ms", *std::min_element(ms.begin(), ms.end())},
                   {"kv_bytes", c.kv_bytes()},
                   {"kv_gbps", gbps},
                   {"read_bandwidth_gbps", bandwidth},
                   {"bandwidth_ratio", gbps / bandwidth},
                   {"paged_over_dense_speed", paged ? Json(speed_ratio) : Json()},
                   {"runs_bandwidth_gbps", paged ? Json(runs_bandwidth) : Json()},
                   {"runs_bandwidth_ratio", paged ? Json(gbps / runs_bandwidth) : Json()},
                   {"above_bandwidth", above},
                   {"simd", simd_target()}});
    return;
  }
  if (header) {
    std::printf("%-9s %5s %9s %5s %7s %4s %6s %3s %4s %10s %9s %8s %9s %6s %7s %9s %7s\n", "dtype",
                "batch", "heads/kv", "d", "cached", "new", "cache", "thr", "cold", "median_ms",
                "KV_MB", "KV_GB/s", "read_GB/s", "ratio", "vs_dense", "runs_GB/s", "vs_runs");
  }
  const std::string cache = paged ? "page" + std::to_string(block_size) : "dense";
  const auto fixed = [paged](double x, int decimals) {
    if (!paged) return std::string("-");
    char text[32];
    std::snprintf(text, sizeof text, "%.*f", decimals, x);
    return std::string(text);
  };
  std::printf(
      "%-9s %5lld %5lld/%-3lld %5lld %7lld %4lld %6s %3d %4s %10.3f %9.1f %8.2f %9.2f %6.2f %7s "
      "%9s %7s\n",
      dtype_name(c.cache_dtype), static_cast<long long>(c.batch), static_cast<long long>(c.heads),
      static_cast<long long>(c.kv_heads), static_cast<long long>(c.d),
      static_cast<long long>(c.cached), static_cast<long long>(c.tokens), cache.c_str(), c.threads,
      c.cold ? "yes" : "no", median_ms, c.kv_bytes() * 1e-6, gbps, bandwidth, gbps / bandwidth,
      fixed(speed_ratio, 3).c_str(), fixed(runs_bandwidth, 2).c_str(),
      fixed(gbps / runs_bandwidth, 2).c_str());
  if (above) {
    std::printf(c.cold ? "warning: this call read K/V faster than the read bandwidth measured "
                         "beside it (ratio above 1): that figure is no ceiling here; take the "
                         "ratio as an upper estimate\n"
                       : "warning: ratio above 1: with --cold false the K/V come from the "
                         "caches, not DRAM, and the bandwidth is no ceiling for them\n");
  }
}

void PrintNote(const DecodeConfig& c, const std::vector<double>& bw) {
  if (c.json) return;
  std::printf(
      "\nread_GB/s: median of %d streaming-read passes over %.0f MiB on %d threads%s; "
      "SIMD target %s\n",
      static_cast<int>(bw.size()), static_cast<double>(BandwidthBufferBytes()) / 1048576.0,
      c.threads, c.cold ? ", interleaved with the decode reps" : ", before the decode reps",
      simd_target().c_str());
  if (c.block_size > 0) {
    std::printf(
        "runs_GB/s: the same buffer read as runs of one head's page (%lld bytes) in a shuffled "
        "order, the paged call's ceiling; vs_runs = KV_GB/s / runs_GB/s\n",
        static_cast<long long>(c.block_size) * c.d * dtype_size(c.cache_dtype));
  }
}

}  // namespace

const char* const kNotForDecode[] = {"sq",      "skv",     "causal",       "impl",
                                     "q-block", "kv-tile", "openblas-core"};
const int kNotForDecodeCount = static_cast<int>(sizeof(kNotForDecode) / sizeof(kNotForDecode[0]));

std::vector<FlagSpec> DecodeBenchFlagSpecs() {
  return {
      {"decode", FlagKind::kBool,
       "time decode_attention (new tokens against a KV cache) instead of attention_cte"},
      {"batch", FlagKind::kInt, "--decode: sequences (default 1)", 1, 4096},
      {"cached", FlagKind::kInt, "--decode: cached tokens per sequence (default 4096)", 0,
       int64_t{1} << 24},
      {"new", FlagKind::kInt, "--decode: new tokens per sequence, T (default 1)", 1, 4096},
      {"cold", FlagKind::kBool,
       "--decode: evict the caches from L3 before each call (default true)"},
      {"mixed", FlagKind::kInt,
       "--decode: time a mixed batch instead, one N-token prefill chunk plus --batch decoding "
       "sequences in one flash_attn_varlen_kvcache call, against the two calls (paged, "
       "--block-size default 16; bfloat16 unless --dtype)",
       1, int64_t{1} << 20},
      {"kv-dtype", FlagKind::kChoice,
       "--decode: an 8-bit cache (codes over the format's range, one scale per tensor) with q "
       "and out in --dtype (default: the cache in --dtype)",
       0, 0, "int8|float8_e4m3fn|float8_e5m2"},
      {"block-size", FlagKind::kInt,
       "--decode: also time the call on a paged copy of the cache, pages of N slots, "
       "interleaved with the dense one (default 0: dense only)",
       0, int64_t{1} << 24},
  };
}

int DecodeBench(const ParsedFlags& f) {
  for (int i = 0; i < kNotForDecodeCount; ++i) {
    if (f.has(kNotForDecode[i])) {
      return UsageError(kCommand, std::string("--") + kNotForDecode[i] + ": not used by --decode");
    }
  }
  if (f.has("mixed")) {
    if (f.has("kv-dtype")) return UsageError(kCommand, "--kv-dtype: not used by --mixed");
    return MixedBench(f);
  }
  DecodeConfig c;
  c.batch = f.integer("batch", 1);
  c.heads = f.integer("heads", 32);
  c.kv_heads = f.integer("kv-heads", 8);
  c.d = f.integer("d", 128);
  c.cached = f.integer("cached", 4096);
  c.tokens = f.integer("new", 1);
  c.block_size = f.integer("block-size", 0);
  c.dtype = DType::kFloat32;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &c.dtype);
  c.cache_dtype = c.dtype;
  if (f.has("kv-dtype")) {
    const std::string kv = f.text("kv-dtype");
    c.cache_dtype = kv == "int8"            ? DType::kInt8
                    : kv == "float8_e4m3fn" ? DType::kFloat8E4M3
                                            : DType::kFloat8E5M2;
  }
  c.threads = static_cast<int>(f.integer("threads", 0));
  if (c.threads == 0) c.threads = omp_get_max_threads();
  c.reps = static_cast<int>(f.integer("reps", 5));
  c.cold = f.boolean("cold", true);
  c.json = f.boolean("json", false);
  if (c.heads % c.kv_heads != 0) {
    return UsageError(kCommand, "--kv-heads: " + std::to_string(c.kv_heads) +
                                    " must divide --heads = " + std::to_string(c.heads));
  }
  HostTensor q(c.dtype, {c.batch, c.heads, c.tokens, c.d});
  HostTensor k(c.cache_dtype, {c.batch, c.kv_heads, c.max_len(), c.d});
  HostTensor v(c.cache_dtype, {c.batch, c.kv_heads, c.max_len(), c.d});
  HostTensor out(c.dtype, {c.batch, c.heads, c.tokens, c.d});
  FillUniform(&q, 1, 0.0f, 1.0f);
  // An 8-bit cache holds codes over its range with a scale that maps them to [0, 1).
  const bool kv8 = c.cache_dtype != c.dtype;
  const float code_top = c.cache_dtype == DType::kInt8 ? 127.0f : 256.0f;
  FillUniform(&k, 2, 0.0f, kv8 ? code_top : 1.0f);
  FillUniform(&v, 3, 0.0f, kv8 ? code_top : 1.0f);
  const std::vector<float> kv_scale = {1.0f / code_top};
  std::vector<int64_t> positions;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t t = 0; t < c.tokens; ++t) positions.push_back(c.cached + t);
  }
  DecodeOptions options;
  options.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  options.num_threads = c.threads;
  if (kv8) {
    options.k_scale = TensorView::contiguous(kv_scale.data(), DType::kFloat32, {1});
    options.v_scale = options.k_scale;
  }
  DecodeOutputs outputs;
  outputs.out = MutableTensorView::contiguous(out.data(), c.dtype, out.shape());
  // The paged copy: sequence b's page i at a shuffled place of the pool.
  const int64_t pages = c.block_size > 0 ? (c.max_len() + c.block_size - 1) / c.block_size : 0;
  HostTensor k_pool, v_pool;
  std::vector<int32_t> table(static_cast<size_t>(c.batch * pages));
  if (c.block_size > 0) {
    for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
    std::shuffle(table.begin(), table.end(), std::mt19937(7));
    k_pool = HostTensor(c.cache_dtype, {c.batch * pages, c.kv_heads, c.block_size, c.d});
    v_pool = HostTensor(c.cache_dtype, {c.batch * pages, c.kv_heads, c.block_size, c.d});
    const size_t row = static_cast<size_t>(c.d * dtype_size(c.cache_dtype));
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t h = 0; h < c.kv_heads; ++h) {
        for (int64_t j = 0; j < c.max_len(); ++j) {
          const int64_t page = table[b * pages + j / c.block_size];
          const size_t from = static_cast<size_t>((b * c.kv_heads + h) * c.max_len() + j) * row;
          const size_t to =
              static_cast<size_t>((page * c.kv_heads + h) * c.block_size + j % c.block_size) * row;
          std::memcpy(k_pool.as<char>() + to, k.as<char>() + from, row);
          std::memcpy(v_pool.as<char>() + to, v.as<char>() + from, row);
        }
      }
    }
  }
  const auto run = [&](bool paged) {
    DecodeOptions o = options;
    if (paged) {
      o.block_table = TensorView::contiguous(table.data(), DType::kInt32, {c.batch, pages});
    }
    const HostTensor& kc = paged ? k_pool : k;
    const HostTensor& vc = paged ? v_pool : v;
    return decode_attention(
        TensorView::contiguous(q.data(), c.dtype, q.shape()),
        TensorView::contiguous(kc.data(), c.cache_dtype, kc.shape()),
        TensorView::contiguous(vc.data(), c.cache_dtype, vc.shape()),
        TensorView::contiguous(positions.data(), DType::kInt64, {c.batch, c.tokens}), outputs, o);
  };
  ReadBandwidth buffer(BandwidthBufferBytes());
  const int kinds = c.block_size > 0 ? 2 : 1;
  for (int kind = 0; kind < kinds; ++kind) {
    if (Status s = run(kind == 1); !s.ok) {
      return RuntimeError(kCommand, "decode_attention: " + s.message);
    }
  }
  const size_t run_bytes = static_cast<size_t>(c.block_size * c.d * dtype_size(c.cache_dtype));
  std::vector<double> ms[2], bw, runs_bw;
  if (!c.cold) {
    for (int r = 0; r < c.reps; ++r) {
      bw.push_back(buffer.Measure(c.threads));
      if (kinds == 2) runs_bw.push_back(buffer.MeasureRuns(c.threads, run_bytes));
    }
  }
  for (int r = 0; r < c.reps; ++r) {
    for (int kind = 0; kind < kinds; ++kind) {  // dense, paged, dense, paged, ...
      if (c.cold) {
        if (kind == 0) {
          bw.push_back(buffer.Measure(c.threads));
        } else {
          runs_bw.push_back(buffer.MeasureRuns(c.threads, run_bytes));
        }
      }
      const auto start = std::chrono::steady_clock::now();
      if (Status s = run(kind == 1); !s.ok) {
        return RuntimeError(kCommand, "decode_attention: " + s.message);
      }
      ms[kind].push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
  }
  std::vector<double> ratios;
  for (size_t r = 0; kinds == 2 && r < ms[0].size(); ++r) ratios.push_back(ms[0][r] / ms[1][r]);
  PrintRow(c, 0, ms[0], Median(bw), 0.0, 0.0, true);
  if (kinds == 2) {
    PrintRow(c, c.block_size, ms[1], Median(bw), Median(ratios), Median(runs_bw), false);
  }
  PrintNote(c, bw);
  return kExitOk;
}

int BandwidthBench(int threads, int reps, bool json) {
  ReadBandwidth buffer(BandwidthBufferBytes());
  buffer.Measure(threads);  // warm-up: page tables, clocks
  std::vector<int> counts = {1};
  if (threads > 1) counts.push_back(threads);
  std::vector<std::vector<double>> gbps(counts.size());
  for (int r = 0; r < reps; ++r) {  // interleaved: 1 thread, T threads, 1 thread, ...
    for (size_t i = 0; i < counts.size(); ++i) gbps[i].push_back(buffer.Measure(counts[i]));
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    const double median = Median(gbps[i]);
    const double best = *std::max_element(gbps[i].begin(), gbps[i].end());
    if (json) {
      PrintJsonLine({{"impl", "bandwidth"},
                     {"threads", counts[i]},
                     {"bytes", buffer.bytes()},
                     {"reps", reps},
                     {"gbps", median},
                     {"best_gbps", best}});
    } else {
      std::printf(
          "read bandwidth, %d thread%s: median %.2f GB/s, best %.2f GB/s (%d passes over "
          "%.0f MiB)\n",
          counts[i], counts[i] == 1 ? "" : "s", median, best, reps,
          static_cast<double>(buffer.bytes()) / 1048576.0);
    }
  }
  return kExitOk;
}

}  // namespace flashcte::tools
