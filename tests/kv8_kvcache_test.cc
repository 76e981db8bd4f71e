// flash_attn_with_kvcache and flash_attn_varlen_kvcache over 8-bit caches: the append quantizes
// the new tokens (quantize_kv's codes and scales) and the queries attend the dequantized cache
// (code x scale) within the float64 reference's tolerance, on the decode kernel and on
// attention_cte; refused calls leave the caches and scales alone; e4m3 saturates and e5m2 keeps
// an Inf that reaches only the rows that see it; non-finite queries stay in their rows; the
// varlen call is bitwise the per-sequence calls. The machinery: kv8_cases.h; refusals on paged
// caches: kv8_refusals_test.cc; an 8-bit prior: kv8_prefill_test.cc.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/kvcache.h"
#include "src/core/kv8.h"
#include "src/reference/reference.h"
#include "tests/kv8_cases.h"
#include "tests/kv8_formats.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// The append writes quantize_kv's codes and per-token scales; the attention over the cache then
// matches the reference on its dequantized values, on the decode kernel (3 new tokens) and on
// attention_cte (20 > kDecodeMaxQueries).
TEST(KvCacheKv8, AppendQuantizesAndTheQueriesAttendTheDequantizedCache) {
  for (int64_t seqlen : {3, 20}) {
    for (int f = 0; f < 3; ++f) {
      for (int g = 0; g < 3; ++g) {
        Step step(seqlen, 31);
        Cache8 kc(kFormats[f], static_cast<Granularity>(g), 41);
        Cache8 vc(kFormats[(f + 2) % 3], static_cast<Granularity>((g + 2) % 3), 42);
        SCOPED_TRACE("seqlen_new " + std::to_string(seqlen) + ", k " + dtype_name(kc.format) +
                     ", v " + dtype_name(vc.format) + ", granularities " + std::to_string(g));
        // The oracle of the append: quantize_kv on each sequence's new rows, into the slots.
        Cache8 kw = kc, vw = vc;
        for (auto [cache, src] : {std::pair{&kw, &step.k}, std::pair{&vw, &step.v}}) {
          for (int64_t b = 0; b < kBatch; ++b) {
            const int64_t slot = step.seqlens[static_cast<size_t>(b)];
            TensorView rows = src->view();
            rows.rank = 3;
            rows.data = static_cast<const float*>(rows.data) + b * rows.strides[0];
            rows.shape = {seqlen, kCacheKvHeads, kCd, 0};
            rows.strides = {rows.strides[1], rows.strides[2], rows.strides[3], 0};
            MutableTensorView dst = cache->view();
            dst.rank = 3;
            dst.data = static_cast<uint8_t*>(dst.data) + (b * kCacheLen + slot) * dst.strides[1];
            dst.shape = {seqlen, kCacheKvHeads, kCd, 0};
            dst.strides = {dst.strides[1], dst.strides[2], dst.strides[3], 0};
            MutableTensorView scale = cache->scale_view();
            if (cache->granularity == kPerToken) {
              scale.rank = 2;
              scale.data = static_cast<float*>(scale.data) + (b * kCacheLen + slot) * kCacheKvHeads;
              scale.shape = {seqlen, kCacheKvHeads, 0, 0};
              scale.strides = {kCacheKvHeads, 1, 0, 0};
            }
            ASSERT_TRUE(quantize_kv(rows, dst, scale).ok);
          }
        }
        // The same caches in pages (copied before the dense call appends).
        Cache8 kpd = kc, vpd = vc;
        Paged8 kp(kpd), vp(vpd);
        vp.table = kp.table;
        vp.copy(true);
        Tensor4 out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
        const Status s = attend(step, kc, vc, out, true);
        ASSERT_TRUE(s.ok) << s.message;
        EXPECT_EQ(kc.codes, kw.codes);
        EXPECT_EQ(vc.codes, vw.codes);
        EXPECT_EQ(kc.scale, kw.scale);
        EXPECT_EQ(vc.scale, vw.scale);
        // Paged: bitwise the dense call, the same codes and scales written into the pages.
        Tensor4 paged_out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
        const Status ps = attend_paged(step, kp, vp, paged_out);
        ASSERT_TRUE(ps.ok) << ps.message;
        EXPECT_EQ(paged_out.bytes(), out.bytes());
        kp.copy(false);
        vp.copy(false);
        EXPECT_EQ(kpd.codes, kc.codes);
        EXPECT_EQ(vpd.codes, vc.codes);
        EXPECT_EQ(kpd.scale, kc.scale);
        EXPECT_EQ(vpd.scale, vc.scale);
        // The reference per sequence on the dequantized cache, bottom-right causal.
        for (int64_t b = 0; b < kBatch; ++b) {
          const int64_t seqlen_k = step.seqlens[static_cast<size_t>(b)] + seqlen;
          HostTensor q(DType::kFloat32, {kHeads, seqlen, kCd});
          HostTensor k(DType::kFloat32, {kCacheKvHeads, seqlen_k, kCd});
          HostTensor v(DType::kFloat32, {kCacheKvHeads, seqlen_k, kCd});
          for (int64_t h = 0; h < kHeads; ++h) {
            for (int64_t i = 0; i < seqlen; ++i) {
              for (int64_t x = 0; x < kCd; ++x) q.set(h, i, x, step.q.get(b, i, h, x));
            }
          }
          for (int64_t h = 0; h < kCacheKvHeads; ++h) {
            for (int64_t j = 0; j < seqlen_k; ++j) {
              for (int64_t x = 0; x < kCd; ++x) {
                k.set(h, j, x, kc.value(b, j, h, x));
                v.set(h, j, x, vc.value(b, j, h, x));
              }
            }
          }
          Options o;
          o.tp_k = true;
          o.bottom_right = true;
          o.scale = static_cast<float>(1.0 / std::sqrt(double{kCd}));
          reference::Result exact;
          ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &exact).ok);
          for (int64_t h = 0; h < kHeads; ++h) {
            for (int64_t i = 0; i < seqlen; ++i) {
              for (int64_t x = 0; x < kCd; ++x) {
                ASSERT_NEAR(out.get(b, i, h, x), exact.out_at(h, i, x),
                            4e-6 + 1e-5 * std::fabs(exact.out_at(h, i, x)))
                    << b << " " << h << " " << i << " " << x;
              }
            }
          }
        }
      }
    }
  }
}

