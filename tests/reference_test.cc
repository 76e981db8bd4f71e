// The oracle against hand-computed cases and against itself under exact identities of
// SEMANTICS.md (layouts, GQA, prefix vs. CP offset, strided CP vs. the global problem). Every
// kernel test trusts reference::attention, so it is pinned down here independently.
#include "src/reference/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

using reference::Result;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Dense float32 tensors filled from a list, in the given logical shape.
HostTensor f32(std::vector<int64_t> shape, const std::vector<double>& values) {
  HostTensor t(DType::kFloat32, shape);
  int64_t n = 0;
  const int64_t d1 = shape.size() > 1 ? shape[1] : 1, d2 = shape.size() > 2 ? shape[2] : 1;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < d1; ++b)
      for (int64_t c = 0; c < d2; ++c) t.set(a, b, c, values.at(n++));
  return t;
}

Options plain_options() {
  Options o;
  o.causal_mask = false;
  o.tp_k = true;  // k as (bs_kv, Skv, d), the same layout as the values in these hand cases
  return o;
}

TEST(HalfFloat, DecodesKnownPatterns) {
  const auto h = [](uint16_t bits) { return reference::load_element(&bits, DType::kFloat16, 0); };
  EXPECT_EQ(h(0x3C00), 1.0);
  EXPECT_EQ(h(0xC000), -2.0);
  EXPECT_EQ(h(0x3555), 0.25 * (1 + 0x155 / 1024.0));  // 0.333251953125
  EXPECT_EQ(h(0x7BFF), 65504.0);
  EXPECT_EQ(h(0x0400), std::ldexp(1.0, -14));  // smallest normal
  EXPECT_EQ(h(0x0001), std::ldexp(1.0, -24));  // smallest subnormal
  EXPECT_EQ(h(0x03FF), std::ldexp(1023.0, -24));
  EXPECT_EQ(h(0x7C00), kInf);
  EXPECT_EQ(h(0xFC00), -kInf);
  EXPECT_TRUE(std::isnan(h(0x7E00)));
  EXPECT_TRUE(std::isnan(h(0xFC01)));
  EXPECT_EQ(h(0x8000), 0.0);
  EXPECT_TRUE(std::signbit(h(0x8000)));
}

TEST(HalfFloat, EveryBitPatternRoundTrips) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const double x = reference::load_element(&h, DType::kFloat16, 0);
    if (std::isnan(x)) continue;
    ASSERT_EQ(reference::round_to_dtype(x, DType::kFloat16), x) << std::hex << bits;
    ASSERT_EQ(half::double_to_f16(x), h) << std::hex << bits;
  }
}

TEST(BFloat16, DecodesAsUpperHalfOfFloat32) {
  const auto b = [](uint16_t bits) { return reference::load_element(&bits, DType::kBFloat16, 0); };
  EXPECT_EQ(b(0x3F80), 1.0);
  EXPECT_EQ(b(0x4049), 3.140625);
  EXPECT_EQ(b(0x0001), std::ldexp(1.0, -133));  // subnormal
  EXPECT_EQ(b(0x7F80), kInf);
  EXPECT_TRUE(std::isnan(b(0x7FC1)));
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const double x = reference::load_element(&h, DType::kBFloat16, 0);
    if (std::isnan(x)) continue;
    ASSERT_EQ(reference::round_to_dtype(x, DType::kBFloat16), x) << std::hex << bits;
    ASSERT_EQ(half::double_to_bf16(x), h) << std::hex << bits;
  }
}

