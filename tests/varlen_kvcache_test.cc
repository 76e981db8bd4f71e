// flash_attn_varlen_kvcache (include/flashcte/kvcache.h), a serving engine's mixed batch: every
// sequence's rows against the float64 oracle (src/reference: its query heads over the cache
// slots [0, seqused_k) with FlashAttention's masks as packing bounds, the sinks as attention_cte's
// sink), with FlashAttention's rule (3x a plain same-precision implementation, plus 1e-5); paged
// results bitwise the dense ones and the same for any thread count; each sequence bitwise what
// flash_attn_with_kvcache gives it alone; bad input refused by name.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "tests/test_util.h"
#include "tests/varlen_inputs.h"

namespace flashcte::test {
namespace {

// Every sequence's rows against attention_cte's float64 oracle on its logical cache.
void check_against_reference(const VarlenCase& c, const VarlenInputs& in, const VarlenRun& r) {
  const int64_t dv = c.value_dim();
  std::vector<double> got, exact, plain, got_lse, exact_lse, plain_lse;
  for (int64_t b = 0; b < c.batch(); ++b) {
    const int64_t rows = c.q_lens[b], seqlen_k = c.used[b], first = in.cu[b];
    if (rows == 0) continue;
    // A sequence with no key at all: every row is 0 (the sink takes the whole weight) with lse
    // -inf, or log(exp(sink)) = sink with a sink.
    const int64_t keys = std::max<int64_t>(seqlen_k, 1);
    HostTensor qr(c.dtype, {c.heads, rows, c.d}), kr(c.dtype, {c.kv_heads, keys, c.d});
    HostTensor vr(c.dtype, {c.kv_heads, keys, dv});
    HostTensor lo(DType::kInt64, {rows, 1}), hi(DType::kInt64, {rows, 1});
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t x = 0; x < c.d; ++x) qr.set(h, i, x, in.q.get(first + i, h, x));
      }
    }
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      for (int64_t j = 0; j < seqlen_k; ++j) {
        for (int64_t x = 0; x < c.d; ++x)
          kr.set(h, j, x, in.logical_k[b][(j * c.kv_heads + h) * c.d + x]);
        for (int64_t x = 0; x < dv; ++x)
          vr.set(h, j, x, in.logical_v[b][(j * c.kv_heads + h) * dv + x]);
      }
    }
    // FlashAttention's construct_local_mask: bottom-right alignment, the window.
    const int64_t right = c.causal ? 0 : c.right;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t diagonal = seqlen_k - rows + i;
      int64_t lo_i = 0, end = seqlen_k;
      if (right >= 0) end = std::min(end, diagonal + right + 1);
      if (c.left >= 0) lo_i = std::max(lo_i, diagonal - c.left);
      end = std::max<int64_t>(end, 0);
      lo.set_raw_int(i, 0, std::min(lo_i, end));
      hi.set_raw_int(i, 0, end);
    }
    Options o;
    o.tp_k = true;
    o.causal_mask = false;
    o.bottom_right = true;
    o.prior_used_len = {};
    o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    o.softcap = c.softcap;
    o.bound_min = lo.view();
    o.bound_max = hi.view();
    HostTensor slopes(DType::kFloat32, {c.heads}), sink(DType::kFloat32, {c.heads, 1});
    if (c.alibi > 0) {
      for (int64_t h = 0; h < c.heads; ++h) {
        slopes.set(h, 0, 0, c.alibi == 1 ? in.slopes.get(h) : in.slopes.get(b, h));
      }
      o.alibi_slopes = slopes.view();
    }
    if (c.sinks) {
      for (int64_t h = 0; h < c.heads; ++h) sink.set(h, 0, 0, in.sinks.get(h));
      o.sink = sink.view();
    }
    // The oracle sees keys.size() >= 1; a cache of 0 keys is one key masked for every row.
    reference::Result e, p;
    ASSERT_TRUE(reference::attention(qr.view(), kr.view(), vr.view(), o, &e).ok);
    ASSERT_TRUE(reference::attention_plain(qr.view(), kr.view(), vr.view(), o, &p).ok);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t x = 0; x < dv; ++x) {
          got.push_back(r.out.get(first + i, h, x));
          exact.push_back(e.out_at(h, i, x));
          plain.push_back(p.out_at(h, i, x));
        }
        got_lse.push_back(r.lse[h * c.total_q() + first + i]);
        exact_lse.push_back(e.lse[h * rows + i]);
        plain_lse.push_back(p.lse[h * rows + i]);
      }
    }
  }
  EXPECT_TRUE(within_plain_error(got, plain, exact, 3, 1e-5)) << "out";
  EXPECT_TRUE(within_plain_error(got_lse, plain_lse, exact_lse, 3, 1e-5)) << "lse";
  for (size_t i = 0; i < got_lse.size(); ++i) {
    ASSERT_EQ(std::isinf(got_lse[i]), std::isinf(exact_lse[i])) << "lse row " << i << ": empty";
  }
}

