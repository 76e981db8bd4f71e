// The API surface around the math: invalid arguments come back as a Status (never an
// exception), and plan_attention's tile accounting matches what the mask model implies.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---- validation --------------------------------------------------------------------------------

// A valid call, to be broken one argument at a time.
struct ValidCall {
  HostTensor q{DType::kFloat32, {2, 16, 8}};
  HostTensor k{DType::kFloat32, {2, 8, 16}};  // (bs_kv, d, Skv): tp_k defaults to false
  HostTensor v{DType::kFloat32, {2, 16, 8}};
  HostTensor out{DType::kFloat32, {2, 16, 8}};
  Options options;
  Outputs outputs;
  ValidCall() {
    for (HostTensor* t : {&q, &k, &v})
      for (int64_t a = 0; a < 2; ++a)
        for (int64_t b = 0; b < t->shape()[1]; ++b)
          for (int64_t c = 0; c < t->shape()[2]; ++c) t->set(a, b, c, 0.25 * ((a + b + c) % 5));
    outputs.out = out.mutable_view();
  }
  HostTensor* out_tensor = &out;  // the storage behind outputs.out, unless a test aliases it
  // Runs the call; a refused one must leave q, k, v and the output (NaN beforehand) as they were.
  Status run(const TensorView& qv, const TensorView& kv) {
    BufferSnapshot snap;
    snap.add("q", q.bytes()).add("k", k.bytes()).add("v", v.bytes());
    snap.add_output("out", out_tensor->mutable_view().data, out_tensor->bytes().size());
    Status s;
    EXPECT_NO_THROW(s = attention_cte(qv, kv, v.view(), outputs, options));
    if (!s.ok) {
      EXPECT_TRUE(snap.unchanged()) << s.message;
    }
    return s;
  }
  Status run() { return run(q.view(), k.view()); }
};

TEST(Validation, TheValidCallSucceeds) {
  ValidCall call;
  const Status s = call.run();
  EXPECT_TRUE(s.ok) << s.message;
}

TEST(Validation, WrongRankIsAnError) {
  ValidCall call;
  HostTensor q2(DType::kFloat32, {16, 8});
  EXPECT_TRUE(refused_for(call.run(q2.view(), call.k.view()), "q"));
}

TEST(Validation, MixedDtypesAreAnError) {
  ValidCall call;
  HostTensor k16(DType::kBFloat16, {2, 8, 16});
  EXPECT_TRUE(refused_for(call.run(call.q.view(), k16.view()), "k"));
}

TEST(Validation, BatchNotAMultipleOfKvBatchIsAnError) {
  ValidCall call;
  HostTensor q3(DType::kFloat32, {3, 16, 8});
  HostTensor out3(DType::kFloat32, {3, 16, 8});
  call.outputs.out = out3.mutable_view();
  call.out_tensor = &out3;
  EXPECT_TRUE(refused_for(call.run(q3.view(), call.k.view()), "q"));
}

TEST(Validation, CacheSoftmaxWithoutStatisticsIsAnError) {
  ValidCall call;
  call.options.cache_softmax = true;
  EXPECT_TRUE(refused_for(call.run(), "neg_max"));
}

TEST(Validation, HalfAPairOfBoundsIsAnError) {
  ValidCall call;
  HostTensor lo(DType::kInt32, {16, 1});
  call.options.bound_min = lo.view();
  EXPECT_TRUE(refused_for(call.run(), "bound_max"));
}