TEST(RoundToDtype, TiesToEvenSubnormalsAndOverflow) {
  const auto r16 = [](double x) { return reference::round_to_dtype(x, DType::kFloat16); };
  const auto rbf = [](double x) { return reference::round_to_dtype(x, DType::kBFloat16); };
  const double e = std::ldexp(1.0, -10);     // float16 ulp at 1
  EXPECT_EQ(r16(1 + e / 2), 1.0);            // tie, 1 is even
  EXPECT_EQ(r16(1 + 3 * e / 2), 1 + 2 * e);  // tie, 1 + 2e is even
  EXPECT_EQ(r16(1 + e / 2 + 1e-9), 1 + e);
  EXPECT_EQ(r16(-(1 + 3 * e / 2)), -(1 + 2 * e));
  EXPECT_EQ(r16(65519.0), 65504.0);
  EXPECT_EQ(r16(65520.0), kInf);  // the tie with 65536 goes to the even, out-of-range value
  EXPECT_EQ(r16(-1e6), -kInf);
  EXPECT_EQ(r16(std::ldexp(1.0, -25)), 0.0);                   // tie between 0 and 2^-24
  EXPECT_EQ(r16(std::ldexp(3.0, -25)), std::ldexp(1.0, -23));  // tie between 1 and 2 quanta
  EXPECT_EQ(r16(std::ldexp(1.4, -24)), std::ldexp(1.0, -24));
  const double b = std::ldexp(1.0, -7);  // bfloat16 ulp at 1
  EXPECT_EQ(rbf(1 + b / 2), 1.0);
  EXPECT_EQ(rbf(1 + 3 * b / 2), 1 + 2 * b);
  EXPECT_EQ(rbf(std::ldexp(255.0, 120)), std::ldexp(255.0, 120));  // largest finite
  EXPECT_EQ(rbf(std::ldexp(255.5, 120)), kInf);
  EXPECT_EQ(rbf(std::ldexp(3.0, -134)), std::ldexp(1.0, -132));  // subnormal tie to even
  EXPECT_EQ(reference::round_to_dtype(1 + std::ldexp(1.0, -24), DType::kFloat32), 1.0);
  EXPECT_TRUE(std::isnan(r16(std::nan(""))));
}

TEST(Reference, OneKeyGivesItsValue) {
  // One key: softmax is [1] whatever the score, so out = v exactly.
  HostTensor q = f32({1, 2, 3}, {0.125, -2, 3, 7, 8, 9});
  HostTensor k = f32({1, 1, 3}, {0.5, 0.25, -1});
  HostTensor v = f32({1, 1, 2}, {-1.5, 4});
  Result r;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), plain_options(), &r).ok);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(r.out_at(0, i, 0), -1.5);
    EXPECT_EQ(r.out_at(0, i, 1), 4.0);
    EXPECT_EQ(r.sum_recip[i], 1.0);
  }
  EXPECT_EQ(r.neg_max[0], -(0.0625 - 0.5 - 3));  // exact: every term is a short binary fraction
  EXPECT_DOUBLE_EQ(r.lse[1], 3.5 + 2 - 9);
}

TEST(Reference, EqualScoresAverageTheValues) {
  HostTensor q = f32({1, 1, 2}, {0, 0});
  HostTensor k = f32({1, 4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  HostTensor v = f32({1, 4, 1}, {1, 2, 4, 9});
  Result r;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), plain_options(), &r).ok);
  EXPECT_DOUBLE_EQ(r.out_at(0, 0, 0), 4.0);
  EXPECT_EQ(r.neg_max[0], 0.0);
  EXPECT_DOUBLE_EQ(r.sum_recip[0], 0.25);
  EXPECT_DOUBLE_EQ(r.lse[0], std::log(4.0));
}

TEST(Reference, CausalTwoByTwoByHand) {
  // d = 1: scores s[i][j] = scale * q_i * k_j.
  const double q0 = 0.5, q1 = -1.25, k0 = 2, k1 = 0.75, v0 = 3, v1 = -5;
  HostTensor q = f32({1, 2, 1}, {q0, q1});
  HostTensor k = f32({1, 2, 1}, {k0, k1});
  HostTensor v = f32({1, 2, 1}, {v0, v1});
  Options o = plain_options();
  o.causal_mask = true;
  o.scale = 0.8f;
  const double s = o.scale;  // the float32 scale the oracle reads
  Result r;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &r).ok);
  // Row 0 sees only key 0; row 1 sees both.
  EXPECT_EQ(r.out_at(0, 0, 0), v0);
  const double a = s * q1 * k0, b = s * q1 * k1;
  const double m = std::max(a, b);
  const double sum = std::exp(a - m) + std::exp(b - m);
  EXPECT_NEAR(r.out_at(0, 1, 0), (std::exp(a - m) * v0 + std::exp(b - m) * v1) / sum, 1e-15);
  EXPECT_NEAR(r.neg_max[1], -m, 1e-15);
  EXPECT_NEAR(r.sum_recip[1], 1 / sum, 1e-15);
  EXPECT_NEAR(r.lse[1], m + std::log(sum), 1e-15);
  EXPECT_NEAR(r.neg_max[0], -s * q0 * k0, 1e-15);
}

