// Serving paths on several threads (issue 41; the design in threads_serving_test.cc's file
// comment): merge_attn_states (the states of a split KV axis, and from concurrent callers) and
// the attention layer (prefill, a second chunk over the cached prefix, decode steps; dense and
// paged caches; its oracle flashcte_layer_reference), each on 1 thread against the float64
// oracle, then bitwise that run on 3 threads and on OpenMP's default.
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

// ---- merge_attn_states -------------------------------------------------------------------------

// Attention over a KV axis cut in two (600 and 700 keys), each half by attention_cte on the
// threads, the halves merged: the result is the attention over all 1300 keys.
struct MergeSetup {
  static constexpr int64_t kSq = 33, kKeysA = 600, kKeysB = 700;
  HostTensor q, ka, va, kb, vb;
  MergeSetup()
      : q(DType::kFloat32, {kHeads, kSq, kD}),
        ka(DType::kFloat32, {kKvHeads, kKeysA, kD}),
        va(DType::kFloat32, {kKvHeads, kKeysA, kDv}),
        kb(DType::kFloat32, {kKvHeads, kKeysB, kD}),
        vb(DType::kFloat32, {kKvHeads, kKeysB, kDv}) {
    std::mt19937_64 rng(37);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (HostTensor* t : {&q, &ka, &va, &kb, &vb}) {
      for (int64_t a = 0; a < t->shape()[0]; ++a) {
        for (int64_t b = 0; b < t->shape()[1]; ++b) {
          for (int64_t c = 0; c < t->shape()[2]; ++c) t->set(a, b, c, u(rng));
        }
      }
    }
  }
  // The two halves' states, on `threads` threads.
  struct Halves {
    HostTensor out_a{DType::kFloat32, {kHeads, kSq, kDv}},
        out_b{DType::kFloat32, {kHeads, kSq, kDv}};
    std::vector<float> lse_a = nan_floats(kHeads * kSq), lse_b = nan_floats(kHeads * kSq);
  };
  Halves halves(int threads) const {
    Halves h;
    Options o;
    o.tp_k = true;
    o.causal_mask = false;
    o.scale = kScale;
    o.tiles = TileConfig{16, 64, 0, 0};  // 2 GQA groups x 3 query blocks: 6 items per call
    o.num_threads = threads;
    Outputs outputs;
    outputs.out = h.out_a.mutable_view();
    outputs.lse = MutableTensorView::contiguous(h.lse_a.data(), DType::kFloat32, {kHeads, kSq});
    Status s = attention_cte(q.view(), ka.view(), va.view(), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    outputs.out = h.out_b.mutable_view();
    outputs.lse = MutableTensorView::contiguous(h.lse_b.data(), DType::kFloat32, {kHeads, kSq});
    s = attention_cte(q.view(), kb.view(), vb.view(), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    return h;
  }
  static TensorView lse_view(const std::vector<float>& lse) {
    return TensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, kSq});
  }

  Outcome run(int threads) const {
    Halves h = halves(threads);  // not const: the lists below then hold one pointer type
    HostTensor out(DType::kFloat32, {kHeads, kSq, kDv});
    std::vector<float> lse = nan_floats(kHeads * kSq);
    const Status s = merge_attn_states(
        h.out_a.view(), lse_view(h.lse_a), h.out_b.view(), lse_view(h.lse_b), out.mutable_view(),
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, kSq}));
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    for (const HostTensor* t : {&h.out_a, &h.out_b, &out}) {
      r.bytes.insert(r.bytes.end(), t->bytes().begin(), t->bytes().end());
    }
    for (const std::vector<float>* l : {&h.lse_a, &h.lse_b, &lse}) {
      append_bytes(&r.bytes, l->data(), l->size() * sizeof(float));
    }
    for (int64_t hh = 0; hh < kHeads; ++hh) {
      for (int64_t i = 0; i < kSq; ++i) {
        for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(hh, i, x));
        r.lse.push_back(lse[static_cast<size_t>(hh * kSq + i)]);
      }
    }
    return r;
  }

  ::testing::AssertionResult exact(const Outcome& r) const {
    Problem p(kHeads, kKvHeads, kSq, kKeysA + kKeysB, kD, kDv);
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kSq; ++i) {
        for (int64_t x = 0; x < kD; ++x) p.qa(h, i, x) = q.get(h, i, x);
      }
    }
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < p.keys; ++j) {
        const bool a = j < kKeysA;
        const int64_t jj = a ? j : j - kKeysA;
        for (int64_t x = 0; x < kD; ++x) p.ka(h, j, x) = a ? ka.get(h, jj, x) : kb.get(h, jj, x);
        for (int64_t x = 0; x < kDv; ++x) p.va(h, j, x) = a ? va.get(h, jj, x) : vb.get(h, jj, x);
      }
    }
    Oracle g;
    add_oracle(p, DType::kFloat32, &g);
    return matches(r, g, DType::kFloat32);
  }
};

