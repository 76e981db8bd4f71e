// merge_attn_states (include/flashcte/merge.h) against attention_cte itself: attention over the
// keys K1 | K2 equals the merge of attention over K1 and over K2 (a sink on one side, causal rows
// that see nothing of K2), within the suite's float32 rule, 1e-5 of the largest output
// (test_util.cc); and bad arguments, named in the message. The float64 merge: merge_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/merge.h"
#include "tests/merge_cases.h"

namespace flashcte {
namespace {

using test::kInf;
using test::State;

// attention over K1 | K2 == merge(attention over K1, attention over K2), with lse from the
// kernel: a sink on side a only; causal, where rows before K2's first key see nothing of K2.
TEST(MergeTest, SplitAttentionEqualsWhole) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t bs = 4, n = 300, m = 113, d = 32;
  std::vector<float> q(bs * n * d), k(bs * n * d), v(bs * n * d), sink(bs);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  for (float& x : sink) x = 2.0f * normal(rng);
  // K1 = keys [0, m), K2 = keys [m, n), copied into their own (bs, len, d) arrays.
  const auto slice = [&](const std::vector<float>& x, int64_t lo, int64_t hi) {
    std::vector<float> y(bs * (hi - lo) * d);
    for (int64_t b = 0; b < bs; ++b) {
      std::memcpy(&y[b * (hi - lo) * d], &x[(b * n + lo) * d], (hi - lo) * d * sizeof(float));
    }
    return y;
  };
  const std::vector<float> k1 = slice(k, 0, m), v1 = slice(v, 0, m);
  const std::vector<float> k2 = slice(k, m, n), v2 = slice(v, m, n);
  for (const bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    Options base;
    base.scale = 0.2f;
    base.tp_k = true;
    base.causal_mask = false;
    const TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {bs, n, d});
    const TensorView sink_view = TensorView::contiguous(sink.data(), DType::kFloat32, {bs, 1});
    // Whole: causal through packing bounds [0, i + 1) (the same per-row rule as the split).
    std::vector<int64_t> lo(n, 0), hi(n), lo2(n, 0), hi1(n), hi2(n);
    for (int64_t i = 0; i < n; ++i) {
      hi[i] = causal ? i + 1 : n;
      hi1[i] = std::min(hi[i], m);
      hi2[i] = std::max<int64_t>(hi[i] - m, 0);
    }
    const auto bounds = [&](Options o, const std::vector<int64_t>& l,
                            const std::vector<int64_t>& h) {
      if (causal) {
        o.bound_min = TensorView::contiguous(l.data(), DType::kInt64, {n});
        o.bound_max = TensorView::contiguous(h.data(), DType::kInt64, {n});
      }
      return o;
    };
    State whole(1, bs * n, d), s1(1, bs * n, d), s2(1, bs * n, d), merged(1, bs * n, d);
    const auto run = [&](const std::vector<float>& kk, const std::vector<float>& vv, int64_t len,
                         const Options& o, State* s) {
      Outputs out;
      out.out = MutableTensorView::contiguous(s->out.data(), DType::kFloat32, {bs, n, d});
      out.lse = MutableTensorView::contiguous(s->lse.data(), DType::kFloat32, {bs, n});
      const Status st =
          attention_cte(qv, TensorView::contiguous(kk.data(), DType::kFloat32, {bs, len, d}),
                        TensorView::contiguous(vv.data(), DType::kFloat32, {bs, len, d}), out, o);
      ASSERT_TRUE(st.ok) << st.message;
    };
    Options with_sink = base;
    with_sink.sink = sink_view;
    run(k, v, n, bounds(with_sink, lo, hi), &whole);
    run(k1, v1, m, bounds(with_sink, lo, hi1), &s1);
    run(k2, v2, n - m, bounds(base, lo2, hi2), &s2);
    ASSERT_TRUE(merge_attn_states(s1.out_view(), s1.lse_view(), s2.out_view(), s2.lse_view(),
                                  merged.out_mut(), merged.lse_mut())
                    .ok);
    if (causal) {  // rows before K2 are empty on side b, and take side a as it is
      for (int64_t b = 0; b < bs; ++b) {
        for (int64_t i = 0; i < m; ++i) ASSERT_EQ(s2.lse[b * n + i], -kInf);
      }
    }
    double scale = 0, lse_scale = 1;
    for (float x : whole.out) scale = std::max(scale, std::fabs(double(x)));
    for (float x : whole.lse) lse_scale = std::max(lse_scale, std::fabs(double(x)));
    for (size_t i = 0; i < whole.out.size(); ++i) {
      ASSERT_LE(std::fabs(merged.out[i] - whole.out[i]), 1e-5 * scale) << "element " << i;
    }
    for (size_t i = 0; i < whole.lse.size(); ++i) {
      ASSERT_LE(std::fabs(merged.lse[i] - whole.lse[i]), 1e-5 * lse_scale) << "row " << i;
    }
  }
}