TEST(Reference, SinkIsUnscaledAndHasNoValue) {
  const double qk = 1.5, z = 0.75;  // exactly representable in float32
  HostTensor q = f32({1, 1, 1}, {1.0});
  HostTensor k = f32({1, 1, 1}, {qk});
  HostTensor v = f32({1, 1, 1}, {2.0});
  HostTensor sink = f32({1, 1}, {z});
  Options o = plain_options();
  o.scale = 3.0f;
  o.sink = sink.view();
  Result r;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &r).ok);
  const double s = 3 * qk;  // 4.5 > z: the key holds the max
  EXPECT_NEAR(r.out_at(0, 0, 0), 2.0 * std::exp(s) / (std::exp(s) + std::exp(z)), 1e-14);
  EXPECT_DOUBLE_EQ(r.neg_max[0], -s);
  EXPECT_NEAR(r.sum_recip[0], 1 / (1 + std::exp(z - s)), 1e-15);
  // A sink far above every score takes all the probability mass: out ~ 0, max = sink.
  HostTensor big = f32({1, 1}, {1000.0});
  o.sink = big.view();
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &r).ok);
  EXPECT_LT(std::fabs(r.out_at(0, 0, 0)), 1e-300);
  EXPECT_EQ(r.neg_max[0], -1000.0);
  EXPECT_EQ(r.sum_recip[0], 1.0);
}

TEST(Reference, EmptyRowsAreZeroWithInfiniteStats) {
  // Packing bounds [1, 1) leave row 0 nothing; row 1 keeps [0, 2).
  HostTensor q = f32({1, 2, 1}, {1, 1});
  HostTensor k = f32({1, 2, 1}, {1, 2});
  HostTensor v = f32({1, 2, 1}, {5, 6});
  HostTensor lo(DType::kInt64, {2, 1}), hi(DType::kInt64, {2, 1});
  lo.set_raw_int(0, 0, 1);
  hi.set_raw_int(0, 0, 1);
  lo.set_raw_int(1, 0, 0);
  hi.set_raw_int(1, 0, 2);
  Options o = plain_options();
  o.bound_min = lo.view();
  o.bound_max = hi.view();
  Result r;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &r).ok);
  EXPECT_EQ(r.out_at(0, 0, 0), 0.0);
  EXPECT_EQ(r.neg_max[0], kInf);
  EXPECT_EQ(r.sum_recip[0], kInf);
  EXPECT_EQ(r.lse[0], -kInf);
  EXPECT_NEAR(r.out_at(0, 1, 0), (5 * std::exp(-1.0) + 6) / (std::exp(-1.0) + 1), 1e-14);
  // The same empty row with a sink: the sink alone fills it, and has no value.
  HostTensor sink = f32({1, 1}, {-3.0});
  o.sink = sink.view();
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &r).ok);
  EXPECT_EQ(r.out_at(0, 0, 0), 0.0);
  EXPECT_EQ(r.neg_max[0], 3.0);
  EXPECT_EQ(r.sum_recip[0], 1.0);
  EXPECT_EQ(r.lse[0], -3.0);
}

TEST(Reference, WindowOfOneSeesOnlyItsOwnPosition) {
  Case c;
  c.sq = c.skv = 9;
  c.d = 4;
  c.options.sliding_window = 1;
  CaseTensors t;
  build_tensors(c, &t);
  Result r;
  ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &r).ok);
  for (int64_t i = 0; i < c.sq; ++i)
    for (int64_t ch = 0; ch < c.d; ++ch) EXPECT_EQ(r.out_at(0, i, ch), t.v.get(0, i, ch));
}

// The same logical inputs in every layout and transpose must give bit-identical oracle results.
TEST(Reference, LayoutsAndTransposesDoNotChangeTheResult) {
  Case base;
  base.bs = 2;
  base.sq = 7;
  base.skv = 11;
  base.d = 5;
  base.dv = 3;
  base.dist = Dist::kNormal;
  Result want;
  {
    CaseTensors t;
    build_tensors(base, &t);
    ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &want).ok);
  }
  for (Layout layout : {Layout::kPadded, Layout::kStrided, Layout::kReversed}) {
    for (int tp = 0; tp < 4; ++tp) {
      Case c = base;
      c.q_layout = c.k_layout = c.v_layout = layout;
      c.options.tp_q = tp & 1;
      c.options.tp_k = tp & 2;
      CaseTensors t;
      build_tensors(c, &t);
      Result r;
      ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &r).ok);
      EXPECT_EQ(r.out, want.out) << layout_name(layout) << " tp=" << tp;
      EXPECT_EQ(r.lse, want.lse);
    }
  }
}