TEST(ThreadsServing, MergeStatesOfSplitKv) {
  const MergeSetup s;
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

// merge_attn_states from 3 std::threads at once over the same two states: rank 3, the rank-4
// (1, heads, rows, dv) view and in place into a private copy of side a, each 20 times; every
// result bitwise the serial merge.
TEST(ThreadsServing, MergeFromConcurrentCallers) {
  using S = MergeSetup;
  const S s;
  const S::Halves h = s.halves(1);
  const int64_t rows = kHeads * S::kSq;
  // The serial merge, out then lse.
  std::vector<float> want(static_cast<size_t>(rows * (kDv + 1)));
  ASSERT_TRUE(
      merge_attn_states(
          h.out_a.view(), S::lse_view(h.lse_a), h.out_b.view(), S::lse_view(h.lse_b),
          MutableTensorView::contiguous(want.data(), DType::kFloat32, {kHeads, S::kSq, kDv}),
          MutableTensorView::contiguous(want.data() + rows * kDv, DType::kFloat32,
                                        {kHeads, S::kSq}))
          .ok);
  // A rank-3 view as the rank-4 (1, ...) one, and a rank-2 lse as rank 3.
  const auto batch_of_one = [](auto v) {
    for (int i = v.rank; i > 0; --i) {
      v.shape[i] = v.shape[i - 1];
      v.strides[i] = v.strides[i - 1];
    }
    v.shape[0] = 1;
    v.strides[0] = v.shape[1] * v.strides[1];
    ++v.rank;
    return v;
  };
  std::atomic<int> mismatches{0}, failures{0};
  const auto worker = [&](int kind) {
    for (int round = 0; round < 20; ++round) {
      std::vector<float> got(want.size());
      TensorView oa = h.out_a.view(), la = S::lse_view(h.lse_a);
      TensorView ob = h.out_b.view(), lb = S::lse_view(h.lse_b);
      MutableTensorView o =
          MutableTensorView::contiguous(got.data(), DType::kFloat32, {kHeads, S::kSq, kDv});
      MutableTensorView l =
          MutableTensorView::contiguous(got.data() + rows * kDv, DType::kFloat32, {kHeads, S::kSq});
      if (kind == 1) {  // rank 4
        oa = batch_of_one(oa);
        ob = batch_of_one(ob);
        o = batch_of_one(o);
        la = batch_of_one(la);
        lb = batch_of_one(lb);
        l = batch_of_one(l);
      } else if (kind == 2) {  // in place into a private copy of side a
        std::memcpy(got.data(), h.out_a.bytes().data(), static_cast<size_t>(rows * kDv) * 4);
        std::memcpy(got.data() + rows * kDv, h.lse_a.data(), static_cast<size_t>(rows) * 4);
        oa = TensorView::contiguous(got.data(), DType::kFloat32, {kHeads, S::kSq, kDv});
        la = TensorView::contiguous(got.data() + rows * kDv, DType::kFloat32, {kHeads, S::kSq});
      }
      if (!merge_attn_states(oa, la, ob, lb, o, l).ok) {
        failures.fetch_add(1);
        continue;
      }
      if (std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) != 0) {
        mismatches.fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(3);
  for (int kind = 0; kind < 3; ++kind) threads.emplace_back(worker, kind);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0) << "merges that differ from the serial one";
}

// ---- the attention layer -----------------------------------------------------------------------

// The layer of tests/layer/attention_layer_test.cc with everything on (GQA 4/2, partial rotary
// with Llama-3 scaling, a window, sinks, biases, q/k norm) over 3 sequences: a 32-token prefill
// (attention_cte), a 20-token chunk over the cached 32 (attention_cte with the cache as the
// prior, paged or dense), then 3 decode steps (decode_attention). The projections are OpenBLAS
// GEMMs below OpenBLAS's own threading threshold (0.3.21 splits an sgemm from m n k = 4 x 65536;
// the largest here, the prefill's QKV projection, is 96 x 64 x 32 = 196,608), so they run on the
// calling thread whatever num_threads says: the thread counts are the attention kernels'.
struct LayerSetup {
  // kHidden: everything_on's hidden size.
  static constexpr int64_t kBatch = 3, kHidden = 32, kMaxLen = 64;
  LayerConfig config;
  LayerWeights weights;
  int64_t block;
  std::unique_ptr<AttentionLayer> layer;
  std::vector<std::pair<int64_t, int64_t>> steps = {{0, 32}, {32, 20}, {52, 1}, {53, 1}, {54, 1}};
  std::vector<std::vector<float>> xs;  // each step's input, (batch, T, hidden)

  LayerSetup(DType dtype, int64_t block_) : block(block_) {
    config = reference::test::everything_on(dtype);
    std::mt19937 rng(41);
    weights = reference::test::random_weights(config, &rng);
    const Status s = AttentionLayer::create(config, weights, &layer);
    EXPECT_TRUE(s.ok) << s.message;
    for (const auto& step : steps) {
      xs.push_back(reference::test::random_vector(&rng, kBatch * step.second * kHidden, 1.0f));
    }
  }
  std::vector<int64_t> positions(size_t step) const {
    std::vector<int64_t> p;
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t t = 0; t < steps[step].second; ++t) p.push_back(steps[step].first + t);
    }
    return p;
  }

  Outcome run(int threads) const {
    KvCache cache;
    if (block == 0) {
      EXPECT_TRUE(layer->new_cache(kBatch, kMaxLen, &cache).ok);
    } else {
      const int64_t pages = kMaxLen / block;
      std::vector<int32_t> order(static_cast<size_t>(kBatch * pages + 2));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(3));
      EXPECT_TRUE(layer->new_paged_cache(kBatch, kBatch * pages + 2, block, &cache).ok);
      for (int64_t b = 0; b < kBatch; ++b) {
        const std::vector<int32_t> own(order.begin() + b * pages, order.begin() + (b + 1) * pages);
        EXPECT_TRUE(cache.assign(b, own, 0).ok);
      }
    }
    Outcome r;
    const DType t = config.dtype;
    for (size_t step = 0; step < steps.size(); ++step) {
      const int64_t tokens = steps[step].second, n = kBatch * tokens * kHidden;
      std::vector<float> out_f(t == DType::kFloat32 ? n : 0);
      std::vector<uint16_t> out_h(t == DType::kFloat32 ? 0 : n);
      void* data = t == DType::kFloat32 ? static_cast<void*>(out_f.data()) : out_h.data();
      const std::vector<int64_t> pos = positions(step);
      const Status s = layer->forward(
          TensorView::contiguous(xs[step].data(), DType::kFloat32, {kBatch, tokens, kHidden}),
          TensorView::contiguous(pos.data(), DType::kInt64, {kBatch, tokens}), &cache,
          MutableTensorView::contiguous(data, t, {kBatch, tokens, kHidden}), threads);
      EXPECT_TRUE(s.ok) << "step " << step << ": " << s.message;
      append_bytes(&r.bytes, data, static_cast<size_t>(n * dtype_size(t)));
      for (int64_t i = 0; i < n; ++i) {
        r.out.push_back(t == DType::kFloat32    ? out_f[i]
                        : t == DType::kBFloat16 ? half::bf16_to_float(out_h[i])
                                                : half::f16_to_float(out_h[i]));
      }
    }
    // The cache's K and V storage after the last step.
    const int64_t rows = cache.paged() ? cache.num_blocks() : cache.batch();
    const int64_t slots = cache.paged() ? cache.block_size() : cache.max_len();
    const auto n = static_cast<size_t>(rows * cache.kv_heads() * slots * cache.head_dim() *
                                       dtype_size(cache.dtype()));
    append_bytes(&r.bytes, cache.k_data(), n);
    append_bytes(&r.bytes, cache.v_data(), n);
    return r;
  }

  // Step by step against the layer's float64 oracle, with attention_layer_test.cc's bound: 12
  // units of the dtype (in float32, 1e-5 x the fan-in) of the step's largest output.
  ::testing::AssertionResult exact(const Outcome& r) const {
    reference::LayerCache cache = reference::test::new_cache(config, kBatch, kMaxLen);
    size_t at = 0;
    for (size_t step = 0; step < steps.size(); ++step) {
      const int64_t tokens = steps[step].second;
      const std::vector<int64_t> pos = positions(step);
      std::vector<double> want;
      const Status s = reference::layer_forward(
          config, weights,
          TensorView::contiguous(xs[step].data(), DType::kFloat32, {kBatch, tokens, kHidden}),
          TensorView::contiguous(pos.data(), DType::kInt64, {kBatch, tokens}), &cache, &want);
      if (!s.ok) return ::testing::AssertionFailure() << "oracle: " << s.message;
      const double unit =
          config.dtype == DType::kFloat32 ? 1e-5 * kHidden : unit_roundoff(config.dtype);
      const double bound = 12 * unit * std::max(largest(want), 1e-3);
      for (size_t i = 0; i < want.size(); ++i, ++at) {
        if (at >= r.out.size() || !(abs_error(r.out[at], want[i]) <= bound)) {
          return ::testing::AssertionFailure() << "step " << step << ", output " << i << ": "
                                               << (at < r.out.size() ? r.out[at] : NAN) << ", want "
                                               << want[i] << " within " << bound;
        }
      }
    }
    if (at != r.out.size()) {
      return ::testing::AssertionFailure() << "more outputs than the oracle's";
    }
    return ::testing::AssertionSuccess();
  }
};

TEST(ThreadsServing, LayerPrefillChunkDecodeDenseAndPaged) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t block : {0, 16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (block ? ", pages of 16" : ", dense"));
      const LayerSetup s(dtype, block);
      ASSERT_TRUE(s.layer != nullptr);
      expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                              [&](const Outcome& r) { return s.exact(r); });
    }
  }
}

}  // namespace
}  // namespace flashcte::test
