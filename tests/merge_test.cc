// merge_attn_states (include/flashcte/merge.h) against a float64 merge of the same float32
// inputs, and against attention_cte itself: attention over the keys K1 | K2 equals the merge of
// attention over K1 and over K2 (sinks, causal rows that see nothing on one side: that test and
// the bad arguments are in merge_split_test.cc, the sides in merge_cases.h).
//
// Tolerances. The merge is exact arithmetic up to a few float32 roundings per element: the weight
// of the smaller side exp(lse_min - lse_max) (one exp, ~1 ulp), the sum 1 + w, one reciprocal, a
// multiply and an add (or one fused multiply-add) and a multiply for out; lse = max + log(sum)
// (the log ~1 ulp of log(sum) <= log 2, the add half an ulp of lse, w's error at most half an
// ulp). In units of u = 2^-24 (half an ulp of 1): |out - exact| <= 6 u max(|out_a|, |out_b|) over
// the row, |lse - exact| <= 3 u max(|lse|, 1) (kOutUnits, kLseUnits; measured 2.8 u and 1.2 u,
// printed by MergeTest.MatchesFloat64). Against attention_cte on the whole key set the rule is
// the suite's float32 rule, 1e-5 of the largest output (test_util.cc).
#include "flashcte/merge.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/half.h"
#include "tests/merge_cases.h"

namespace flashcte {
namespace {

using test::kInf;
using test::State;

constexpr double kUnit = 1.0 / (1 << 24);  // u: half an ulp of 1 in float32
constexpr double kOutUnits = 6, kLseUnits = 3;

// The float64 merge of row i (flat index over batch*rows).
void reference_row(const State& a, const State& b, int64_t i, std::vector<double>* out,
                   double* lse) {
  const double la = a.lse[i], lb = b.lse[i];
  out->assign(a.dv, 0.0);
  if (la == -kInf && lb == -kInf) {
    *lse = -kInf;
    return;
  }
  const double m = std::max(la, lb);
  *lse = m + std::log(std::exp(la - m) + std::exp(lb - m));
  const double wa = std::exp(la - *lse), wb = std::exp(lb - *lse);
  for (int64_t c = 0; c < a.dv; ++c) {
    (*out)[c] = wa * a.out[i * a.dv + c] + wb * b.out[i * b.dv + c];
  }
}

// Random sides: lse in [-30, 30] shifted by a per-row level (up to 1e4), with rows empty on a,
// on b or on both, and rows whose two sides are 10, 80 (the weight near float32's smallest
// normal), 100 (subnormal) and 200 (underflow to 0) apart.
void fill(std::mt19937& rng, State* a, State* b) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-30.0f, 30.0f);
  for (float& x : a->out) x = normal(rng);
  for (float& x : b->out) x = 3.0f * normal(rng);
  const float levels[] = {0.0f, 0.0f, 1.0f, -500.0f, 1e4f};
  const float gaps[] = {10.0f, 80.0f, 100.0f, 200.0f};
  const int64_t n = a->batch * a->rows;
  for (int64_t i = 0; i < n; ++i) {
    const float level = levels[i % 5];
    a->lse[i] = level + uniform(rng);
    b->lse[i] = level + uniform(rng);
    switch (i % 11) {
      case 1:
        a->lse[i] = -kInf;
        break;
      case 2:
        b->lse[i] = -kInf;
        break;
      case 3:
        a->lse[i] = b->lse[i] = -kInf;
        break;
      case 4:
      case 5:
        b->lse[i] = a->lse[i] + gaps[(i / 11) % 4] * (i % 11 == 4 ? 1.0f : -1.0f);
        break;
      default:
        break;
    }
    // An empty side's out is 0, as attention_cte leaves it.
    for (State* s : {a, b}) {
      if (s->lse[i] == -kInf) std::fill_n(&s->out[i * s->dv], s->dv, 0.0f);
    }
  }
}

// Largest errors of (out, lse) in units u of their scales (see the file comment).
struct Errors {
  double out_units = 0, lse_units = 0;
};