// GQA: query batch b against KV batch b / group equals a separate call on that KV batch.
TEST(Reference, GqaReadsKvBatchOfItsGroup) {
  Case c;
  c.bs = 6;
  c.bs_kv = 2;
  c.sq = 5;
  c.skv = 6;
  c.d = 3;
  c.dist = Dist::kNormal;
  CaseTensors t;
  build_tensors(c, &t);
  Result all;
  ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &all).ok);
  for (int64_t b = 0; b < c.bs; ++b) {
    TensorView q1 = t.q.view(), k1 = t.k.view(), v1 = t.v.view();
    q1.data = static_cast<const float*>(q1.data) + b * q1.strides[0];
    q1.shape[0] = 1;
    k1.data = static_cast<const float*>(k1.data) + (b / 3) * k1.strides[0];
    k1.shape[0] = 1;
    v1.data = static_cast<const float*>(v1.data) + (b / 3) * v1.strides[0];
    v1.shape[0] = 1;
    Result one;
    ASSERT_TRUE(reference::attention(q1, k1, v1, t.options, &one).ok);
    for (int64_t i = 0; i < c.sq; ++i)
      for (int64_t ch = 0; ch < c.d; ++ch) {
        EXPECT_EQ(one.out_at(0, i, ch), all.out_at(b, i, ch)) << b << " " << i;
      }
  }
}

// A prefix of length u shifts key positions by -u; so does a CP offset of u on the queries.
// Causal attention over concat(prior[:u], k) must therefore equal causal attention over the same
// keys passed as one tensor with cp_offset = u. Exercises prior_used_len < S_prior too.
TEST(Reference, PrefixEqualsConcatenatedKeysWithOffset) {
  Case c;
  c.sq = 6;
  c.skv = 6;
  c.d = 4;
  c.has_prior = true;
  c.s_prior = 7;
  c.options.prior_used_len = {5};
  c.options.sliding_window = 4;
  c.dist = Dist::kNormal;
  c.options.tp_k = true;
  CaseTensors t;
  build_tensors(c, &t);
  Result with_prior;
  ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &with_prior).ok);

  const int64_t used = 5, total = used + c.skv;
  HostTensor k(DType::kFloat32, {1, total, c.d}), v(DType::kFloat32, {1, total, c.d});
  for (int64_t j = 0; j < total; ++j)
    for (int64_t ch = 0; ch < c.d; ++ch) {
      k.set(0, j, ch, j < used ? t.k_prior.get(0, j, ch) : t.k.get(0, j - used, ch));
      v.set(0, j, ch, j < used ? t.v_prior.get(0, j, ch) : t.v.get(0, j - used, ch));
    }
  Options o = c.options;
  o.prior_used_len.clear();
  o.cp_offset = used;
  Result concat;
  ASSERT_TRUE(reference::attention(t.q.view(), k.view(), v.view(), o, &concat).ok);
  EXPECT_EQ(with_prior.out, concat.out);
  EXPECT_EQ(with_prior.lse, concat.lse);
}

// Strided CP: rank r of degree D holds global rows r, r + D, ...; its output must equal those
// rows of the global causal problem. Contiguous CP likewise with rows [r*n, (r+1)*n).
TEST(Reference, ContextParallelRowsMatchTheGlobalProblem) {
  Case g;
  g.sq = g.skv = 12;
  g.d = 3;
  g.dist = Dist::kNormal;
  CaseTensors gt;
  build_tensors(g, &gt);
  Result global;
  ASSERT_TRUE(reference::attention(gt.q.view(), gt.k.view(), gt.v.view(), gt.options, &global).ok);
  const int64_t deg = 4, n = 3;
  for (bool strided : {false, true}) {
    for (int64_t rank : {int64_t{0}, deg - 1}) {
      HostTensor q(DType::kFloat32, {1, n, g.d});
      std::vector<int64_t> rows;
      for (int64_t i = 0; i < n; ++i) rows.push_back(strided ? rank + i * deg : rank * n + i);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t ch = 0; ch < g.d; ++ch) q.set(0, i, ch, gt.q.get(0, rows[i], ch));
      Options o = g.options;
      o.global_cp_deg = deg;
      o.cp_offset = strided ? rank : rank * n;
      o.cp_strided_q_slicing = strided;
      Result local;
      ASSERT_TRUE(reference::attention(q.view(), gt.k.view(), gt.v.view(), o, &local).ok);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(local.out_at(0, i, 0), global.out_at(0, rows[i], 0));
        EXPECT_EQ(local.lse[i], global.lse[rows[i]]);
      }
    }
  }
}

