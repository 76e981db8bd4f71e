// Every parallel serving path on several threads (issue 41): decode_attention over dense, paged
// and 8-bit caches, flash_attn_with_kvcache (append, then attend; dense, paged, 8-bit),
// flash_attn_varlen_kvcache on a mixed batch (prefill chunks and decodes in one region),
// attention_cte on rank-4 batches, merge_attn_states, and the attention layer (prefill, a second
// chunk over the cached prefix, decode steps). Each path runs once on 1 thread, checked against
// the float64 oracle (src/reference), then on 3 threads and on OpenMP's default, and every byte it
// wrote (outputs, lse, and the caches where it appends) must equal the 1-thread run's: the
// entry points promise results bitwise identical for any thread count.
//
// The shapes are small enough for ThreadSanitizer (these tests carry the CTest label `threads`;
// scripts/ci_sanitizers.sh runs them under TSan with Archer) but give 3 threads work to share:
// GQA 8/2 heads over 3 to 6 sequences, decode contexts past the kernel's 1024-slot chunk (chunks
// on different threads, then merged) and prefill chunks over 2100 cached keys (the KV axis split,
// then merged).
//
// Here decode_attention and flash_attn_with_kvcache; flash_attn_varlen_kvcache and rank-4
// batches in threads_serving_varlen_test.cc; merges and the layer in
// threads_serving_layer_test.cc; the machinery in threads_serving_cases.h.
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

// ---- decode_attention --------------------------------------------------------------------------

// 3 sequences, T = 2 new tokens each, at the end of 1300 slots (2 chunks of 1024), in the middle
// (1) and at the start: 4 (sequence, chunk) pairs per KV head, 8 items for the threads, and two
// chunk merges.
struct DecodeSetup {
  static constexpr int64_t kBatch = 3, kTokens = 2;
  DType dtype;
  Formats formats;
  int64_t window;
  std::vector<int64_t> last = {1299, 700, 5};
  CacheShape shape;
  Tensor4 q;
  Cache k, v;
  std::vector<int64_t> positions;
  std::vector<float> sink;

  DecodeSetup(DType dtype_, Formats f, int64_t block, int64_t window_)
      : dtype(dtype_),
        formats(f),
        window(window_),
        shape(kBatch, 1300, block, /*heads_outer=*/true, 3),
        q(dtype_, {kBatch, kHeads, kTokens, kD}),
        k(shape, f.k, kD, f.k_scales),
        v(shape, f.v, kDv, f.v_scales) {
    std::mt19937_64 rng(17);
    fill(&q, &rng);
    std::vector<int64_t> filled;
    for (int64_t l : last) filled.push_back(l + 1);
    k.fill(filled, &rng);
    v.fill(filled, &rng);
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t t = 0; t < kTokens; ++t) positions.push_back(last[b] - (kTokens - 1) + t);
    }
    sink = sinks(&rng);
  }

  Outcome run(int threads) const {
    Tensor4 out(dtype, {kBatch, kHeads, kTokens, kDv});
    out.fill_nan();
    std::vector<float> lse = nan_floats(kBatch * kHeads * kTokens);
    DecodeOptions o;
    o.scale = kScale;
    o.sliding_window = window;
    o.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {kHeads});
    o.block_table = shape.table_view();
    o.k_scale = k.scale_view();
    o.v_scale = v.scale_view();
    o.num_threads = threads;
    DecodeOutputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse =
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, kTokens});
    const Status s = decode_attention(
        q.view(), k.view(), v.view(),
        TensorView::contiguous(positions.data(), DType::kInt64, {kBatch, kTokens}), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t t = 0; t < kTokens; ++t) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(b, h, t, x));
          r.lse.push_back(lse[static_cast<size_t>((b * kHeads + h) * kTokens + t)]);
        }
      }
    }
    return r;
  }

  // Sequence b: its query heads over slots [0, last + 1), token t seeing the slots up to its
  // position (and within the window).
  ::testing::AssertionResult exact(const Outcome& r) const {
    Oracle g;
    for (int64_t b = 0; b < kBatch; ++b) {
      Problem p(kHeads, kKvHeads, kTokens, last[b] + 1, kD, kDv);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t t = 0; t < kTokens; ++t) {
          for (int64_t x = 0; x < kD; ++x) p.qa(h, t, x) = q.get(b, h, t, x);
        }
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < p.keys; ++j) {
          for (int64_t x = 0; x < kD; ++x) p.ka(h, j, x) = k.get(b, h, j, x);
          for (int64_t x = 0; x < kDv; ++x) p.va(h, j, x) = v.get(b, h, j, x);
        }
      }
      for (int64_t t = 0; t < kTokens; ++t) {
        const int64_t pos = positions[static_cast<size_t>(b * kTokens + t)];
        p.lo[t] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        p.hi[t] = pos + 1;
      }
      p.sink = sink;
      add_oracle(p, oracle_dtype(dtype, formats), &g);
    }
    return matches(r, g, dtype);
  }
};