Errors compare(const State& a, const State& b, const State& got) {
  Errors e;
  std::vector<double> ref;
  double ref_lse = 0;
  for (int64_t i = 0; i < a.batch * a.rows; ++i) {
    reference_row(a, b, i, &ref, &ref_lse);
    const std::string where = "row " + std::to_string(i) + " lse_a " + std::to_string(a.lse[i]) +
                              " lse_b " + std::to_string(b.lse[i]);
    if (std::isinf(ref_lse)) {
      EXPECT_EQ(got.lse[i], -kInf) << where;
    } else {
      const double err =
          std::fabs(got.lse[i] - ref_lse) / (kUnit * std::max(std::fabs(ref_lse), 1.0));
      e.lse_units = std::max(e.lse_units, err);
      EXPECT_LE(err, kLseUnits) << where << " lse " << got.lse[i] << " ref " << ref_lse;
    }
    double scale = 0;
    for (int64_t c = 0; c < a.dv; ++c) {
      scale = std::max(
          {scale, std::fabs(double(a.out[i * a.dv + c])), std::fabs(double(b.out[i * b.dv + c]))});
    }
    for (int64_t c = 0; c < a.dv; ++c) {
      const double diff = std::fabs(got.out[i * a.dv + c] - ref[c]);
      if (scale == 0) {
        EXPECT_EQ(diff, 0.0) << where;
        continue;
      }
      const double err = diff / (kUnit * scale);
      e.out_units = std::max(e.out_units, err);
      EXPECT_LE(err, kOutUnits) << where << " column " << c << " out " << got.out[i * a.dv + c]
                                << " ref " << ref[c];
    }
  }
  return e;
}

TEST(MergeTest, MatchesFloat64) {
  std::mt19937 rng(15);
  Errors worst;
  for (const int64_t dv : {1, 7, 64, 128}) {
    State a(3, 221, dv), b(3, 221, dv), got(3, 221, dv);
    fill(rng, &a, &b);
    ASSERT_TRUE(merge_attn_states(a.out_view(), a.lse_view(), b.out_view(), b.lse_view(),
                                  got.out_mut(), got.lse_mut())
                    .ok);
    const Errors e = compare(a, b, got);
    worst.out_units = std::max(worst.out_units, e.out_units);
    worst.lse_units = std::max(worst.lse_units, e.lse_units);
  }
  std::printf("[ merge    ] largest error: out %.2f, lse %.2f (units of 2^-24 of the scale)\n",
              worst.out_units, worst.lse_units);
}

// FlashAttention's layout in one call: out (batch, seqlen, heads, dv) as the rank-4
// (batch, heads, seqlen, dv) view and lse (batch, heads, seqlen). Each (batch, head) is the
// rank-2 call on the same rows bit for bit, and the float64 merge within the rule.
TEST(MergeTest, RankFourIsEveryEntryAtOnce) {
  constexpr int64_t kB = 3, kS = 29, kH = 4, kDv = 24;
  std::mt19937 rng(21);
  // One State of kB * kS * kH rows per side in (batch, seqlen, heads) order; lse reordered.
  State a(1, kB * kS * kH, kDv), b(1, kB * kS * kH, kDv), got(1, kB * kS * kH, kDv);
  fill(rng, &a, &b);
  const auto row = [](int64_t bi, int64_t h, int64_t t) { return (bi * kS + t) * kH + h; };
  std::vector<float> lse_a(kB * kH * kS), lse_b(kB * kH * kS), lse(kB * kH * kS);
  for (int64_t bi = 0; bi < kB; ++bi) {
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t t = 0; t < kS; ++t) {
        lse_a[(bi * kH + h) * kS + t] = a.lse[row(bi, h, t)];
        lse_b[(bi * kH + h) * kS + t] = b.lse[row(bi, h, t)];
      }
    }
  }
  const std::array<int64_t, kMaxRank> shape{kB, kH, kS, kDv},
      strides{kS * kH * kDv, kDv, kH * kDv, 1};
  const std::array<int64_t, kMaxRank> lse_shape{kB, kH, kS, 0}, lse_strides{kH * kS, kS, 1, 0};
  const TensorView oa{a.out.data(), DType::kFloat32, 4, shape, strides};
  const TensorView ob{b.out.data(), DType::kFloat32, 4, shape, strides};
  const MutableTensorView oo{got.out.data(), DType::kFloat32, 4, shape, strides};
  const TensorView la{lse_a.data(), DType::kFloat32, 3, lse_shape, lse_strides};
  const TensorView lb{lse_b.data(), DType::kFloat32, 3, lse_shape, lse_strides};
  const MutableTensorView lo{lse.data(), DType::kFloat32, 3, lse_shape, lse_strides};
  ASSERT_TRUE(merge_attn_states(oa, la, ob, lb, oo, lo).ok);
  for (int64_t bi = 0; bi < kB; ++bi) {
    for (int64_t h = 0; h < kH; ++h) {
      // (seqlen, dv) of this (batch, head), and its (seqlen,) lse.
      const int64_t first = row(bi, h, 0) * kDv, lfirst = (bi * kH + h) * kS;
      State one(1, kS, kDv);
      const std::array<int64_t, kMaxRank> s2{kS, kDv, 0, 0}, st2{kH * kDv, 1, 0, 0};
      const std::array<int64_t, kMaxRank> s1{kS, 0, 0, 0}, st1{1, 0, 0, 0};
      ASSERT_TRUE(merge_attn_states(
                      TensorView{a.out.data() + first, DType::kFloat32, 2, s2, st2},
                      TensorView{lse_a.data() + lfirst, DType::kFloat32, 1, s1, st1},
                      TensorView{b.out.data() + first, DType::kFloat32, 2, s2, st2},
                      TensorView{lse_b.data() + lfirst, DType::kFloat32, 1, s1, st1},
                      MutableTensorView::contiguous(one.out.data(), DType::kFloat32, {kS, kDv}),
                      MutableTensorView::contiguous(one.lse.data(), DType::kFloat32, {kS}))
                      .ok);
      for (int64_t t = 0; t < kS; ++t) {
        ASSERT_EQ(lse[lfirst + t], one.lse[t]);
        for (int64_t c = 0; c < kDv; ++c) {
          ASSERT_EQ(got.out[first + t * kH * kDv + c], one.out[t * kDv + c])
              << bi << " " << h << " " << t << " " << c;
        }
      }
    }
  }
  // The float64 merge row by row, in the (batch, seqlen, heads) order of `a`, `b` and `got`.
  for (int64_t bi = 0; bi < kB; ++bi) {
    for (int64_t h = 0; h < kH; ++h) {
      for (int64_t t = 0; t < kS; ++t) got.lse[row(bi, h, t)] = lse[(bi * kH + h) * kS + t];
    }
  }
  compare(a, b, got);
}