TEST(Reference, RowSubsetMatchesFullRun) {
  Case c;
  c.bs = 2;
  c.sq = 10;
  c.skv = 13;
  c.d = 3;
  c.sink = true;
  c.dtype = DType::kBFloat16;
  CaseTensors t;
  build_tensors(c, &t);
  const std::vector<int64_t> rows = {9, 0, 4};
  Result full, part, plain_full, plain_part;
  ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &full).ok);
  ASSERT_TRUE(
      reference::attention_rows(t.q.view(), t.k.view(), t.v.view(), t.options, rows, &part).ok);
  ASSERT_TRUE(
      reference::attention_plain(t.q.view(), t.k.view(), t.v.view(), t.options, &plain_full).ok);
  ASSERT_TRUE(reference::attention_plain_rows(t.q.view(), t.k.view(), t.v.view(), t.options, rows,
                                              &plain_part)
                  .ok);
  ASSERT_EQ(part.seqlen_q, 3);
  for (int64_t b = 0; b < c.bs; ++b)
    for (size_t r = 0; r < rows.size(); ++r) {
      EXPECT_EQ(part.out_at(b, r, 1), full.out_at(b, rows[r], 1));
      EXPECT_EQ(part.neg_max[b * 3 + r], full.neg_max[b * c.sq + rows[r]]);
      EXPECT_EQ(plain_part.out_at(b, r, 2), plain_full.out_at(b, rows[r], 2));
    }
  EXPECT_FALSE(
      reference::attention_rows(t.q.view(), t.k.view(), t.v.view(), t.options, {10}, &part).ok);
}

TEST(Reference, BoundDtypesAgree) {
  Case c;
  c.sq = c.skv = 12;
  c.d = 3;
  c.pack_lengths = {5, 3, 4};
  Result want;
  for (DType bt : {DType::kInt32, DType::kInt64, DType::kFloat32}) {
    for (bool rank1 : {false, true}) {
      c.bound_dtype = bt;
      c.bound_rank1 = rank1;
      CaseTensors t;
      build_tensors(c, &t);
      Result r;
      ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &r).ok);
      if (want.out.empty()) want = r;
      EXPECT_EQ(r.out, want.out) << dtype_name(bt);
    }
  }
  // Packing under the causal mask: row 5 starts the second sequence and sees key 5 only.
  CaseTensors t;
  build_tensors(c, &t);
  Result r;
  ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &r).ok);
  for (int64_t ch = 0; ch < c.d; ++ch) EXPECT_EQ(r.out_at(0, 5, ch), t.v.get(0, 5, ch));
}

// The plain implementation is the yardstick of the low-precision tolerance: in float32 it must
// agree closely with the oracle, and in bf16 / fp16 its error must be of the dtype's order.
TEST(Reference, PlainErrorIsOfTheDtypesOrder) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    Case c;
    c.dtype = dt;
    c.bs = 2;
    c.sq = 33;
    c.skv = 47;
    c.d = 16;
    c.sink = true;
    c.sink_lo = 1;
    c.sink_hi = 4;
    CaseTensors t;
    build_tensors(c, &t);
    Result exact, plain;
    ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &exact).ok);
    ASSERT_TRUE(
        reference::attention_plain(t.q.view(), t.k.view(), t.v.view(), t.options, &plain).ok);
    double err = 0, m = 0;
    for (size_t i = 0; i < exact.out.size(); ++i) {
      err = std::max(err, abs_error(plain.out[i], exact.out[i]));
      m = std::max(m, std::fabs(exact.out[i]));
    }
    if (dt == DType::kFloat32) {
      EXPECT_LT(err, 1e-6 * m);
    } else {
      const double u = std::ldexp(1.0, dt == DType::kBFloat16 ? -8 : -11);
      EXPECT_GT(err, 0.1 * u * m) << dtype_name(dt);  // it does round
      EXPECT_LT(err, 8 * u * m) << dtype_name(dt);    // a few roundings, no more
    }
  }
}

TEST(Reference, RejectsUninterpretableInput) {
  HostTensor q = f32({1, 2, 3}, {1, 2, 3, 4, 5, 6});
  HostTensor k = f32({1, 2, 3}, {1, 2, 3, 4, 5, 6});
  HostTensor v = f32({1, 2, 3}, {1, 2, 3, 4, 5, 6});
  HostTensor bad = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  Result r;
  EXPECT_FALSE(reference::attention(bad.view(), k.view(), v.view(), plain_options(), &r).ok);
  Options o = plain_options();
  o.tp_k = false;  // k read as (1, d=2, Skv=3): head dim differs from q's
  EXPECT_FALSE(reference::attention(q.view(), k.view(), v.view(), o, &r).ok);
  EXPECT_TRUE(reference::attention(q.view(), k.view(), v.view(), plain_options(), &r).ok);
}

}  // namespace
}  // namespace flashcte::test