// A refused call leaves every buffer of the call byte for byte as it was: the caches, their
// scales, q, the new k and v, the lengths, out and lse. A NaN for an int8 cache in sequence 1's
// last new token (found before anything is written: the K rows and sequence 0 would go first), a
// bad scale, scales sharing memory with each other or with a cache, lse over a scale, lengths past
// the cache, a scale beside a float cache.
TEST(KvCacheKv8, RefusedCallsLeaveCachesAndScalesAlone) {
  for (int64_t seqlen : {3, 20}) {
    SCOPED_TRACE("seqlen_new " + std::to_string(seqlen));
    Step step(seqlen, 51);
    Cache8 kc(DType::kFloat8E4M3, kPerToken, 61), vc(DType::kInt8, kPerToken, 62);
    Cache8 vh(DType::kInt8, kPerHead, 63), vs(DType::kInt8, kPerToken, 64);
    Tensor4 float_cache(DType::kFloat32, {kBatch, kCacheLen, kCacheKvHeads, kCd});
    Tensor4 out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
    std::vector<float> lse(static_cast<size_t>(kBatch * kHeads * seqlen));
    const MutableTensorView lse_view =
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, seqlen});
    // The append of step's k and v into k_cache / v_cache with their scales.
    const auto append_into = [&](Cache8& k_cache, Cache8& v_cache) {
      KvCacheOptions o;
      o.k = step.k.view();
      o.v = step.v.view();
      o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
      o.k_scale = k_cache.scale_view();
      o.v_scale = v_cache.scale_view();
      o.causal = true;
      return o;
    };
    const auto refuses = [&](const MutableTensorView& k_cache, const MutableTensorView& v_cache,
                             const KvCacheOptions& o, const MutableTensorView& lse_out,
                             const std::string& argument, const char* what) {
      BufferSnapshot snap;
      snap.add("q", step.q.bytes()).add("k", step.k.bytes()).add("v", step.v.bytes());
      snap.add("cache_seqlens", step.seqlens);
      for (const auto& [name, cache] : {std::pair{"kc", &kc}, std::pair{"vc", &vc},
                                        std::pair{"vh", &vh}, std::pair{"vs", &vs}}) {
        snap.add(std::string(name) + " codes", cache->codes);
        snap.add(std::string(name) + " scales", cache->scale);
      }
      snap.add("float32 cache", float_cache.bytes());
      snap.add_output("out", out.bytes()).add_output("lse", lse);
      EXPECT_TRUE(refused_for(
          flash_attn_with_kvcache(step.q.view(), k_cache, v_cache, out.mutable_view(), lse_out, o),
          argument))
          << what;
      EXPECT_TRUE(snap.unchanged()) << what;
    };
    {
      Cache8 k_copy = kc, v_copy = vc;
      const Status s =
          flash_attn_with_kvcache(step.q.view(), k_copy.view(), v_copy.view(), out.mutable_view(),
                                  lse_view, append_into(k_copy, v_copy));
      ASSERT_TRUE(s.ok) << s.message;
    }
    step.v.set(1, seqlen - 1, 1, 5, std::numeric_limits<double>::quiet_NaN());
    refuses(kc.view(), vc.view(), append_into(kc, vc), lse_view, "v",
            "a NaN in sequence 1's last new v row, int8 cache");
    step.v.set(1, seqlen - 1, 1, 5, 0.25);
    vh.scale[1] = 0;
    refuses(kc.view(), vh.view(), append_into(kc, vh), lse_view, "v_scale", "a per-head scale 0");
    vh.scale[1] = std::numeric_limits<float>::quiet_NaN();
    refuses(kc.view(), vh.view(), append_into(kc, vh), lse_view, "v_scale", "a per-head scale NaN");
    // Per-token K and V scales in one tensor: the append would write each over the other.
    KvCacheOptions o = append_into(kc, vs);
    o.v_scale = kc.scale_view();
    refuses(kc.view(), vs.view(), o, lse_view, "v_scale", "k_scale and v_scale in one tensor");
    // Per-token K scales over V's codes.
    o = append_into(kc, vc);
    o.k_scale.data = vc.codes.data();
    refuses(kc.view(), vc.view(), o, lse_view, "k_scale", "k_scale over v_cache's codes");
    // lse over the per-token K scales the append writes.
    MutableTensorView lse_over = lse_view;
    lse_over.data = kc.scale.data();
    refuses(kc.view(), vc.view(), append_into(kc, vc), lse_over, "lse", "lse over k_scale");
    // Sequence 1's new tokens past the cache.
    step.seqlens[1] = static_cast<int32_t>(kCacheLen - seqlen + 1);
    refuses(kc.view(), vc.view(), append_into(kc, vc), lse_view, "cache_seqlens",
            "sequence 1 past the cache");
    step.seqlens[1] = 17;
    // Without the scale.
    o = KvCacheOptions{};
    o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
    o.v_scale = vc.scale_view();
    refuses(kc.view(), vc.view(), o, lse_view, "k_scale", "k_scale missing");
    // A scale beside a float cache.
    o.k_scale = kc.scale_view();
    refuses(kc.view(), float_cache.mutable_view(), o, lse_view, "v_scale",
            "a scale beside a float32 cache");
  }
}

