// flash_attn_with_kvcache over 8-bit caches, the machinery of kv8_kvcache_test.cc and
// kv8_refusals_test.cc: dense 8-bit caches with their scales, one step's queries and new tokens,
// the call, and the same caches as shuffled pages.
#ifndef FLASHCTE_TESTS_KV8_CASES_H_
#define FLASHCTE_TESTS_KV8_CASES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/kvcache.h"
#include "src/core/kv8.h"
#include "tests/kv8_formats.h"
#include "tests/test_util.h"

namespace flashcte::test {

inline constexpr int64_t kBatch = 2, kHeads = 4, kCacheKvHeads = 2, kCacheLen = 48, kCd = 24;

struct Cache8 {
  DType format;
  Granularity granularity;
  std::vector<uint8_t> codes;  // (batch, cache_len, kv_heads, d)
  std::vector<float> scale;    // (1,), (kv_heads,) or (batch, cache_len, kv_heads)

  Cache8(DType f, Granularity g, uint32_t seed) : format(f), granularity(g) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.005, 0.02);
    const int64_t n = g == kPerTensor ? 1
                      : g == kPerHead ? kCacheKvHeads
                                      : kBatch * kCacheLen * kCacheKvHeads;
    for (int64_t i = 0; i < n; ++i) scale.push_back(static_cast<float>(u(rng)));
    std::normal_distribution<double> normal(0.0, format == DType::kInt8 ? 50.0 : 150.0);
    codes.resize(static_cast<size_t>(kBatch * kCacheLen * kCacheKvHeads * kCd));
    for (uint8_t& code : codes) code = kv8::encode(format, normal(rng));
  }
  float slot_scale(int64_t b, int64_t j, int64_t h) const {
    if (granularity == kPerToken) {
      return scale[static_cast<size_t>((b * kCacheLen + j) * kCacheKvHeads + h)];
    }
    return scale[granularity == kPerHead ? h : 0];
  }
  double value(int64_t b, int64_t j, int64_t h, int64_t x) const {
    return double{kv8::decode(
               format,
               codes[static_cast<size_t>(((b * kCacheLen + j) * kCacheKvHeads + h) * kCd + x)])} *
           slot_scale(b, j, h);
  }
  MutableTensorView view() {
    return MutableTensorView::contiguous(codes.data(), format,
                                         {kBatch, kCacheLen, kCacheKvHeads, kCd});
  }
  MutableTensorView scale_view() {
    if (granularity == kPerToken) {
      return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                           {kBatch, kCacheLen, kCacheKvHeads});
    }
    return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                         {static_cast<int64_t>(scale.size())});
  }
};

// q (batch, seqlen_q, heads, d) and new k, v (batch, seqlen_q, kv_heads, d), float32.
struct Step {
  int64_t seqlen;
  Tensor4 q, k, v;
  std::vector<int32_t> seqlens = {9, 17};
  Step(int64_t s, uint32_t seed)
      : seqlen(s),
        q(DType::kFloat32, {kBatch, s, kHeads, kCd}),
        k(DType::kFloat32, {kBatch, s, kCacheKvHeads, kCd}),
        v(DType::kFloat32, {kBatch, s, kCacheKvHeads, kCd}) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (Tensor4* t : {&q, &k, &v}) {
      const TensorView w = t->view();
      for (int64_t a = 0; a < w.shape[0]; ++a) {
        for (int64_t b = 0; b < w.shape[1]; ++b) {
          for (int64_t c = 0; c < w.shape[2]; ++c) {
            for (int64_t x = 0; x < w.shape[3]; ++x) t->set(a, b, c, x, u(rng));
          }
        }
      }
    }
  }
};

inline Status attend(Step& step, Cache8& kc, Cache8& vc, Tensor4& out, bool append) {
  KvCacheOptions o;
  if (append) {
    o.k = step.k.view();
    o.v = step.v.view();
  }
  o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
  o.k_scale = kc.scale_view();
  o.v_scale = vc.scale_view();
  o.causal = true;
  return flash_attn_with_kvcache(step.q.view(), kc.view(), vc.view(), out.mutable_view(), {}, o);
}

// A dense Cache8 as pages (num_blocks, kPageSlots, kv_heads, d) in shuffled order, the per-token
// scales in pages (num_blocks, kPageSlots, kv_heads); and back, to compare with the dense cache.
inline constexpr int64_t kPageSlots = 5, kSeqPages = (kCacheLen + kPageSlots - 1) / kPageSlots;

struct Paged8 {
  Cache8& dense;
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> table;

  explicit Paged8(Cache8& c) : dense(c) {
    table.resize(static_cast<size_t>(kBatch * kSeqPages));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(17));
    codes.resize(static_cast<size_t>(kBatch * kSeqPages * kPageSlots * kCacheKvHeads * kCd));
    scale.resize(static_cast<size_t>(kBatch * kSeqPages * kPageSlots * kCacheKvHeads));
    copy(true);
  }
  // Each slot's codes (and per-token scale) between the dense cache and its page row.
  void copy(bool to_pages) {
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t j = 0; j < kCacheLen; ++j) {
        const int64_t row =
            table[static_cast<size_t>(b * kSeqPages + j / kPageSlots)] * kPageSlots +
            j % kPageSlots;
        for (int64_t h = 0; h < kCacheKvHeads; ++h) {
          uint8_t* page = &codes[static_cast<size_t>((row * kCacheKvHeads + h) * kCd)];
          uint8_t* slot =
              &dense.codes[static_cast<size_t>(((b * kCacheLen + j) * kCacheKvHeads + h) * kCd)];
          std::memcpy(to_pages ? page : slot, to_pages ? slot : page, kCd);
          if (dense.granularity != kPerToken) continue;
          float& ps = scale[static_cast<size_t>(row * kCacheKvHeads + h)];
          float& ds = dense.scale[static_cast<size_t>((b * kCacheLen + j) * kCacheKvHeads + h)];
          (to_pages ? ps : ds) = to_pages ? ds : ps;
        }
      }
    }
  }
  MutableTensorView view() {
    return MutableTensorView::contiguous(codes.data(), dense.format,
                                         {kBatch * kSeqPages, kPageSlots, kCacheKvHeads, kCd});
  }
  MutableTensorView scale_view() {
    if (dense.granularity != kPerToken) return dense.scale_view();
    return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                         {kBatch * kSeqPages, kPageSlots, kCacheKvHeads});
  }
};

inline Status attend_paged(Step& step, Paged8& kc, Paged8& vc, Tensor4& out) {
  KvCacheOptions o;
  o.k = step.k.view();
  o.v = step.v.view();
  o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
  o.block_table = TensorView::contiguous(kc.table.data(), DType::kInt32, {kBatch, kSeqPages});
  o.k_scale = kc.scale_view();
  o.v_scale = vc.scale_view();
  o.causal = true;
  return flash_attn_with_kvcache(step.q.view(), kc.view(), vc.view(), out.mutable_view(), {}, o);
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_KV8_CASES_H_