void expect_decode(const DecodeSetup& s) {
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

TEST(ThreadsServing, DecodeDenseGqaAcrossChunks) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const int64_t window = dtype == DType::kFloat32 ? 0 : 1100;  // 1100: still 2 chunks
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", window " + std::to_string(window));
    expect_decode(DecodeSetup(dtype, float_caches(dtype), 0, window));
  }
}

TEST(ThreadsServing, DecodePagedBlockTable) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    // Pages of 16 slots, and of 5 (a window edge and the chunk edge inside pages).
    const int64_t block = dtype == DType::kFloat32 ? 16 : 5;
    const int64_t window = dtype == DType::kFloat32 ? 0 : 1100;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", pages of " + std::to_string(block));
    expect_decode(DecodeSetup(dtype, float_caches(dtype), block, window));
  }
}

TEST(ThreadsServing, DecodeInt8AndFp8Caches) {
  const Formats int8_k{DType::kInt8, DType::kFloat8E4M3, Scales::kToken, Scales::kHead};
  const Formats fp8_k{DType::kFloat8E5M2, DType::kInt8, Scales::kTensor, Scales::kToken};
  {
    SCOPED_TRACE("k int8 per token, v e4m3 per KV head, dense");
    expect_decode(DecodeSetup(DType::kFloat32, int8_k, 0, 0));
  }
  {
    SCOPED_TRACE("k e5m2 per tensor, v int8 per token, pages of 16");
    expect_decode(DecodeSetup(DType::kFloat32, fp8_k, 16, 0));
  }
}

// ---- flash_attn_with_kvcache -------------------------------------------------------------------