// FlashAttention accepts 0 query heads over any number of KV heads (0 is a multiple of every
// count): an empty call that writes nothing, on the prefill kernel (rank 3 and 4) and through
// flash_attn_with_kvcache's prefill path (more than 16 new tokens), with the cache still
// appended. It divided by the GQA group of 0 (SIGFPE; found by python/tests/test_fuzz_serving.py).
TEST(Validation, ZeroQueryHeadsOverKvHeadsIsAnEmptyCall) {
  HostTensor q(DType::kFloat32, {0, 4, 8}), k(DType::kFloat32, {1, 8, 4});
  HostTensor v(DType::kFloat32, {1, 4, 8}), out(DType::kFloat32, {0, 4, 8});
  Outputs outputs;
  outputs.out = out.mutable_view();
  Status s = attention_cte(q.view(), k.view(), v.view(), outputs, Options{});
  EXPECT_TRUE(s.ok) << s.message;
  PlanSummary plan;
  s = plan_attention(q.view(), k.view(), v.view(), Options{}, &plan);
  EXPECT_TRUE(s.ok) << s.message;
  EXPECT_EQ(plan.work_items, 0);

  std::vector<float> q4, k4(2 * 3 * 4 * 8, 0.5f), v4(2 * 3 * 4 * 8, 0.25f), out4;
  Outputs outputs4;
  outputs4.out = MutableTensorView::contiguous(out4.data(), DType::kFloat32, {2, 0, 4, 8});
  s = attention_cte(TensorView::contiguous(q4.data(), DType::kFloat32, {2, 0, 4, 8}),
                    TensorView::contiguous(k4.data(), DType::kFloat32, {2, 3, 8, 4}),
                    TensorView::contiguous(v4.data(), DType::kFloat32, {2, 3, 4, 8}), outputs4,
                    Options{});
  EXPECT_TRUE(s.ok) << s.message;

  // (batch 1, 17 new tokens, 0 heads, d 8) over a (1, 32, 1, 8) cache holding 0 tokens.
  std::vector<float> kq, kc(32 * 8, 0.0f), vc(32 * 8, 0.0f), kn(17 * 8), vn(17 * 8), kout;
  for (size_t i = 0; i < kn.size(); ++i) kn[i] = vn[i] = 0.125f * static_cast<float>(i % 7);
  std::vector<int32_t> seqlens = {0};
  KvCacheOptions o;
  o.k = TensorView::contiguous(kn.data(), DType::kFloat32, {1, 17, 1, 8});
  o.v = TensorView::contiguous(vn.data(), DType::kFloat32, {1, 17, 1, 8});
  o.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {1});
  s = flash_attn_with_kvcache(
      TensorView::contiguous(kq.data(), DType::kFloat32, {1, 17, 0, 8}),
      MutableTensorView::contiguous(kc.data(), DType::kFloat32, {1, 32, 1, 8}),
      MutableTensorView::contiguous(vc.data(), DType::kFloat32, {1, 32, 1, 8}),
      MutableTensorView::contiguous(kout.data(), DType::kFloat32, {1, 17, 0, 8}), {}, o);
  EXPECT_TRUE(s.ok) << s.message;
  EXPECT_TRUE(std::equal(kn.begin(), kn.end(), kc.begin())) << "k not appended";
  EXPECT_TRUE(std::equal(vn.begin(), vn.end(), vc.begin())) << "v not appended";
}

TEST(Validation, OutputAliasingAnInputIsAnError) {
  ValidCall call;
  MutableTensorView alias = call.out.mutable_view();
  alias.data = const_cast<void*>(call.v.view().data);
  call.outputs.out = alias;
  EXPECT_TRUE(refused_for(call.run(), "out"));
}

// ---- plan_attention ----------------------------------------------------------------------------

// Tile edge of the plan tests, for both q_block and kv_tile. PlanSummary counts (query
// sub-block, kv tile) pairs "as the kernel plans them"; a q_block of 32 stays at or below the
// kernel's sub-block (48 rows today), so each sub-block is a whole q block and the counts follow
// from the mask model alone. Every length below is a multiple of kT, so the counts are exact.
constexpr int64_t kT = 32;

struct PlanCase {
  int64_t bs = 1, sq = 8 * kT, skv = 8 * kT, d = 32, dv = 32, s_prior = 0;
  Options options;
  std::vector<int64_t> bound_lo, bound_hi;  // packing, over the concatenated KV axis
};

