// Serving paths on several threads (issue 41; the design in threads_serving_test.cc's file
// comment): flash_attn_varlen_kvcache on a mixed batch (prefill chunks and decodes in one region,
// paged, float and 8-bit caches) and attention_cte on rank-4 batches, each on 1 thread against the
// float64 oracle, then bitwise that run on 3 threads and on OpenMP's default.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "flashcte/kvcache.h"
#include "flashcte/layer.h"
#include "flashcte/merge.h"
#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/reference/layer_reference.h"
#include "src/reference/reference.h"
#include "tests/layer/layer_test_util.h"
#include "tests/reliability/threads_serving_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---- flash_attn_varlen_kvcache -----------------------------------------------------------------

// A serving step's mixed batch: decodes (1 and 3 tokens; 1300 and 900 cached: 2 chunks and 1),
// prefill chunks of 17 tokens over 2100 keys (the KV axis split) and of 20 over 150, a sequence
// without queries this step; causal, with sinks. One parallel region for all of it.
struct VarlenSetup {
  DType dtype;
  Formats formats;
  std::vector<int64_t> q_lens = {1, 17, 1, 3, 0, 20};
  std::vector<int32_t> used = {1300, 2100, 40, 900, 30, 150};
  std::vector<int32_t> cu = {0};
  CacheShape shape;
  HostTensor q;
  Cache k, v;
  std::vector<float> sink;

  VarlenSetup(DType dtype_, Formats f, int64_t block)
      : dtype(dtype_),
        formats(f),
        shape(6, 2100, block, /*heads_outer=*/false, 7),
        q(dtype_, {std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0}), kHeads, kD}),
        k(shape, f.k, kD, f.k_scales),
        v(shape, f.v, kDv, f.v_scales) {
    for (int64_t len : q_lens) cu.push_back(cu.back() + static_cast<int32_t>(len));
    std::mt19937_64 rng(29);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t i = 0; i < total(); ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kD; ++x) q.set(i, h, x, u(rng));
      }
    }
    k.fill(used, &rng);
    v.fill(used, &rng);
    sink = sinks(&rng);
  }
  int64_t batch() const { return static_cast<int64_t>(q_lens.size()); }
  int64_t total() const { return cu.back(); }

  Outcome run(int threads) const {
    HostTensor out(dtype, {total(), kHeads, kDv});
    out.fill_sentinel();
    std::vector<float> lse = nan_floats(kHeads * total());
    VarlenKvCacheOptions o;
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {batch() + 1});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {batch()});
    o.block_table = shape.table_view();
    o.k_scale = k.scale_view();
    o.v_scale = v.scale_view();
    o.sinks = TensorView::contiguous(sink.data(), DType::kFloat32, {kHeads});
    o.causal = true;
    o.num_threads = threads;
    ThreadProfile profile;
    o.profile = &profile;
    const Status s = flash_attn_varlen_kvcache(
        q.view(), k.view(), v.view(), out.mutable_view(),
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, total()}), o);
    EXPECT_TRUE(s.ok) << s.message;
    if (threads > 0) {
      EXPECT_EQ(profile.busy_seconds.size(), static_cast<size_t>(threads))
          << "the region did not run on " << threads << " threads";
    }
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (int64_t b = 0; b < batch(); ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = cu[b]; i < cu[b + 1]; ++i) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(i, h, x));
          r.lse.push_back(lse[static_cast<size_t>(h * total() + i)]);
        }
      }
    }
    return r;
  }

  // Sequence b: its query rows over its used slots, query i at position used - rows + i.
  ::testing::AssertionResult exact(const Outcome& r) const {
    Oracle g;
    for (int64_t b = 0; b < batch(); ++b) {
      const int64_t rows = q_lens[b], keys = used[b];
      if (rows == 0) continue;
      Problem p(kHeads, kKvHeads, rows, keys, kD, kDv);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t x = 0; x < kD; ++x) p.qa(h, i, x) = q.get(cu[b] + i, h, x);
        }
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t x = 0; x < kD; ++x) p.ka(h, j, x) = k.get(b, h, j, x);
          for (int64_t x = 0; x < kDv; ++x) p.va(h, j, x) = v.get(b, h, j, x);
        }
      }
      for (int64_t i = 0; i < rows; ++i) p.hi[i] = keys - rows + i + 1;
      p.sink = sink;
      add_oracle(p, oracle_dtype(dtype, formats), &g);
    }
    return matches(r, g, dtype);
  }
};

void expect_varlen(const VarlenSetup& s) {
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

TEST(ThreadsServing, VarlenMixedBatchPaged) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", pages of 16");
    expect_varlen(VarlenSetup(dtype, float_caches(dtype), 16));
  }
  SCOPED_TRACE("float32, dense");
  expect_varlen(VarlenSetup(DType::kFloat32, float_caches(DType::kFloat32), 0));
}