// A row empty on one side is the other side exactly; empty on both is (0, -inf).
TEST(MergeTest, EmptyRowsAreExact) {
  std::mt19937 rng(3);
  State a(1, 44, 16), b(1, 44, 16), got(1, 44, 16);
  fill(rng, &a, &b);
  ASSERT_TRUE(merge_attn_states(a.out_view(), a.lse_view(), b.out_view(), b.lse_view(),
                                got.out_mut(), got.lse_mut())
                  .ok);
  int checked = 0;
  for (int64_t i = 0; i < 44; ++i) {
    const State* only = nullptr;
    if (a.lse[i] == -kInf && b.lse[i] == -kInf) {
      EXPECT_EQ(got.lse[i], -kInf);
      for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(got.out[i * 16 + c], 0.0f);
      ++checked;
      continue;
    }
    if (a.lse[i] == -kInf) only = &b;
    if (b.lse[i] == -kInf) only = &a;
    if (!only) continue;
    ++checked;
    EXPECT_EQ(got.lse[i], only->lse[i]) << "row " << i;
    for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(got.out[i * 16 + c], only->out[i * 16 + c]);
  }
  EXPECT_GE(checked, 9);
}

// Rank 2 views (rows, dv) / (rows,), strided ones (a transposed batch axis, every other
// column), and in place: out is out_a, lse is lse_b.
TEST(MergeTest, StridedRank2AndInPlace) {
  std::mt19937 rng(7);
  const int64_t batch = 2, rows = 37, dv = 12;
  State a(batch, rows, dv), b(batch, rows, dv), want(batch, rows, dv);
  fill(rng, &a, &b);
  ASSERT_TRUE(merge_attn_states(a.out_view(), a.lse_view(), b.out_view(), b.lse_view(),
                                want.out_mut(), want.lse_mut())
                  .ok);
  // Rank 2, one batch element at a time: same values.
  for (int64_t bi = 0; bi < batch; ++bi) {
    std::vector<float> out(rows * dv), lse(rows);
    const auto o2 = [&](const State& s) {
      return TensorView::contiguous(&s.out[bi * rows * dv], DType::kFloat32, {rows, dv});
    };
    const auto l1 = [&](const State& s) {
      return TensorView::contiguous(&s.lse[bi * rows], DType::kFloat32, {rows});
    };
    ASSERT_TRUE(
        merge_attn_states(o2(a), l1(a), o2(b), l1(b),
                          MutableTensorView::contiguous(out.data(), DType::kFloat32, {rows, dv}),
                          MutableTensorView::contiguous(lse.data(), DType::kFloat32, {rows}))
            .ok);
    for (int64_t i = 0; i < rows * dv; ++i) ASSERT_EQ(out[i], want.out[bi * rows * dv + i]);
    for (int64_t i = 0; i < rows; ++i) ASSERT_EQ(lse[i], want.lse[bi * rows + i]);
  }
  // Side b stored (rows, batch, 2 dv), read through strides as (batch, rows, dv).
  std::vector<float> bt(rows * batch * 2 * dv, std::nanf("")), lt(rows * batch);
  for (int64_t bi = 0; bi < batch; ++bi) {
    for (int64_t r = 0; r < rows; ++r) {
      lt[r * batch + bi] = b.lse[bi * rows + r];
      for (int64_t c = 0; c < dv; ++c) {
        bt[(r * batch + bi) * 2 * dv + 2 * c] = b.out[(bi * rows + r) * dv + c];
      }
    }
  }
  TensorView bv;
  bv.data = bt.data();
  bv.rank = 3;
  bv.shape = {batch, rows, dv};
  bv.strides = {2 * dv, batch * 2 * dv, 2};
  TensorView lv;
  lv.data = lt.data();
  lv.rank = 2;
  lv.shape = {batch, rows};
  lv.strides = {1, batch};
  // In place: out = out_a, lse = lse_b (a copy of b's lse, contiguous).
  State acc = a;
  std::vector<float> lse_b = b.lse;
  const TensorView lse_b_view =
      TensorView::contiguous(lse_b.data(), DType::kFloat32, {batch, rows});
  const MutableTensorView lse_b_mut =
      MutableTensorView::contiguous(lse_b.data(), DType::kFloat32, {batch, rows});
  ASSERT_TRUE(
      merge_attn_states(acc.out_view(), acc.lse_view(), bv, lse_b_view, acc.out_mut(), lse_b_mut)
          .ok);
  EXPECT_EQ(acc.out, want.out);
  EXPECT_EQ(lse_b, want.lse);
  // lse read through a transposed view.
  State got(batch, rows, dv);
  ASSERT_TRUE(
      merge_attn_states(a.out_view(), a.lse_view(), bv, lv, got.out_mut(), got.lse_mut()).ok);
  EXPECT_EQ(got.out, want.out);
  EXPECT_EQ(got.lse, want.lse);
}