// Counts the unmasked (query, key) pairs by SEMANTICS step 3, one pair at a time.
int64_t useful_pairs(const PlanCase& p) {
  const Options& o = p.options;
  const int64_t used = o.prior_used_len.empty() ? p.s_prior : o.prior_used_len[0];
  const int64_t stride = o.cp_strided_q_slicing ? *o.global_cp_deg : 1;
  int64_t pairs = 0;
  for (int64_t i = 0; i < p.sq; ++i) {
    const int64_t q_pos = o.cp_offset.value_or(0) + i * stride;
    for (int64_t j = 0; j < used + p.skv; ++j) {
      const int64_t diff = j - used - q_pos;
      if (o.causal_mask && diff > 0) continue;
      if (o.sliding_window > 0 && diff <= -o.sliding_window) continue;
      if (!p.bound_lo.empty() && (j < p.bound_lo[i] || j >= p.bound_hi[i])) continue;
      ++pairs;
    }
  }
  return pairs * p.bs;
}

// Shapes only: q, k and v carry null data, as plan_attention allows.
Status plan(const PlanCase& p, PlanSummary* s) {
  auto shape_only = [](std::vector<int64_t> shape) {
    return TensorView{nullptr,
                      DType::kFloat32,
                      3,
                      {shape[0], shape[1], shape[2]},
                      {shape[1] * shape[2], shape[2], 1}};
  };
  Options o = p.options;
  HostTensor kp, vp, lo, hi;
  if (p.s_prior > 0) {
    kp = HostTensor(DType::kFloat32, {p.bs, p.d, p.s_prior});
    vp = HostTensor(DType::kFloat32, {p.bs, p.s_prior, p.dv});
    o.k_prior = kp.view();
    o.v_prior = vp.view();
  }
  if (!p.bound_lo.empty()) {
    lo = HostTensor(DType::kInt64, {p.sq, 1});
    hi = HostTensor(DType::kInt64, {p.sq, 1});
    for (int64_t i = 0; i < p.sq; ++i) {
      lo.set_raw_int(i, 0, p.bound_lo[i]);
      hi.set_raw_int(i, 0, p.bound_hi[i]);
    }
    o.bound_min = lo.view();
    o.bound_max = hi.view();
  }
  return plan_attention(shape_only({p.bs, p.sq, p.d}), shape_only({p.bs, p.d, p.skv}),
                        shape_only({p.bs, p.skv, p.dv}), o, s);
}

// Expected counts come from the mask model of ARCHITECTURE.md: with kT x kT tiles, a tile is
// skipped when no row of its Q block reaches it, full when every row covers it, masked otherwise.
void expect_plan(const PlanCase& p, int64_t full, int64_t masked, int64_t skipped) {
  PlanSummary s;
  const Status st = plan(p, &s);
  ASSERT_TRUE(st.ok) << st.message;
  EXPECT_EQ(s.batch, p.bs);
  EXPECT_EQ(s.seqlen_q, p.sq);
  EXPECT_EQ(s.seqlen_kv,
            p.skv + (p.options.prior_used_len.empty() ? p.s_prior : p.options.prior_used_len[0]));
  EXPECT_EQ(s.head_dim, p.d);
  EXPECT_EQ(s.value_dim, p.dv);
  EXPECT_EQ(s.tiles.q_block, kT);
  EXPECT_EQ(s.tiles.kv_tile, kT);
  EXPECT_EQ(s.q_blocks, p.sq / kT);
  EXPECT_EQ(s.kv_tiles, s.seqlen_kv / kT);
  EXPECT_EQ(s.tiles_full, full * p.bs);
  EXPECT_EQ(s.tiles_masked, masked * p.bs);
  EXPECT_EQ(s.tiles_skipped, skipped * p.bs);
  EXPECT_GT(s.work_items, 0);
  EXPECT_GE(s.threads, 1);
  const double per_pair = 4.0 * (p.d + p.dv) / 2;
  EXPECT_DOUBLE_EQ(s.flops_dense, per_pair * p.sq * s.seqlen_kv * p.bs);
  EXPECT_DOUBLE_EQ(s.flops_useful, per_pair * useful_pairs(p));
  EXPECT_LE(s.flops_useful, s.flops_done);
}

