// Refusals over paged 8-bit caches: flash_attn_with_kvcache appending into pages (pages of 5
// slots, shuffled; int8 keys too) and flash_attn_varlen_kvcache over pages (bad pages, lengths,
// scales and outputs over the caches) are refused by name with every buffer of the call byte for
// byte as it was: the pages' codes and scales, the table, q, the new k and v, the lengths, out
// and lse. The machinery: kv8_cases.h; the accuracy: kv8_kvcache_test.cc.
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

// flash_attn_with_kvcache appending into paged 8-bit caches (pages of 5 slots, shuffled), with
// every buffer of the call in the snapshot: the pages' codes and scales, the table, q, the new k
// and v, the lengths, out and lse.
struct PagedAppend8 {
  Step step;
  Cache8 kd, vd;  // the pages' contents, dense (and per-head / per-tensor scales)
  Paged8 kp, vp;
  Tensor4 out;
  std::vector<float> lse;
  KvCacheOptions o;
  MutableTensorView k_cache, v_cache, lse_view;

  PagedAppend8(int64_t seqlen, DType k_format, Granularity k_granularity, DType v_format,
               Granularity v_granularity)
      : step(seqlen, 111),
        kd(k_format, k_granularity, 112),
        vd(v_format, v_granularity, 113),
        kp(kd),
        vp(vd),
        out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd}),
        lse(static_cast<size_t>(kBatch * kHeads * seqlen)) {
    vp.table = kp.table;
    vp.copy(true);
    o.k = step.k.view();
    o.v = step.v.view();
    o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
    o.block_table = TensorView::contiguous(kp.table.data(), DType::kInt32, {kBatch, kSeqPages});
    o.k_scale = kp.scale_view();
    o.v_scale = vp.scale_view();
    o.causal = true;
    k_cache = kp.view();
    v_cache = vp.view();
    lse_view = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, seqlen});
  }
  Status run() {
    return flash_attn_with_kvcache(step.q.view(), k_cache, v_cache, out.mutable_view(), lse_view,
                                   o);
  }
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("k_cache pages", kp.codes).add("k_scale pages", kp.scale);
    snap.add("v_cache pages", vp.codes).add("v_scale pages", vp.scale);
    snap.add("k_scale", kd.scale).add("v_scale", vd.scale);
    snap.add("dense k_cache", kd.codes).add("dense v_cache", vd.codes);
    snap.add("block_table", kp.table).add("cache_seqlens", step.seqlens);
    snap.add("q", step.q.bytes()).add("k", step.k.bytes()).add("v", step.v.bytes());
    snap.add_output("out", out.bytes()).add_output("lse", lse);
    return snap;
  }
};

struct BadAppend8 {
  const char* what;
  const char* argument;
  void (*breaks)(PagedAppend8&);
};

// Sequence 1 holds 17 tokens: its new ones go to slots 17, 18, ... of its pages 3, 4, ...
const BadAppend8 kBadAppend8[] = {
    {"a NaN in sequence 1's last new v row (int8 V)", "v",
     [](PagedAppend8& c) {
       c.step.v.set(1, c.step.seqlen - 1, 1, 5, std::numeric_limits<double>::quiet_NaN());
     }},
    {"a page sequence 1 writes past num_blocks", "block_table",
     [](PagedAppend8& c) { c.kp.table[kSeqPages + 3] = static_cast<int32_t>(kBatch * kSeqPages); }},
    {"a negative page sequence 1 writes", "block_table",
     [](PagedAppend8& c) { c.kp.table[kSeqPages + 3] = -1; }},
    {"a page sequence 1 writes that sequence 0 reads", "block_table",
     [](PagedAppend8& c) { c.kp.table[kSeqPages + 3] = c.kp.table[0]; }},
    {"sequence 1's new tokens past its pages", "cache_seqlens",
     [](PagedAppend8& c) {
       c.step.seqlens[1] = static_cast<int32_t>(kSeqPages * kPageSlots - c.step.seqlen + 1);
     }},
    {"per-token k_scale of another page_block_size", "k_scale",
     [](PagedAppend8& c) { c.o.k_scale.shape[1] = kPageSlots - 1; }},
    {"per-token k_scale in the dense cache's shape", "k_scale",
     [](PagedAppend8& c) { c.o.k_scale = c.kd.scale_view(); }},
    {"k_scale bfloat16", "k_scale", [](PagedAppend8& c) { c.o.k_scale.dtype = DType::kBFloat16; }},
    {"v_scale per head with a NaN", "v_scale",
     [](PagedAppend8& c) { c.vd.scale[1] = std::numeric_limits<float>::quiet_NaN(); }},
    {"v_scale per head with an entry 0", "v_scale", [](PagedAppend8& c) { c.vd.scale[0] = 0.0f; }},
    {"v_scale missing", "v_scale", [](PagedAppend8& c) { c.o.v_scale = {}; }},
    {"v_cache of another page_block_size", "v_cache",
     [](PagedAppend8& c) { c.v_cache.shape[1] = kPageSlots - 1; }},
    {"per-token k_scale over v_cache's pages", "k_scale",
     [](PagedAppend8& c) { c.o.k_scale.data = c.vp.codes.data(); }},
    {"lse over a K page", "lse", [](PagedAppend8& c) { c.lse_view.data = c.kp.codes.data(); }},
    {"lse over the per-token k_scale", "lse",
     [](PagedAppend8& c) { c.lse_view.data = c.kp.scale.data(); }},
    {"cache_batch_idx with a paged cache", "cache_batch_idx",
     [](PagedAppend8& c) { c.o.cache_batch_idx = c.o.cache_seqlens; }},
};