VarlenCase mixed(std::string name, std::vector<int64_t> q_lens, std::vector<int64_t> used) {
  VarlenCase c;
  c.name = std::move(name);
  c.q_lens = std::move(q_lens);
  c.used = std::move(used);
  return c;
}

// Decoding sequences (1 to 16 queries), prefill chunks (17 and more), empty sequences and empty
// caches in one batch.
std::vector<VarlenCase> shapes() {
  std::vector<VarlenCase> s;
  s.push_back(mixed("decode_and_prefill", {1, 300, 1, 3, 17}, {500, 300, 77, 3, 640}));
  s.push_back(mixed("empty_sequences", {0, 1, 0, 40, 2}, {9, 0, 0, 40, 1}));
  VarlenCase c = mixed("paged16_window", {1, 64, 5, 1}, {700, 900, 300, 1});
  c.page = 16, c.left = 100;
  s.push_back(c);
  c = mixed("paged1_gqa4", {2, 20, 1}, {33, 60, 19});
  c.page = 1, c.heads = 8, c.kv_heads = 2;
  s.push_back(c);
  c = mixed("paged3_mqa_softcap_alibi", {1, 33, 4}, {100, 90, 4});
  c.page = 3, c.heads = 4, c.kv_heads = 1, c.softcap = 5.0f, c.alibi = 1;
  s.push_back(c);
  c = mixed("paged256_sinks_alibi_per_batch", {1, 280, 1}, {600, 700, 2});
  c.page = 256, c.sinks = true, c.alibi = 2;
  s.push_back(c);
  c = mixed("not_causal_window_both_sides_dv", {3, 50}, {200, 120});
  c.causal = false, c.left = 30, c.right = 7, c.dv = 48, c.page = 16;
  s.push_back(c);
  c = mixed("more_queries_than_keys", {8, 40}, {5, 30});
  s.push_back(c);
  return s;
}

class VarlenAccuracy : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenAccuracy, MatchesTheReference) {
  const VarlenCase& c = GetParam();
  const VarlenInputs in(c);
  const VarlenRun r = run_varlen(c, in);
  ASSERT_TRUE(r.status.ok) << r.status.message;
  check_against_reference(c, in, r);
}

std::string case_name(const ::testing::TestParamInfo<VarlenCase>& param) {
  return param.param.name;
}

INSTANTIATE_TEST_SUITE_P(Varlen, VarlenAccuracy, ::testing::ValuesIn(in_every_dtype(shapes())),
                         case_name);

// The same batch paged (pages of 1, 3, 16, 256) and dense, on 1 and 3 threads, on every target:
// bitwise one result.
TEST(VarlenPaged, BitwiseTheDenseResultForAnyThreadCount) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    VarlenCase c = mixed("bitwise", {1, 130, 0, 2, 1, 40}, {1100, 200, 5, 700, 0, 300});
    c.dtype = dtype, c.heads = 8, c.kv_heads = 2, c.d = 64, c.left = 600, c.alibi = 1;
    c.sinks = true;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(std::string(hwy::TargetName(target)) + " " + dtype_name(dtype));
      c.page = 0;
      const VarlenInputs dense_in(c);
      const VarlenRun dense = run_varlen(c, dense_in);
      ASSERT_TRUE(dense.status.ok) << dense.status.message;
      for (int64_t page : {1, 3, 16, 256}) {
        for (int threads : {1, 3}) {
          c.page = page, c.threads = threads;
          const VarlenInputs in(c);
          const VarlenRun paged = run_varlen(c, in);
          ASSERT_TRUE(paged.status.ok) << paged.status.message;
          EXPECT_TRUE(paged.out.bytes() == dense.out.bytes()) << "page " << page << ": out";
          EXPECT_TRUE(paged.lse == dense.lse) << "page " << page << ": lse";
        }
      }
      c.threads = 0;
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