PlanCase plan_case(bool causal) {
  PlanCase p;
  p.bs = 2;
  p.options.causal_mask = causal;
  p.options.tiles = TileConfig{kT, kT, 0, 0};
  return p;
}

TEST(Plan, NotCausalComputesEveryTileUnmasked) { expect_plan(plan_case(false), 64, 0, 0); }

TEST(Plan, CausalSkipsTheUpperTriangle) {
  // 8 x 8 tiles: 28 below the diagonal, 8 on it, 28 above.
  expect_plan(plan_case(true), 28, 8, 28);
}

TEST(Plan, SlidingWindowSkipsOldTiles) {
  // Window kT: block b reaches tiles b-1 (partially) and b (the diagonal); the rest are skipped.
  PlanCase p = plan_case(true);
  p.options.sliding_window = kT;
  expect_plan(p, 0, 1 + 2 * 7, 64 - 15);
}

TEST(Plan, PackingSkipsOtherSequences) {
  // Four causal sequences of 2 kT rows: per sequence two diagonal tiles and one full tile.
  PlanCase p = plan_case(true);
  for (int64_t i = 0; i < p.sq; ++i) {
    p.bound_lo.push_back(i / (2 * kT) * (2 * kT));
    p.bound_hi.push_back(i / (2 * kT) * (2 * kT) + 2 * kT);
  }
  expect_plan(p, 4, 8, 64 - 12);
}

TEST(Plan, PrefixTilesAreFullUnderCausal) {
  // 2 kT prior keys (2 tiles, never causally masked) then a causal 4 kT x 4 kT problem.
  PlanCase p = plan_case(true);
  p.sq = p.skv = 4 * kT;
  p.s_prior = 2 * kT;
  expect_plan(p, 4 * 2 + 6, 4, 24 - 18);
  p.options.prior_used_len = {kT};  // one prior tile
  expect_plan(p, 4 * 1 + 6, 4, 20 - 14);
}

TEST(Plan, ContiguousCpKeepsTheCausalSkip) {
  // Rank 1 of 2: positions 4 kT .. 8 kT - 1 against 8 kT keys. The Neuron kernel drops its
  // causal skip here; the mask model keeps it.
  PlanCase p = plan_case(true);
  p.sq = 4 * kT;
  p.options.global_cp_deg = 2;
  p.options.cp_offset = 4 * kT;
  expect_plan(p, 16 + 6, 4, 32 - 26);
}

TEST(Plan, StridedCpRankZero) {
  // Positions 0, 4, ..., 8 kT - 4: block 0 (positions 0 .. 4 kT - 4) straddles tiles 0-3 and
  // skips 4-7; block 1 (4 kT .. 8 kT - 4) covers tiles 0-3 whole and straddles 4-7.
  PlanCase p = plan_case(true);
  p.sq = 2 * kT;
  p.options.global_cp_deg = 4;
  p.options.cp_offset = 0;
  p.options.cp_strided_q_slicing = true;
  expect_plan(p, 4, 8, 4);
}

TEST(Plan, InvalidArgumentsAreAnError) {
  PlanCase p = plan_case(true);
  p.options.sliding_window = -1;
  PlanSummary s;
  Status st;
  EXPECT_NO_THROW(st = plan(p, &s));
  EXPECT_TRUE(refused_for(st, "sliding_window"));
}