// The largest difference between an appended value and its 8-bit code x scale: half an int8
// quantum (scales here <= 1.1 / (0.9 x 127) < 0.01), or half an fp8 ulp (3 and 2 mantissa bits)
// plus half the smallest subnormal step (scales < 0.003); exact in a float cache.
double quantization_bound(DType format, double x) {
  switch (format) {
    case DType::kInt8:
      return 0.005;
    case DType::kFloat8E4M3:
      return std::fabs(x) / 16 + 1e-5;
    case DType::kFloat8E5M2:
      return std::fabs(x) / 8 + 1e-5;
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  return 0;
}

// 3 sequences with 2100, 500 and 3 cached tokens in FlashAttention's (batch, slots, kv_heads, d)
// (dense or paged), `tokens` new ones appended and attended, causal, with sinks. T = 2 runs on the
// decode kernel (the first sequence in 3 chunks), T = 20 on the prefill kernel with the cache as
// the prior (the first sequence's 2120 keys split in two, then merged).
struct KvCacheSetup {
  static constexpr int64_t kBatch = 3;
  DType dtype;
  Formats formats;
  int64_t tokens;
  std::vector<int32_t> seqlens = {2100, 500, 3};
  CacheShape shape;
  Tensor4 q, k_new, v_new;
  Cache k, v;
  std::vector<float> sink;

  KvCacheSetup(DType dtype_, Formats f, int64_t block, int64_t tokens_)
      : dtype(dtype_),
        formats(f),
        tokens(tokens_),
        shape(kBatch, 2100 + tokens_, block, /*heads_outer=*/false, 5),
        q(dtype_, {kBatch, tokens_, kHeads, kD}),
        k_new(dtype_, {kBatch, tokens_, kKvHeads, kD}),
        v_new(dtype_, {kBatch, tokens_, kKvHeads, kDv}),
        k(shape, f.k, kD, f.k_scales),
        v(shape, f.v, kDv, f.v_scales) {
    std::mt19937_64 rng(23);
    fill(&q, &rng);
    fill(&k_new, &rng);
    fill(&v_new, &rng);
    k.fill(seqlens, &rng);
    v.fill(seqlens, &rng);
    sink = sinks(&rng);
  }

  Outcome run(int threads) const {
    Cache kc = k, vc = v;  // the call appends into them
    Tensor4 out(dtype, {kBatch, tokens, kHeads, kDv});
    out.fill_nan();
    std::vector<float> lse = nan_floats(kBatch * kHeads * tokens);
    KvCacheOptions o;
    o.k = k_new.view();
    o.v = v_new.view();
    o.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {kBatch});
    o.block_table = shape.table_view();
    o.k_scale = kc.mutable_scale_view();
    o.v_scale = vc.mutable_scale_view();
    o.sinks = TensorView::contiguous(sink.data(), DType::kFloat32, {kHeads});
    o.causal = true;
    o.num_threads = threads;
    const Status s = flash_attn_with_kvcache(
        q.view(), kc.mutable_view(), vc.mutable_view(), out.mutable_view(),
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, tokens}), o);
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (const Cache* c : {&kc, &vc}) {
      const std::vector<uint8_t> b = c->bytes();
      r.bytes.insert(r.bytes.end(), b.begin(), b.end());
    }
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < tokens; ++i) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(b, i, h, x));
          r.lse.push_back(lse[static_cast<size_t>((b * kHeads + h) * tokens + i)]);
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          const int64_t j = seqlens[b] + t;
          for (int64_t x = 0; x < kD; ++x) r.appended_k.push_back(kc.get(b, h, j, x));
          for (int64_t x = 0; x < kDv; ++x) r.appended_v.push_back(vc.get(b, h, j, x));
        }
      }
    }
    return r;
  }

  // The appended rows hold the new tokens (exactly, or within the quantization), then each
  // sequence's query heads over its cache: the slots as they were and the appended rows as
  // written, row i seeing slots [0, seqlen + i] (bottom-right causal).
  ::testing::AssertionResult exact(const Outcome& r) const {
    size_t ak = 0, av = 0;
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t x = 0; x < kD; ++x, ++ak) {
            const double want = k_new.get(b, t, h, x);
            if (!(std::fabs(r.appended_k[ak] - want) <= quantization_bound(formats.k, want))) {
              return ::testing::AssertionFailure()
                     << "appended k of sequence " << b << ", token " << t << ", head " << h
                     << ", channel " << x << ": " << r.appended_k[ak] << ", want " << want;
            }
          }
          for (int64_t x = 0; x < kDv; ++x, ++av) {
            const double want = v_new.get(b, t, h, x);
            if (!(std::fabs(r.appended_v[av] - want) <= quantization_bound(formats.v, want))) {
              return ::testing::AssertionFailure()
                     << "appended v of sequence " << b << ", token " << t << ", head " << h
                     << ", channel " << x << ": " << r.appended_v[av] << ", want " << want;
            }
          }
        }
      }
    }
    Oracle g;
    for (int64_t b = 0; b < kBatch; ++b) {
      const int64_t cached = seqlens[b];
      Problem p(kHeads, kKvHeads, tokens, cached + tokens, kD, kDv);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < tokens; ++i) {
          for (int64_t x = 0; x < kD; ++x) p.qa(h, i, x) = q.get(b, i, h, x);
        }
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < p.keys; ++j) {
          const auto row = static_cast<size_t>((b * tokens + j - cached) * kKvHeads + h);
          for (int64_t x = 0; x < kD; ++x) {
            p.ka(h, j, x) = j < cached ? k.get(b, h, j, x) : r.appended_k[row * kD + x];
          }
          for (int64_t x = 0; x < kDv; ++x) {
            p.va(h, j, x) = j < cached ? v.get(b, h, j, x) : r.appended_v[row * kDv + x];
          }
        }
      }
      for (int64_t i = 0; i < tokens; ++i) p.hi[i] = cached + i + 1;
      p.sink = sink;
      add_oracle(p, oracle_dtype(dtype, formats), &g);
    }
    return matches(r, g, dtype);
  }
};

void expect_kvcache(const KvCacheSetup& s) {
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

TEST(ThreadsServing, KvCacheAppendDense) {
  for (int64_t tokens : {2, 20}) {
    const DType dtype = tokens == 2 ? DType::kBFloat16 : DType::kFloat32;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(tokens) + " new tokens");
    expect_kvcache(KvCacheSetup(dtype, float_caches(dtype), 0, tokens));
  }
}

TEST(ThreadsServing, KvCacheAppendPaged) {
  for (int64_t tokens : {2, 20}) {
    const DType dtype = tokens == 2 ? DType::kFloat16 : DType::kFloat32;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(tokens) + " new tokens");
    expect_kvcache(KvCacheSetup(dtype, float_caches(dtype), 16, tokens));
  }
}

TEST(ThreadsServing, KvCacheAppendInt8AndFp8) {
  {
    SCOPED_TRACE("k int8 per token (written by the append), v e4m3 per KV head, pages of 16, T 2");
    const Formats f{DType::kInt8, DType::kFloat8E4M3, Scales::kToken, Scales::kHead};
    expect_kvcache(KvCacheSetup(DType::kFloat32, f, 16, 2));
  }
  {
    SCOPED_TRACE("k e5m2 per tensor, v int8 per token, dense, T 20");
    const Formats f{DType::kFloat8E5M2, DType::kInt8, Scales::kTensor, Scales::kToken};
    expect_kvcache(KvCacheSetup(DType::kFloat32, f, 0, 20));
  }
}

}  // namespace
}  // namespace flashcte::test