// flash_attn_with_kvcache's rule for the table (kvcache.h): the pages no query row sees are not
// looked at. A sliding-window step whose table holds -1 before each window (and for a sequence
// without rows) gives the full table's result; a page some row sees is still refused.
TEST(VarlenPaged, PagesNoRowSeesAreNotLookedAt) {
  VarlenCase c = mixed("freed_before_window", {1, 3, 0}, {700, 300, 50});
  c.page = 16, c.left = 100;
  const VarlenInputs in(c);
  const VarlenRun full = run_varlen(c, in);
  ASSERT_TRUE(full.status.ok) << full.status.message;
  VarlenInputs freed = in;
  int64_t cleared = 0;
  for (int64_t b = 0; b < c.batch(); ++b) {
    // Row 0 sees slots from used - q_len - left: the pages wholly before it are free.
    const int64_t first_seen = c.q_lens[b] == 0 ? c.used[b] : c.used[b] - c.q_lens[b] - c.left;
    for (int64_t col = 0; (col + 1) * c.page <= first_seen; ++col, ++cleared) {
      freed.table[b * c.pages_per_sequence() + col] = -1;
    }
  }
  ASSERT_GT(cleared, 40);
  const VarlenRun got = run_varlen(c, freed);
  ASSERT_TRUE(got.status.ok) << got.status.message;
  EXPECT_TRUE(got.out.bytes() == full.out.bytes());
  EXPECT_TRUE(got.lse == full.lse);
  VarlenInputs seen = in;
  seen.table[(c.used[0] - 1) / c.page] = -1;  // sequence 0's last page, which its row sees
  EXPECT_TRUE(refused_for(run_varlen(c, seen).status, "block_table"));
}

// A chunk of more than 16 query rows goes to attention_cte, whose tiles read every slot of
// [0, seqused_k): each of those pages must be in range, even one its window leaves out.
TEST(VarlenPaged, AChunkPastSixteenRowsHoldsEveryPageOfItsSlots) {
  VarlenCase c = mixed("chunk_past_window", {1, 17}, {300, 300});
  c.page = 16, c.left = 50;
  VarlenInputs in(c);
  ASSERT_TRUE(run_varlen(c, in).status.ok);
  in.table[c.pages_per_sequence()] = -1;  // sequence 1's first page, before its window
  EXPECT_TRUE(refused_for(run_varlen(c, in).status, "block_table"));
}

// Each sequence of the mixed batch is bitwise what flash_attn_with_kvcache computes for it alone
// (the decode kernel for its few queries, attention_cte for its long chunk).
TEST(VarlenMixed, EachSequenceBitwiseItsOwnCall) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    VarlenCase c = mixed("alone", {1, 200, 16, 17, 1}, {900, 250, 40, 17, 1});
    c.dtype = dtype, c.page = 16, c.heads = 8, c.kv_heads = 2, c.softcap = 20.0f;
    const VarlenInputs in(c);
    const VarlenRun all = run_varlen(c, in);
    ASSERT_TRUE(all.status.ok) << all.status.message;
    for (int64_t b = 0; b < c.batch(); ++b) {
      const int64_t rows = c.q_lens[b];
      const TensorView qv = in.q.view();
      const TensorView q_b{
          static_cast<const unsigned char*>(qv.data) + in.cu[b] * qv.strides[0] * dtype_size(dtype),
          dtype,
          4,
          {1, rows, c.heads, c.d},
          {0, qv.strides[0], qv.strides[1], qv.strides[2]}};
      Tensor4 out(dtype, {1, rows, c.heads, c.d});
      std::vector<float> lse(static_cast<size_t>(c.heads * rows));
      KvCacheOptions o;
      o.cache_seqlens = TensorView::contiguous(&in.used[b], DType::kInt32, {1});
      o.block_table = TensorView::contiguous(&in.table[b * c.pages_per_sequence()], DType::kInt32,
                                             {1, c.pages_per_sequence()});
      o.causal = true;
      o.softcap = c.softcap;
      Tensor4 k_cache = in.k_cache, v_cache = in.v_cache;
      const Status s = flash_attn_with_kvcache(
          q_b, k_cache.mutable_view(), v_cache.mutable_view(), out.mutable_view(),
          MutableTensorView::contiguous(lse.data(), DType::kFloat32, {1, c.heads, rows}), o);
      ASSERT_TRUE(s.ok) << s.message;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t h = 0; h < c.heads; ++h) {
          for (int64_t x = 0; x < c.d; ++x) {
            ASSERT_EQ(out.get(0, i, h, x), all.out.get(in.cu[b] + i, h, x))
                << dtype_name(dtype) << " sequence " << b << " row " << i;
          }
          ASSERT_EQ(lse[h * rows + i], all.lse[h * c.total_q() + in.cu[b] + i]);
        }
      }
    }
  }
}