TEST(MergeTest, BadArgumentsNameTheArgument) {
  State a(1, 4, 3), b(1, 4, 3), got(1, 4, 3);
  const auto starts = [](const Status& s, const std::string& prefix) {
    return !s.ok && s.message.rfind(prefix, 0) == 0;
  };
  State wide(1, 4, 5);
  EXPECT_TRUE(starts(merge_attn_states(a.out_view(), a.lse_view(), wide.out_view(), b.lse_view(),
                                       got.out_mut(), got.lse_mut()),
                     "out_b: shape (1, 4, 5) differs from out_a's (1, 4, 3)"));
  EXPECT_TRUE(starts(merge_attn_states(a.out_view(), TensorView{}, b.out_view(), b.lse_view(),
                                       got.out_mut(), got.lse_mut()),
                     "lse_a: is required"));
  std::vector<uint16_t> half(4);
  EXPECT_TRUE(
      starts(merge_attn_states(a.out_view(), a.lse_view(), b.out_view(),
                               TensorView::contiguous(half.data(), DType::kBFloat16, {1, 4}),
                               got.out_mut(), got.lse_mut()),
             "lse_b: dtype must be float32"));
  std::vector<float> flat(4);
  EXPECT_TRUE(starts(
      merge_attn_states(TensorView::contiguous(flat.data(), DType::kFloat32, {4}), a.lse_view(),
                        b.out_view(), b.lse_view(), got.out_mut(), got.lse_mut()),
      "out_a: must have rank 2"));
  // out shifted by one element over out_a: overlapping, not the same view.
  std::vector<float> buf(13);
  const TensorView a_view = TensorView::contiguous(buf.data(), DType::kFloat32, {1, 4, 3});
  EXPECT_TRUE(starts(
      merge_attn_states(a_view, a.lse_view(), b.out_view(), b.lse_view(),
                        MutableTensorView::contiguous(buf.data() + 1, DType::kFloat32, {1, 4, 3}),
                        got.lse_mut()),
      "out: overlaps out_a without being the same view"));
  EXPECT_TRUE(starts(
      merge_attn_states(a.out_view(), a.lse_view(), b.out_view(), b.lse_view(), got.out_mut(),
                        MutableTensorView::contiguous(got.out.data(), DType::kFloat32, {1, 4})),
      "lse: overlaps out"));
  // lse_a's memory as lse, read as lse_b: the same bytes, but lse is not lse_b's view.
  std::vector<float> l(8);
  EXPECT_TRUE(starts(
      merge_attn_states(a.out_view(), TensorView::contiguous(l.data(), DType::kFloat32, {1, 4}),
                        b.out_view(), TensorView::contiguous(l.data() + 2, DType::kFloat32, {1, 4}),
                        got.out_mut(),
                        MutableTensorView::contiguous(l.data(), DType::kFloat32, {1, 4})),
      "lse: overlaps lse_b without being the same view"));
}

}  // namespace
}  // namespace flashcte
