// `flashcte bench --decode --mixed P` (bench_decode.h): a serving engine's mixed batch, one
// P-token prefill chunk (a new prompt) plus --batch sequences each decoding --new tokens over
// --cached tokens, all in one paged cache (pages of --block-size slots, FlashAttention's
// (num_blocks, block_size, kv_heads, d), every sequence's pages at shuffled places). The one call
// (flash_attn_varlen_kvcache over the whole batch) is timed against the two separate calls a
// serving loop would make otherwise (the prefill chunk, then the decode batch, back to back),
// interleaved rep by rep, after a bandwidth pass that evicts the caches (--cold). Printed: the
// median times, the median per-rep ratio separate / mixed, and each thread's busy share of the
// mixed call's parallel region (ThreadProfile), the lowest over the reps' medians.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "tools/bandwidth.h"
#include "tools/bench_decode.h"
#include "tools/commands.h"
#include "tools/json.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "bench";

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One call's sequences: rows [first, last) of the batch's sequence list.
struct Call {
  std::vector<int32_t> cu, used, table;
  int64_t first_token = 0, tokens = 0;
};

}  // namespace

int MixedBench(const ParsedFlags& f) {
  const int64_t prefill = f.integer("mixed", 1024), decoding = f.integer("batch", 31);
  const int64_t heads = f.integer("heads", 32), kv_heads = f.integer("kv-heads", 8);
  const int64_t d = f.integer("d", 128), cached = f.integer("cached", 4096);
  const int64_t tokens = f.integer("new", 1), block = f.integer("block-size", 16);
  DType dtype = DType::kBFloat16;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &dtype);
  int threads = static_cast<int>(f.integer("threads", 0));
  if (threads == 0) threads = omp_get_max_threads();
  const int reps = static_cast<int>(f.integer("reps", 7));
  const bool cold = f.boolean("cold", true), json = f.boolean("json", false);
  if (heads % kv_heads != 0) {
    return UsageError(kCommand, "--kv-heads: " + std::to_string(kv_heads) +
                                    " must divide --heads = " + std::to_string(heads));
  }
  if (block < 1) return UsageError(kCommand, "--block-size: --mixed needs a paged cache, >= 1");
  // Sequence 0 is the prefill chunk (a prompt of `prefill` tokens), 1.. decode `tokens` each.
  std::vector<int64_t> q_lens{prefill}, used{prefill};
  for (int64_t b = 0; b < decoding; ++b) {
    q_lens.push_back(tokens);
    used.push_back(cached + tokens);
  }
  const int64_t batch = decoding + 1, total_q = prefill + decoding * tokens;
  const int64_t pages = (*std::max_element(used.begin(), used.end()) + block - 1) / block;
  std::vector<int32_t> table(static_cast<size_t>(batch * pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(7));
  HostTensor q(dtype, {total_q, heads, d}), out(dtype, {total_q, heads, d});
  HostTensor k(dtype, {batch * pages, block, kv_heads, d}),
      v(dtype, {batch * pages, block, kv_heads, d});
  FillUniform(&q, 1, 0.0f, 1.0f);
  FillUniform(&k, 2, 0.0f, 1.0f);
  FillUniform(&v, 3, 0.0f, 1.0f);

  // The calls: [0] the whole batch; [1] the prefill chunk alone; [2] the decode batch alone.
  const auto make_call = [&](int64_t first, int64_t last) {
    Call c;
    c.cu.push_back(0);
    for (int64_t b = first; b < last; ++b) {
      c.cu.push_back(static_cast<int32_t>(c.cu.back() + q_lens[b]));
      c.used.push_back(static_cast<int32_t>(used[b]));
      c.table.insert(c.table.end(), table.begin() + b * pages, table.begin() + (b + 1) * pages);
    }
    c.first_token = std::accumulate(q_lens.begin(), q_lens.begin() + first, int64_t{0});
    c.tokens = c.cu.back();
    return c;
  };
  const Call calls[] = {make_call(0, batch), make_call(0, 1), make_call(1, batch)};
  const auto run = [&](const Call& c, ThreadProfile* profile) {
    const auto n = static_cast<int64_t>(c.used.size());
    const int64_t row = heads * d * dtype_size(dtype);
    VarlenKvCacheOptions o;
    o.cu_seqlens_q = TensorView::contiguous(c.cu.data(), DType::kInt32, {n + 1});
    o.seqused_k = TensorView::contiguous(c.used.data(), DType::kInt32, {n});
    o.block_table = TensorView::contiguous(c.table.data(), DType::kInt32, {n, pages});
    o.causal = true;
    o.num_threads = threads;
    o.profile = profile;
    return flash_attn_varlen_kvcache(
        TensorView::contiguous(q.as<char>() + c.first_token * row, dtype, {c.tokens, heads, d}),
        TensorView::contiguous(k.data(), dtype, k.shape()),
        TensorView::contiguous(v.data(), dtype, v.shape()),
        MutableTensorView::contiguous(out.as<char>() + c.first_token * row, dtype,
                                      {c.tokens, heads, d}),
        {}, o);
  };
  for (const Call& c : calls) {
    if (Status s = run(c, nullptr); !s.ok) {
      return RuntimeError(kCommand, "flash_attn_varlen_kvcache: " + s.message);
    }
  }
  ReadBandwidth buffer(BandwidthBufferBytes());
  std::vector<double> mixed_ms, separate_ms, ratios, bw;
  std::vector<std::vector<double>> shares(static_cast<size_t>(threads));
  std::vector<std::vector<double>> separate_shares(static_cast<size_t>(threads));
  const auto now = [] { return std::chrono::steady_clock::now(); };
  const auto ms_since = [&](auto start) {
    return std::chrono::duration<double, std::milli>(now() - start).count();
  };
  for (int r = 0; r < reps; ++r) {
    // Mixed, then separate (or the other way round on odd reps): A B B A ...
    for (int order = 0; order < 2; ++order) {
      const bool mixed = (order == 0) == (r % 2 == 0);
      if (cold) bw.push_back(buffer.Measure(threads));
      ThreadProfile profile, prefill_profile, decode_profile;
      const auto start = now();
      if (mixed) {
        (void)run(calls[0], &profile);
        mixed_ms.push_back(ms_since(start));
        for (size_t t = 0; t < profile.busy_seconds.size() && t < shares.size(); ++t) {
          shares[t].push_back(profile.busy_seconds[t] / profile.wall_seconds);
        }
      } else {
        (void)run(calls[1], &prefill_profile);
        (void)run(calls[2], &decode_profile);
        separate_ms.push_back(ms_since(start));
        // Busy share of the two regions together: busy time over the sum of their wall times.
        const double wall = prefill_profile.wall_seconds + decode_profile.wall_seconds;
        for (size_t t = 0; t < separate_shares.size(); ++t) {
          double busy = 0;
          for (const ThreadProfile* p : {&prefill_profile, &decode_profile}) {
            if (t < p->busy_seconds.size()) busy += p->busy_seconds[t];
          }
          separate_shares[t].push_back(busy / wall);
        }
      }
    }
    ratios.push_back(separate_ms.back() / mixed_ms.back());
  }
  std::vector<double> busy, separate_busy;
  for (size_t t = 0; t < shares.size(); ++t) {
    busy.push_back(Median(shares[t]));
    separate_busy.push_back(Median(separate_shares[t]));
  }
  if (json) {
    PrintJsonLine({{"impl", "flashcte-mixed"},
                   {"dtype", dtype_name(dtype)},
                   {"prefill", prefill},
                   {"decoding", decoding},
                   {"new", tokens},
                   {"cached", cached},
                   {"heads", heads},
                   {"kv_heads", kv_heads},
                   {"d", d},
                   {"block_size", block},
                   {"threads", threads},
                   {"reps", reps},
                   {"mixed_ms", Median(mixed_ms)},
                   {"separate_ms", Median(separate_ms)},
                   {"separate_over_mixed", Median(ratios)},
                   {"busy_share", busy},
                   {"separate_busy_share", separate_busy},
                   {"read_bandwidth_gbps", bw.empty() ? 0.0 : Median(bw)},
                   {"simd", simd_target()}});
    return kExitOk;
  }
  // Each thread's share with 3 decimals, cut: "0.987,0.912".
  const auto shares_text = [](const std::vector<double>& share) {
    std::string text;
    for (size_t t = 0; t < share.size(); ++t) {
      text += (t ? "," : "") + std::to_string(share[t]).substr(0, 5);
    }
    return text;
  };
  std::printf(
      "mixed batch, %s: one %lld-token prefill chunk + %lld sequences decoding %lld over %lld "
      "cached, %lld/%lld heads, d %lld, pages of %lld, %d threads, %d reps%s\n",
      dtype_name(dtype), static_cast<long long>(prefill), static_cast<long long>(decoding),
      static_cast<long long>(tokens), static_cast<long long>(cached), static_cast<long long>(heads),
      static_cast<long long>(kv_heads), static_cast<long long>(d), static_cast<long long>(block),
      threads, reps, cold ? ", cold" : "");
  std::printf("  one call:       median %9.3f ms, busy share per thread %s\n", Median(mixed_ms),
              shares_text(busy).c_str());
  std::printf("  two calls:      median %9.3f ms, busy share per thread %s\n", Median(separate_ms),
              shares_text(separate_busy).c_str());
  std::printf("  two / one:      %.3f (median of the per-rep ratios); SIMD target %s\n",
              Median(ratios), simd_target().c_str());
  return kExitOk;
}

}  // namespace flashcte::tools