// The call's per-thread profile: every thread ran and the busy times fit in the wall time.
TEST(VarlenMixed, ReportsEachThreadsBusyTime) {
  VarlenCase c = mixed("profile", {1, 1, 1, 200}, {1000, 2000, 300, 400});
  c.threads = 2;
  const VarlenInputs in(c);
  HostTensor out(c.dtype, {c.total_q(), c.heads, c.d});
  VarlenKvCacheOptions o = in.options(c);
  ThreadProfile profile;
  o.profile = &profile;
  ASSERT_TRUE(flash_attn_varlen_kvcache(in.q.view(), in.k_cache.view(), in.v_cache.view(),
                                        out.mutable_view(), {}, o)
                  .ok);
  ASSERT_EQ(profile.busy_seconds.size(), 2u);
  EXPECT_GT(profile.wall_seconds, 0.0);
  for (double busy : profile.busy_seconds) {
    EXPECT_GT(busy, 0.0);
    EXPECT_LE(busy, profile.wall_seconds);
  }
}

// ---- bad input ------------------------------------------------------------------------------

// Each refusal also leaves every buffer of the call byte for byte as it was: the caches, q, the
// offsets, lengths and table, the sinks and slopes, out and lse.
TEST(VarlenValidation, EveryBadInputIsRefusedByName) {
  VarlenCase c = mixed("valid", {1, 20}, {10, 30});
  c.page = 4;
  VarlenInputs in(c);
  HostTensor out(c.dtype, {c.total_q(), c.heads, c.d});
  std::vector<float> lse(static_cast<size_t>(c.heads * c.total_q()));
  const MutableTensorView lse_view =
      MutableTensorView::contiguous(lse.data(), DType::kFloat32, {c.heads, c.total_q()});
  ASSERT_TRUE(flash_attn_varlen_kvcache(in.q.view(), in.k_cache.view(), in.v_cache.view(),
                                        out.mutable_view(), lse_view, in.options(c))
                  .ok);
  // Buffers the cases below point the call at, besides `in`'s.
  std::vector<int32_t> cu, used, table;
  std::vector<int64_t> wide_used(in.used.begin(), in.used.end());
  std::vector<int64_t> wide_table(in.table.begin(), in.table.end());
  HostTensor sinks(DType::kFloat32, {c.heads});
  HostTensor short_sinks(DType::kFloat32, {c.heads - 1});
  HostTensor slopes(DType::kFloat32, {c.batch() + 1, c.heads});
  HostTensor q_bf16(DType::kBFloat16, {c.total_q(), c.heads, c.d});
  HostTensor q_heads(c.dtype, {c.total_q(), 3, c.d});
  for (int64_t h = 0; h < c.heads; ++h) sinks.set(h, 0, 0, h == 1 ? std::nan("") : 0.5);
  // The call with `o` and q refused for `argument`, nothing written; out_over: where out points
  // instead of its own buffer; without_lse: no lse.
  const auto refuses = [&](const VarlenKvCacheOptions& o, const TensorView& q,
                           const std::string& argument, const char* what, void* out_over = nullptr,
                           bool without_lse = false) {
    BufferSnapshot snap;
    snap.add("k_cache", in.k_cache.bytes()).add("v_cache", in.v_cache.bytes());
    snap.add("q", in.q.bytes()).add("cu_seqlens_q", in.cu).add("seqused_k", in.used);
    snap.add("block_table", in.table).add("bad cu_seqlens_q", cu).add("bad seqused_k", used);
    snap.add("bad block_table", table).add("int64 seqused_k", wide_used);
    snap.add("int64 block_table", wide_table).add("sinks", sinks.bytes());
    snap.add("short sinks", short_sinks.bytes()).add("alibi_slopes", slopes.bytes());
    snap.add("bfloat16 q", q_bf16.bytes()).add("q of 3 heads", q_heads.bytes());
    snap.add_output("out", out.mutable_view().data, out.bytes().size()).add_output("lse", lse);
    MutableTensorView out_view = out.mutable_view();
    if (out_over != nullptr) out_view.data = out_over;
    EXPECT_TRUE(
        refused_for(flash_attn_varlen_kvcache(q, in.k_cache.view(), in.v_cache.view(), out_view,
                                              without_lse ? MutableTensorView{} : lse_view, o),
                    argument))
        << what;
    EXPECT_TRUE(snap.unchanged()) << what;
  };
  struct Bad {
    const char* argument;
    const char* what;
    std::vector<int32_t> cu, used, table;
  };
  const std::vector<int32_t> t = in.table;
  std::vector<int32_t> out_of_range = t, negative = t;
  out_of_range[1] = 1000;
  negative[c.pages_per_sequence()] = -1;
  const Bad bad[] = {
      {"cu_seqlens_q", "not from 0", {1, 2, 21}, in.used, t},
      {"cu_seqlens_q", "decreasing", {0, 2, 1}, in.used, t},
      {"cu_seqlens_q", "not ending at total_q", {0, 1, 20}, in.used, t},
      {"seqused_k", "past the pages", in.cu, {10, 33}, t},
      {"seqused_k", "negative", in.cu, {-1, 30}, t},
      {"block_table", "a page past num_blocks", in.cu, in.used, out_of_range},
      {"block_table", "a negative page of sequence 1", in.cu, in.used, negative},
  };
  for (const Bad& b : bad) {
    cu = b.cu;
    used = b.used;
    table = b.table;
    VarlenKvCacheOptions o = in.options(c);
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {c.batch() + 1});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {c.batch()});
    o.block_table =
        TensorView::contiguous(table.data(), DType::kInt32, {c.batch(), c.pages_per_sequence()});
    refuses(o, in.q.view(), b.argument, b.what);
  }
  VarlenKvCacheOptions o = in.options(c);
  o.seqused_k = TensorView::contiguous(wide_used.data(), DType::kInt64, {c.batch()});
  refuses(o, in.q.view(), "seqused_k", "int64 lengths");
  o = in.options(c);
  o.cu_seqlens_q = {};
  refuses(o, in.q.view(), "cu_seqlens_q", "missing");
  o = in.options(c);
  o.block_table =
      TensorView::contiguous(wide_table.data(), DType::kInt64, {c.batch(), c.pages_per_sequence()});
  refuses(o, in.q.view(), "block_table", "int64 table");
  o = in.options(c);
  o.sinks = sinks.view();
  refuses(o, in.q.view(), "sinks", "NaN sink");
  o = in.options(c);
  o.sinks = short_sinks.view();
  refuses(o, in.q.view(), "sinks", "too few sinks");
  o = in.options(c);
  o.alibi_slopes = slopes.view();
  refuses(o, in.q.view(), "alibi_slopes", "a row per sequence and more");
  o = in.options(c);
  o.window_left = -2;
  refuses(o, in.q.view(), "window_size", "window below -1");
  refuses(in.options(c), q_bf16.view(), "k_cache", "dtype mismatch");
  refuses(in.options(c), q_heads.view(), "out", "q of 3 heads", nullptr, true);
  // out over q, or over a cache: refused before anything is read or written.
  refuses(in.options(c), in.q.view(), "out", "out over q", in.q.mutable_view().data, true);
  refuses(in.options(c), in.q.view(), "out", "out over k_cache", in.k_cache.bytes().data(), true);
}