// The automatic tiles (src/kernel/plan.cc): 768 query rows per packed K/V tile, so 384-row
// blocks for MHA and 192 from a GQA group of 4 up; blocks halve (down to 48 rows) while the Q and
// O scratch, group x q_block x (d + dv) floats, would pass 2^21 floats (8 MiB); the KV tile
// halves from 256 keys while K + V of a tile pass 65536 floats.
// float32: MHA blocks of 384 rows on 8-lane targets (AVX2) and 768 on 16-lane ones (AVX-512).
TEST(Plan, AutomaticTilesFollowTheGroupAndHeadDims) {
  const bool wide = simd::ops().lanes >= 16;
  struct Want {
    int64_t bs, bs_kv, d, q_block, wide_q_block, kv_tile;
  };
  for (const Want& w : {Want{8, 8, 128, 384, 768, 256}, Want{8, 4, 128, 384, 384, 256},
                        Want{32, 8, 128, 192, 192, 256}, Want{64, 8, 128, 192, 192, 256},
                        Want{8, 8, 64, 384, 768, 256}, Want{8, 8, 256, 384, 768, 128},
                        Want{8, 8, 1024, 384, 768, 32}, Want{16, 1, 1024, 48, 48, 32},
                        Want{16, 2, 512, 192, 192, 64}, Want{16, 2, 1024, 96, 96, 32}}) {
    const auto shape_only = [](int64_t a, int64_t b, int64_t c) {
      return TensorView{nullptr, DType::kFloat32, 3, {a, b, c}, {b * c, c, 1}};
    };
    const int64_t s_len = 1024;
    PlanSummary s;
    const Status st = plan_attention(shape_only(w.bs, s_len, w.d), shape_only(w.bs_kv, w.d, s_len),
                                     shape_only(w.bs_kv, s_len, w.d), Options{}, &s);
    ASSERT_TRUE(st.ok) << st.message;
    SCOPED_TRACE("bs " + std::to_string(w.bs) + ", bs_kv " + std::to_string(w.bs_kv) + ", d " +
                 std::to_string(w.d) + (wide ? ", 16 lanes" : ", 8 lanes"));
    EXPECT_EQ(s.tiles.q_block, wide ? w.wide_q_block : w.q_block);
    EXPECT_EQ(s.tiles.kv_tile, w.kv_tile);
    const int64_t group = w.bs / w.bs_kv;
    EXPECT_LE(group * s.tiles.q_block * 2 * w.d, int64_t{2} << 20) << "Q+O scratch bound";
  }
}

// bfloat16 where it runs on the native vdpbf16ps kernels (simd::native_ops_for: AVX512_BF16 on
// AMD): MHA blocks up to 768 rows, and KV tiles of up to 512 keys (the pairs take half the bytes);
// elsewhere (widened to float32, e.g. capped at AVX2) the float32 tiles: MHA blocks of 768 rows
// on 16-lane targets, 384 on 8-lane ones.
TEST(Plan, AutomaticTilesOfTheNativeBf16Path) {
  const bool native = simd::native_ops_for(simd::ops()) != nullptr;
  const bool wide = simd::ops().lanes >= 16;
  struct Want {
    int64_t bs, bs_kv, d, q_block, kv_tile, widened_q_block, widened_kv_tile;
  };
  const int64_t mha_widened = wide ? 768 : 384;
  for (const Want& w :
       {Want{8, 8, 128, 768, 512, mha_widened, 256}, Want{8, 4, 128, 384, 512, 384, 256},
        Want{32, 8, 128, 192, 512, 192, 256}, Want{8, 8, 256, 768, 256, mha_widened, 128},
        Want{16, 2, 512, 192, 128, 192, 64}}) {
    const auto shape_only = [](int64_t a, int64_t b, int64_t c) {
      return TensorView{nullptr, DType::kBFloat16, 3, {a, b, c}, {b * c, c, 1}};
    };
    const int64_t s_len = 1024;
    PlanSummary s;
    const Status st = plan_attention(shape_only(w.bs, s_len, w.d), shape_only(w.bs_kv, w.d, s_len),
                                     shape_only(w.bs_kv, s_len, w.d), Options{}, &s);
    ASSERT_TRUE(st.ok) << st.message;
    SCOPED_TRACE("bs " + std::to_string(w.bs) + ", bs_kv " + std::to_string(w.bs_kv) + ", d " +
                 std::to_string(w.d) + (native ? ", native" : ", widened"));
    EXPECT_EQ(s.tiles.q_block, native ? w.q_block : w.widened_q_block);
    EXPECT_EQ(s.tiles.kv_tile, native ? w.kv_tile : w.widened_kv_tile);
  }
}

}  // namespace
}  // namespace flashcte::test