// Refused appends into paged 8-bit caches write nothing: K e4m3 with per-token scales in the
// pages, V int8 with per-head scales, on the decode kernel (3 new tokens) and on attention_cte
// (20).
TEST(KvCacheKv8, PagedAppendRefusalsWriteNothing) {
  for (int64_t seqlen : {3, 20}) {
    SCOPED_TRACE("seqlen_new " + std::to_string(seqlen));
    {
      PagedAppend8 valid(seqlen, DType::kFloat8E4M3, kPerToken, DType::kInt8, kPerHead);
      const Status s = valid.run();
      ASSERT_TRUE(s.ok) << s.message;
    }
    for (const BadAppend8& bad : kBadAppend8) {
      PagedAppend8 call(seqlen, DType::kFloat8E4M3, kPerToken, DType::kInt8, kPerHead);
      bad.breaks(call);
      const BufferSnapshot snap = call.snapshot();
      EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
      EXPECT_TRUE(snap.unchanged()) << bad.what;
    }
  }
}

// The same with the formats the other way round: K int8 with per-head scales, V e5m2 with
// per-token scales in the pages. A NaN in sequence 1's last new k row is refused with the V pages
// and their scales (written after K's) untouched too; K and V per-token scales in one tensor are
// refused.
TEST(KvCacheKv8, PagedAppendRefusalsWriteNothingInt8Keys) {
  for (int64_t seqlen : {3, 20}) {
    SCOPED_TRACE("seqlen_new " + std::to_string(seqlen));
    const auto check = [&](void (*breaks)(PagedAppend8&), const char* argument, const char* what) {
      PagedAppend8 call(seqlen, DType::kInt8, kPerHead, DType::kFloat8E5M2, kPerToken);
      breaks(call);
      const BufferSnapshot snap = call.snapshot();
      EXPECT_TRUE(refused_for(call.run(), argument)) << what;
      EXPECT_TRUE(snap.unchanged()) << what;
    };
    check(
        [](PagedAppend8& c) {
          c.step.k.set(1, c.step.seqlen - 1, 1, 7, std::numeric_limits<double>::quiet_NaN());
        },
        "k", "a NaN in sequence 1's last new k row (int8 K)");
    check(
        [](PagedAppend8& c) {
          c.step.k.set(0, 0, 0, 0, std::numeric_limits<double>::quiet_NaN());
          c.kp.table[kSeqPages + 3] = c.kp.table[1];
        },
        "block_table", "a NaN and a shared page: the page is found first");
    check([](PagedAppend8& c) { c.kd.scale[1] = -1.0f; }, "k_scale", "a negative k_scale");
    check(
        [](PagedAppend8& c) {
          c.step.seqlens[1] = static_cast<int32_t>(kSeqPages * kPageSlots - c.step.seqlen + 1);
        },
        "cache_seqlens", "sequence 1's new tokens past its pages");
  }
  // Both per token, in one tensor.
  PagedAppend8 call(3, DType::kInt8, kPerToken, DType::kFloat8E5M2, kPerToken);
  call.o.v_scale = call.o.k_scale;
  const BufferSnapshot snap = call.snapshot();
  EXPECT_TRUE(refused_for(call.run(), "v_scale"));
  EXPECT_TRUE(snap.unchanged());
}