// The call's rules bind sequences without query rows, and a batch of none, as any other: a
// fuzzer finding of issue 41 (they were checked only in the calls of sequences with rows).
TEST(VarlenValidation, ABatchWithoutQueryRowsIsHeldToTheSameRules) {
  const int64_t heads = 4, kv_heads = 2, d = 16, slots = 8;
  for (const int64_t batch : {int64_t{0}, int64_t{2}}) {
    SCOPED_TRACE("batch " + std::to_string(batch));
    HostTensor q(DType::kFloat32, {0, heads, d}), q_bf16(DType::kBFloat16, {0, heads, d});
    HostTensor k_cache(DType::kFloat32, {batch, slots, kv_heads, d});
    HostTensor v_cache(DType::kFloat32, {batch, slots, kv_heads, d});
    HostTensor v_heads(DType::kFloat32, {batch, slots, kv_heads + 1, d});
    HostTensor out(DType::kFloat32, {0, heads, d});
    std::vector<int32_t> cu(static_cast<size_t>(batch + 1), 0), used(static_cast<size_t>(batch), 3);
    VarlenKvCacheOptions o;
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {batch + 1});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {batch});
    EXPECT_TRUE(flash_attn_varlen_kvcache(q.view(), k_cache.view(), v_cache.view(),
                                          out.mutable_view(), {}, o)
                    .ok);
    EXPECT_TRUE(refused_for(flash_attn_varlen_kvcache(q_bf16.view(), k_cache.view(), v_cache.view(),
                                                      out.mutable_view(), {}, o),
                            "k_cache"));
    EXPECT_TRUE(refused_for(flash_attn_varlen_kvcache(q.view(), k_cache.view(), v_heads.view(),
                                                      out.mutable_view(), {}, o),
                            "v_cache"));
    VarlenKvCacheOptions bad = o;
    bad.softcap = -1.0f;
    EXPECT_TRUE(refused_for(flash_attn_varlen_kvcache(q.view(), k_cache.view(), v_cache.view(),
                                                      out.mutable_view(), {}, bad),
                            "softcap"));
  }
}

}  // namespace
}  // namespace flashcte::test