// 16-bit sides and outputs: inputs widened exactly, out rounded once (to nearest even).
TEST(MergeTest, SixteenBitOutsRoundOnce) {
  std::mt19937 rng(11);
  const int64_t rows = 29, dv = 8;
  State a(1, rows, dv), b(1, rows, dv), want(1, rows, dv);
  fill(rng, &a, &b);
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    // b rounded to the 16-bit type; the float32 merge of a and the rounded b, rounded once, is
    // what the 16-bit out must hold.
    std::vector<uint16_t> b16(rows * dv), out16(rows * dv);
    State b_rounded = b;
    for (int64_t i = 0; i < rows * dv; ++i) {
      b16[i] =
          dtype == DType::kBFloat16 ? half::float_to_bf16(b.out[i]) : half::float_to_f16(b.out[i]);
      b_rounded.out[i] =
          dtype == DType::kBFloat16 ? half::bf16_to_float(b16[i]) : half::f16_to_float(b16[i]);
    }
    ASSERT_TRUE(merge_attn_states(a.out_view(), a.lse_view(), b_rounded.out_view(),
                                  b_rounded.lse_view(), want.out_mut(), want.lse_mut())
                    .ok);
    std::vector<float> lse(rows);
    ASSERT_TRUE(
        merge_attn_states(a.out_view(), a.lse_view(),
                          TensorView::contiguous(b16.data(), dtype, {1, rows, dv}), b.lse_view(),
                          MutableTensorView::contiguous(out16.data(), dtype, {1, rows, dv}),
                          MutableTensorView::contiguous(lse.data(), DType::kFloat32, {1, rows}))
            .ok);
    for (int64_t i = 0; i < rows * dv; ++i) {
      const uint16_t expect = dtype == DType::kBFloat16 ? half::float_to_bf16(want.out[i])
                                                        : half::float_to_f16(want.out[i]);
      ASSERT_EQ(out16[i], expect) << dtype_name(dtype) << " element " << i;
    }
    for (int64_t i = 0; i < rows; ++i) ASSERT_EQ(lse[i], want.lse[i]);
  }
}

TEST(MergeTest, NanPropagatesAndLseIsOptional) {
  State a(1, 3, 2), b(1, 3, 2), got(1, 3, 2);
  a.out = {1, 2, 3, 4, 5, 6};
  b.out = {7, 8, 9, 10, 11, 12};
  a.lse = {std::nanf(""), 0.0f, kInf};
  b.lse = {0.0f, 0.0f, 0.0f};
  ASSERT_TRUE(merge_attn_states(a.out_view(), a.lse_view(), b.out_view(), b.lse_view(),
                                got.out_mut(), MutableTensorView{})
                  .ok);
  EXPECT_TRUE(std::isnan(got.out[0]) && std::isnan(got.out[1]));
  EXPECT_FLOAT_EQ(got.out[2], 6.0f);  // equal weights: the mean
  EXPECT_FLOAT_EQ(got.out[3], 7.0f);
  EXPECT_TRUE(std::isnan(got.out[4]) && std::isnan(got.out[5]));  // lse +inf is not a state
}

}  // namespace
}  // namespace flashcte