// e4m3 saturates an appended value beyond 448 x scale; e5m2 keeps an Inf, which reaches only
// the rows that attend its slot (as a float cache's would).
TEST(KvCacheKv8, AppendSaturatesAndAnInfReachesOnlyTheRowsThatSeeIt) {
  Step step(3, 71);
  Cache8 kc(DType::kFloat8E4M3, kPerHead, 81), vc(DType::kFloat8E5M2, kPerHead, 82);
  step.k.set(0, 0, 1, 3, 1e6);
  step.v.set(1, 2, 0, 7, std::numeric_limits<double>::infinity());
  Tensor4 out(DType::kFloat32, {kBatch, 3, kHeads, kCd});
  ASSERT_TRUE(attend(step, kc, vc, out, true).ok);
  const size_t k_at = static_cast<size_t>(((0 * kCacheLen + 9) * kCacheKvHeads + 1) * kCd + 3);
  EXPECT_EQ(kv8::decode(kc.format, kc.codes[k_at]), 448.0f);
  const size_t v_at = static_cast<size_t>(((1 * kCacheLen + 19) * kCacheKvHeads + 0) * kCd + 7);
  EXPECT_TRUE(std::isinf(kv8::decode(vc.format, vc.codes[v_at])));
  // Sequence 1's new token 2 sits at slot 19: only its own query row (causal) sees it, and only
  // the query heads of KV head 0 (heads 0 and 1).
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        const bool sees = b == 1 && i == 2 && h / (kHeads / kCacheKvHeads) == 0;
        for (int64_t x = 0; x < kCd; ++x) {
          const double y = out.get(b, i, h, x);
          if (!sees) {
            ASSERT_TRUE(std::isfinite(y)) << b << " " << i << " " << h << " " << x;
          } else if (x == 7) {
            EXPECT_FALSE(std::isfinite(y));
          }
        }
      }
    }
  }
}