// flash_attn_varlen_kvcache over paged 8-bit caches (K e5m2 with per-token scales in the pages,
// V int8 with per-head scales; a decode sequence and a prefill chunk): bad pages, lengths, scales
// and outputs over the caches are refused by name with every buffer of the call as it was.
struct PagedVarlen8 {
  Cache8 kd{DType::kFloat8E5M2, kPerToken, 121}, vd{DType::kInt8, kPerHead, 122};
  Paged8 kp{kd}, vp{vd};
  std::vector<int32_t> cu = {0, 2, 21}, used = {30, 40};
  HostTensor q{DType::kFloat32, {21, kHeads, kCd}};
  HostTensor out{DType::kFloat32, {21, kHeads, kCd}};
  std::vector<float> lse = std::vector<float>(static_cast<size_t>(kHeads * 21));
  VarlenKvCacheOptions o;
  TensorView k_cache, v_cache;
  MutableTensorView lse_view;

  PagedVarlen8() {
    vp.table = kp.table;
    vp.copy(true);
    std::mt19937 rng(123);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t i = 0; i < 21; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kCd; ++x) q.set(i, h, x, u(rng));
      }
    }
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {3});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {kBatch});
    o.block_table = TensorView::contiguous(kp.table.data(), DType::kInt32, {kBatch, kSeqPages});
    o.k_scale = as_input(kp.scale_view());
    o.v_scale = as_input(vp.scale_view());
    o.causal = true;
    k_cache = as_input(kp.view());
    v_cache = as_input(vp.view());
    lse_view = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, 21});
  }
  static TensorView as_input(const MutableTensorView& m) {
    return {m.data, m.dtype, m.rank, m.shape, m.strides};
  }
  Status run() {
    return flash_attn_varlen_kvcache(q.view(), k_cache, v_cache, out.mutable_view(), lse_view, o);
  }
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("k_cache pages", kp.codes).add("k_scale pages", kp.scale);
    snap.add("v_cache pages", vp.codes).add("v_scale", vd.scale);
    snap.add("dense k_cache", kd.codes).add("dense k_scale", kd.scale);
    snap.add("dense v_cache", vd.codes).add("block_table", kp.table);
    snap.add("cu_seqlens_q", cu).add("seqused_k", used).add("q", q.bytes());
    snap.add_output("out", out.mutable_view().data, out.bytes().size()).add_output("lse", lse);
    return snap;
  }
};

struct BadVarlen8 {
  const char* what;
  const char* argument;
  void (*breaks)(PagedVarlen8&);
};

// Sequence 1 uses 40 slots: its pages 0 to 7.
const BadVarlen8 kBadVarlen8[] = {
    {"a page of sequence 1 past num_blocks", "block_table",
     [](PagedVarlen8& c) { c.kp.table[kSeqPages + 7] = static_cast<int32_t>(kBatch * kSeqPages); }},
    {"a negative page of sequence 1", "block_table",
     [](PagedVarlen8& c) { c.kp.table[kSeqPages + 2] = -1; }},
    {"seqused_k of sequence 1 past its pages", "seqused_k",
     [](PagedVarlen8& c) { c.used[1] = static_cast<int32_t>(kSeqPages * kPageSlots + 1); }},
    {"per-token k_scale in the dense cache's shape", "k_scale",
     [](PagedVarlen8& c) { c.o.k_scale = PagedVarlen8::as_input(c.kd.scale_view()); }},
    {"per-token k_scale of another page_block_size", "k_scale",
     [](PagedVarlen8& c) { c.o.k_scale.shape[1] = kPageSlots - 1; }},
    {"k_scale float16", "k_scale", [](PagedVarlen8& c) { c.o.k_scale.dtype = DType::kFloat16; }},
    {"v_scale per head with a NaN", "v_scale",
     [](PagedVarlen8& c) { c.vd.scale[1] = std::numeric_limits<float>::quiet_NaN(); }},
    {"v_scale missing", "v_scale", [](PagedVarlen8& c) { c.o.v_scale = {}; }},
    {"v_cache of another page_block_size", "v_cache",
     [](PagedVarlen8& c) { c.v_cache.shape[1] = kPageSlots - 1; }},
    {"lse over a K page", "lse", [](PagedVarlen8& c) { c.lse_view.data = c.kp.codes.data(); }},
    {"lse over the per-token k_scale", "lse",
     [](PagedVarlen8& c) { c.lse_view.data = c.kp.scale.data(); }},
};

TEST(VarlenKv8, PagedRefusalsWriteNothing) {
  {
    PagedVarlen8 valid;
    const Status s = valid.run();
    ASSERT_TRUE(s.ok) << s.message;
  }
  for (const BadVarlen8& bad : kBadVarlen8) {
    PagedVarlen8 call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

}  // namespace
}  // namespace flashcte::test