TEST(ThreadsServing, VarlenMixedBatchInt8Fp8Paged) {
  const Formats f{DType::kInt8, DType::kFloat8E5M2, Scales::kToken, Scales::kHead};
  SCOPED_TRACE("k int8 per token, v e5m2 per KV head, pages of 16");
  expect_varlen(VarlenSetup(DType::kFloat32, f, 16));
}

// ---- attention_cte on rank-4 batches -----------------------------------------------------------

// Entry b of a rank-4 view along axis 0: the rank-3 view of the single call.
TensorView entry(const TensorView& t, int64_t b) {
  TensorView r;
  r.data = static_cast<const uint8_t*>(t.data) + b * t.strides[0] * dtype_size(t.dtype);
  r.dtype = t.dtype;
  r.rank = 3;
  for (int i = 0; i < 3; ++i) {
    r.shape[i] = t.shape[i + 1];
    r.strides[i] = t.strides[i + 1];
  }
  return r;
}

// A batch of 3 problems of `heads` query heads over kv_heads in one call: q (3, heads, sq, d),
// k (3, kv_heads, skv, d) (tp_k), v (3, kv_heads, skv, dv), a sink per entry and head.
struct BatchSetup {
  static constexpr int64_t kBatch = 3;
  DType dtype;
  int64_t heads, kv_heads, sq, skv;
  bool causal;
  TileConfig tiles;
  Tensor4 q, k, v;
  std::vector<float> sink;

  BatchSetup(DType dtype_, int64_t heads_, int64_t kv_heads_, int64_t sq_, int64_t skv_,
             bool causal_, TileConfig tiles_)
      : dtype(dtype_),
        heads(heads_),
        kv_heads(kv_heads_),
        sq(sq_),
        skv(skv_),
        causal(causal_),
        tiles(tiles_),
        q(dtype_, {kBatch, heads_, sq_, kD}),
        k(dtype_, {kBatch, kv_heads_, skv_, kD}),
        v(dtype_, {kBatch, kv_heads_, skv_, kDv}) {
    std::mt19937_64 rng(31);
    fill(&q, &rng);
    fill(&k, &rng);
    fill(&v, &rng);
    std::uniform_real_distribution<double> u(-2.0, 2.0);
    for (int64_t i = 0; i < kBatch * heads; ++i) sink.push_back(static_cast<float>(u(rng)));
  }
  Options options() const {
    Options o;
    o.tp_k = true;
    o.scale = kScale;
    o.causal_mask = causal;
    o.tiles = tiles;
    return o;
  }

  Outcome run(int threads) const {
    Tensor4 out(dtype, {kBatch, heads, sq, kDv});
    out.fill_nan();
    std::vector<float> lse = nan_floats(kBatch * heads * sq);
    Options o = options();
    o.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {kBatch, heads, 1});
    o.num_threads = threads;
    Outputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, heads, sq});
    const Status s = attention_cte(q.view(), k.view(), v.view(), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < sq; ++i) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(b, h, i, x));
          r.lse.push_back(lse[static_cast<size_t>((b * heads + h) * sq + i)]);
        }
      }
    }
    return r;
  }

  // Entry by entry, the oracle on the rank-3 call with the same options.
  ::testing::AssertionResult exact(const Outcome& r) const {
    Oracle g;
    for (int64_t b = 0; b < kBatch; ++b) {
      Options o = options();
      o.sink = TensorView::contiguous(sink.data() + b * heads, DType::kFloat32, {heads, 1});
      add_oracle(entry(q.view(), b), entry(k.view(), b), entry(v.view(), b), o, &g);
    }
    return matches(r, g, dtype);
  }
};

TEST(ThreadsServing, AttentionCteRank4Batches) {
  const std::vector<BatchSetup> cases = {
      // Many items: 2 GQA groups x 5 query blocks of 16 rows per entry (30 in all), causal.
      BatchSetup(DType::kBFloat16, kHeads, kKvHeads, 70, 90, true, TileConfig{16, 32, 0, 0}),
      // Few items over a long KV axis: each entry's 2 items split in two (12 in all), then
      // merged.
      BatchSetup(DType::kFloat32, 4, 2, 12, 2100, false, TileConfig{}),
  };
  for (const BatchSetup& s : cases) {
    SCOPED_TRACE(std::string(dtype_name(s.dtype)) + ", Sq " + std::to_string(s.sq) + ", Skv " +
                 std::to_string(s.skv));
    expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                            [&](const Outcome& r) { return s.exact(r); });
  }
}
}  // namespace
}  // namespace flashcte::test