// NaN and Inf in q against an 8-bit cache reach only their own rows.
TEST(KvCacheKv8, NonFiniteQueriesStayInTheirRows) {
  for (int64_t seqlen : {3, 20}) {
    Step step(seqlen, 91);
    Cache8 kc(DType::kInt8, kPerToken, 92), vc(DType::kFloat8E4M3, kPerTensor, 93);
    step.q.set(0, 1, 2, 0, std::numeric_limits<double>::quiet_NaN());
    step.q.set(1, 0, 3, 4, std::numeric_limits<double>::infinity());
    Tensor4 out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
    ASSERT_TRUE(attend(step, kc, vc, out, false).ok);
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t i = 0; i < seqlen; ++i) {
        for (int64_t h = 0; h < kHeads; ++h) {
          const bool poisoned = (b == 0 && i == 1 && h == 2) || (b == 1 && i == 0 && h == 3);
          for (int64_t x = 0; x < kCd; ++x) {
            if (!poisoned) {
              ASSERT_TRUE(std::isfinite(out.get(b, i, h, x))) << b << i << h << x;
            }
          }
        }
      }
    }
  }
}

// flash_attn_varlen_kvcache over the same 8-bit caches: each sequence bitwise its
// flash_attn_with_kvcache call (a decode sequence and a prefill chunk in one batch).
TEST(KvCacheKv8, VarlenIsBitwiseThePerSequenceCalls) {
  Cache8 kc(DType::kFloat8E5M2, kPerToken, 101), vc(DType::kInt8, kPerHead, 102);
  const std::vector<int64_t> lens = {2, 19};
  const std::vector<int32_t> cu = {0, 2, 21}, used = {30, 40};
  HostTensor q(DType::kFloat32, {21, kHeads, kCd});
  std::mt19937 rng(103);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < 21; ++i) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t x = 0; x < kCd; ++x) q.set(i, h, x, u(rng));
    }
  }
  HostTensor out(DType::kFloat32, {21, kHeads, kCd});
  VarlenKvCacheOptions o;
  o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {3});
  o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {2});
  const MutableTensorView ks = kc.scale_view(), vs = vc.scale_view();
  o.k_scale = {ks.data, ks.dtype, ks.rank, ks.shape, ks.strides};
  o.v_scale = {vs.data, vs.dtype, vs.rank, vs.shape, vs.strides};
  o.causal = true;
  const MutableTensorView kv = kc.view(), vv = vc.view();
  const Status s = flash_attn_varlen_kvcache(q.view(), {kv.data, kv.dtype, 4, kv.shape, kv.strides},
                                             {vv.data, vv.dtype, 4, vv.shape, vv.strides},
                                             out.mutable_view(), {}, o);
  ASSERT_TRUE(s.ok) << s.message;
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t n = lens[static_cast<size_t>(b)];
    Tensor4 qb(DType::kFloat32, {kBatch, n, kHeads, kCd}),
        ob(DType::kFloat32, {kBatch, n, kHeads, kCd});
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kCd; ++x) qb.set(b, i, h, x, q.get(cu[b] + i, h, x));
      }
    }
    // Both sequences' cache lengths as they were before the queries' own tokens.
    std::vector<int32_t> seqlens = {used[0], used[1]};
    KvCacheOptions ko;
    ko.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {kBatch});
    ko.k_scale = kc.scale_view();
    ko.v_scale = vc.scale_view();
    ko.causal = true;
    ASSERT_TRUE(
        flash_attn_with_kvcache(qb.view(), kc.view(), vc.view(), ob.mutable_view(), {}, ko).ok);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kCd; ++x) {
          ASSERT_EQ(ob.get(b, i, h, x), out.get(cu[b] + i, h, x)) << b << " " << i << " " << h;
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashcte::test
