// Numerical edge cases: extreme logits and scales, fully masked rows, a single unmasked key,
// dominant sinks, subnormal inputs, and NaN / Inf in the inputs (numerics_nonfinite_test.cc; the
// shared pieces in numerics_cases.h).
//
// NaN / Inf contract tested here (the lead's specification for issue 6): a non-finite input
// affects exactly the outputs that depend on it. A NaN (or +Inf) in q row i makes output row i
// NaN; a NaN (or +Inf) in key j makes NaN every row that attends key j; a NaN / Inf in value j,
// channel c makes channel c non-finite in every row that attends key j; every other output is
// bitwise what it is without the non-finite input. "Attends" is the mask of SEMANTICS.md: a row
// that has key j masked (causal, window, packing) is unaffected by anything stored there.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tests/reliability/numerics_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// run_case() for tensors the test has edited: the kernel's outputs on every row, the float64
// reference and (16-bit dtypes) the plain same-precision implementation, ready for compare().
Outcome evaluate(const Case& c, CaseTensors& t) {
  Outcome o;
  o.status = run_kernel(t);
  if (!o.status.ok) return o;
  for (int64_t i = 0; i < c.sq; ++i) o.rows.push_back(i);
  const Outputs64 k = read_outputs(c, t);
  o.kernel.batch = c.bs;
  o.kernel.seqlen_q = c.sq;
  o.kernel.value_dim = c.value_dim();
  o.kernel.out = k.out;
  o.kernel.neg_max = k.neg_max.empty() ? std::vector<double>(c.bs * c.sq) : k.neg_max;
  o.kernel.sum_recip = k.sum_recip.empty() ? std::vector<double>(c.bs * c.sq) : k.sum_recip;
  o.kernel.lse = k.lse.empty() ? std::vector<double>(c.bs * c.sq) : k.lse;
  for (const HostTensor* h : {&t.out, &t.neg_max, &t.sum_recip, &t.lse}) {
    o.gaps_intact = o.gaps_intact && (h->shape().empty() || h->gaps_intact());
  }
  for (double x : k.out) o.outputs_written = o.outputs_written && !std::isnan(x);
  Status s = reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &o.exact);
  if (s.ok && c.dtype != DType::kFloat32) {
    s = reference::attention_plain(t.q.view(), t.k.view(), t.v.view(), t.options, &o.plain);
  }
  if (!s.ok) o.status = s;
  return o;
}

// ---- extreme logits and scales -----------------------------------------------------------------

// Logits of up to +-1e4 that are exact in every dtype (small integers), so the reference and the
// kernel see the same scores: the softmax is one-hot or uniform over ties, and nothing may
// overflow (exp(1e4) would) or turn into NaN (inf - inf would).
TEST(Numerics, LogitsOfTenThousandAreExactAndFinite) {
  for (DType dtype : kDtypes) {
    for (float scale : {1.0f, 1000.0f}) {
      Case c = base_case(dtype);
      c.d = 2;
      c.options.scale = scale;
      c.stats = StatsLayout::kRowMajor;
      c.lse = true;
      c.options.causal_mask = false;
      CaseTensors t;
      build_tensors(c, &t);
      // scale 1: q in [-50, 50], k in [-100, 100] (|q.k| <= 1e4); scale 1000: q, k in [-2, 2]
      // (|scale * q.k| <= 8e3). Integers, so every product and sum is exact in float32.
      const double qmax = scale == 1.0f ? 50 : 2, kmax = scale == 1.0f ? 100 : 2;
      for (int64_t b = 0; b < c.bs; ++b)
        for (int64_t i = 0; i < c.sq; ++i)
          for (int64_t ch = 0; ch < c.d; ++ch) {
            t.q.set(b, i, ch, std::fmod(7.0 * (b + 3 * i + 5 * ch), 2 * qmax + 1) - qmax);
          }
      for (int64_t j = 0; j < c.skv; ++j)
        for (int64_t ch = 0; ch < c.d; ++ch) {
          t.k.set(0, ch, j, std::fmod(13.0 * (j + 7 * ch), 2 * kmax + 1) - kmax);
        }
      const Outcome o = evaluate(c, t);
      ASSERT_TRUE(o.status.ok) << o.status.message;
      for (double x : o.kernel.out) ASSERT_TRUE(std::isfinite(x)) << dtype_label(dtype);
      for (double x : o.kernel.lse) ASSERT_TRUE(std::isfinite(x)) << dtype_label(dtype);
      EXPECT_GT(*std::max_element(o.exact.lse.begin(), o.exact.lse.end()), 5e3);
      EXPECT_TRUE(compare(c, o)) << "scale " << scale;
    }
  }
}

// Random logits of order 1e3..1e4 (normal inputs, d = 64, scale up to 1e3): no overflow, no NaN,
// and the error stays within FlashAttention's rule against a plain float32 implementation (twice
// its error plus a floor). Logits this large make every float32 implementation lose digits: an
// ulp of a logit of 1e4 is 1e-3, and the probabilities move by that much.
TEST(Numerics, LargeScalesStayFiniteAndWithinTwicePlainError) {
  for (float scale : {30.0f, 300.0f, 1000.0f}) {
    for (uint64_t seed : {1, 2, 3}) {
      Case c = base_case(DType::kFloat32);
      c.d = 64;
      c.sq = 40;
      c.skv = 70;
      c.dist = Dist::kNormal;
      c.options.scale = scale;
      c.lse = true;
      c.seed = seed;
      CaseTensors t;
      build_tensors(c, &t);
      ASSERT_TRUE(run_kernel(t).ok);
      const Outputs64 k = read_outputs(c, t);
      reference::Result exact, plain;
      ASSERT_TRUE(reference::attention(t.q.view(), t.k.view(), t.v.view(), t.options, &exact).ok);
      ASSERT_TRUE(
          reference::attention_plain(t.q.view(), t.k.view(), t.v.view(), t.options, &plain).ok);
      double m = 0, err = 0, plain_err = 0, lse_err = 0, plain_lse_err = 0, max_logit = 0;
      for (size_t i = 0; i < k.out.size(); ++i) {
        ASSERT_TRUE(std::isfinite(k.out[i]));
        m = std::max(m, std::fabs(exact.out[i]));
        err = std::max(err, abs_error(k.out[i], exact.out[i]));
        plain_err = std::max(plain_err, abs_error(plain.out[i], exact.out[i]));
      }
      for (size_t i = 0; i < k.lse.size(); ++i) {
        ASSERT_TRUE(std::isfinite(k.lse[i]));
        lse_err = std::max(lse_err, abs_error(k.lse[i], exact.lse[i]));
        plain_lse_err = std::max(plain_lse_err, abs_error(plain.lse[i], exact.lse[i]));
        max_logit = std::max(max_logit, std::fabs(exact.lse[i]));
      }
      EXPECT_GT(max_logit, 10 * scale);  // the logits really are large
      EXPECT_LE(err, 2 * plain_err + 1e-5 * m) << "scale " << scale << " seed " << seed;
      EXPECT_LE(lse_err, 2 * plain_lse_err + 1e-6 * max_logit) << "scale " << scale;
    }
  }
}

// ---- rows with nothing to attend -------------------------------------------------------------

// Every way a row can end up with no key: an empty packing range, no keys at all, and a
// context-parallel offset that puts every key outside the causal window. The documented result
// (include/flashcte/flashcte.h, Outputs): out 0, neg_max +inf, sum_recip +inf, lse -inf.
TEST(Numerics, FullyMaskedRowsHaveTheDocumentedValues) {
  struct Variant {
    const char* name;
    void (*apply)(Case&);
    bool all_rows_empty;
  };
  const Variant variants[] = {
      {"empty packing range",
       [](Case& c) {
         c.pack_lengths = {7, 9, 8};
         c.pack_empty_sequence = true;  // rows 7..15
       },
       false},
      {"no keys", [](Case& c) { c.skv = 0; }, true},
      {"window past every key",
       [](Case& c) {
         c.skv = 8;
         c.options.cp_offset = 100;
         c.options.sliding_window = 4;
       },
       true},
      {"strided cp past every key",
       [](Case& c) {
         c.skv = 8;
         c.options.cp_offset = 30;
         c.options.global_cp_deg = 3;
         c.options.cp_strided_q_slicing = true;
         c.options.sliding_window = 5;
       },
       true},
  };
  for (DType dtype : kDtypes) {
    for (const Variant& var : variants) {
      for (StatsLayout stats : {StatsLayout::kRowMajor, StatsLayout::kNeuron}) {
        Case c = base_case(dtype);
        if (stats == StatsLayout::kNeuron) c.sq = 128;
        var.apply(c);
        if (stats == StatsLayout::kNeuron && !c.pack_lengths.empty()) c.pack_lengths = {40, 50, 38};
        c.stats = stats;
        c.lse = true;
        c.options.tiles = TileConfig{5, 3, 6, 0};
        CaseTensors t;
        build_tensors(c, &t);
        const Outcome o = evaluate(c, t);
        ASSERT_TRUE(o.status.ok) << o.status.message;
        EXPECT_TRUE(compare(c, o)) << var.name;  // the reference agrees on every row
        int64_t empty = 0;
        for (int64_t row = 0; row < c.bs * c.sq; ++row) {
          if (!std::isinf(o.exact.neg_max[row])) continue;
          ++empty;
          for (int64_t ch = 0; ch < c.value_dim(); ++ch) {
            ASSERT_EQ(o.kernel.out[row * c.value_dim() + ch], 0.0) << var.name;
          }
          ASSERT_EQ(o.kernel.neg_max[row], kInf) << var.name;
          ASSERT_EQ(o.kernel.sum_recip[row], kInf) << var.name;
          ASSERT_EQ(o.kernel.lse[row], -kInf) << var.name;
        }
        if (var.all_rows_empty) {
          EXPECT_EQ(empty, c.bs * c.sq) << var.name;
        } else {
          EXPECT_GT(empty, 0) << var.name;
          EXPECT_LT(empty, c.bs * c.sq) << var.name;
        }
      }
    }
  }
}

// With a sink, a row without keys is not empty: the sink takes all the probability. out 0,
// neg_max = -sink, sum_recip = 1, lse = sink.
TEST(Numerics, SinkAloneGivesZeroOutputAndTheSinkAsLse) {
  for (DType dtype : kDtypes) {
    Case c = base_case(dtype);
    c.skv = 0;
    c.sink = true;
    c.sink_lo = -5;
    c.sink_hi = 5;
    c.stats = StatsLayout::kRowMajor;
    c.lse = true;
    CaseTensors t;
    build_tensors(c, &t);
    ASSERT_TRUE(run_kernel(t).ok);
    const Outputs64 k = read_outputs(c, t);
    for (int64_t b = 0; b < c.bs; ++b) {
      const double sink = t.sink.get(b, 0);
      for (int64_t i = 0; i < c.sq; ++i) {
        const int64_t row = b * c.sq + i;
        for (int64_t ch = 0; ch < c.d; ++ch) ASSERT_EQ(k.out[row * c.d + ch], 0.0);
        EXPECT_EQ(k.neg_max[row], -sink);
        EXPECT_EQ(k.sum_recip[row], 1.0);
        EXPECT_EQ(k.lse[row], sink);
      }
    }
  }
}

// ---- a single unmasked key -------------------------------------------------------------------

// A row that sees exactly one key has probability exactly 1 on it: the output is that value
// row, exactly (no rounding anywhere: exp(0) = 1, 1 * v, v / 1), sum_recip is 1 and lse is the
// logit.
TEST(Numerics, ASingleKeyReturnsItsValueExactly) {
  for (DType dtype : kDtypes) {
    for (int variant = 0; variant < 2; ++variant) {
      Case c = base_case(dtype);
      c.dist = Dist::kNormal;
      c.stats = StatsLayout::kRowMajor;
      c.lse = true;
      c.options.scale = 0.7f;
      if (variant == 0) {
        c.options.sliding_window = 1;  // causal + window 1: each row sees its own position
      } else {
        c.options.causal_mask = false;
        c.pack_lengths = {24};  // replaced below by one key per row: key (5 * i) % Skv
      }
      CaseTensors t;
      build_tensors(c, &t);
      auto key_of = [&](int64_t i) { return variant == 0 ? i : (5 * i) % c.skv; };
      if (variant == 1) {
        for (int64_t i = 0; i < c.sq; ++i) {
          t.bound_min.set_raw_int(i, 0, key_of(i));
          t.bound_max.set_raw_int(i, 0, key_of(i) + 1);
        }
      }
      ASSERT_TRUE(run_kernel(t).ok);
      const Outputs64 k = read_outputs(c, t);
      for (int64_t b = 0; b < c.bs; ++b) {
        for (int64_t i = 0; i < c.sq; ++i) {
          const int64_t row = b * c.sq + i, j = key_of(i);
          for (int64_t ch = 0; ch < c.d; ++ch) {
            ASSERT_EQ(k.out[row * c.d + ch], t.v.get(0, j, ch))
                << dtype_label(dtype) << " row " << i << " key " << j;
          }
          EXPECT_EQ(k.sum_recip[row], 1.0);
          double logit = 0;
          for (int64_t ch = 0; ch < c.d; ++ch) logit += t.q.get(b, i, ch) * t.k.get(0, ch, j);
          logit *= 0.7f;
          EXPECT_NEAR(k.lse[row], logit, 1e-5 * (1 + std::fabs(logit)));
          EXPECT_NEAR(k.neg_max[row], -logit, 1e-5 * (1 + std::fabs(logit)));
        }
      }
    }
  }
}

// ---- sinks -----------------------------------------------------------------------------------

// A sink far above every logit takes (almost) all the probability: the output is ~0 (exp(-sink)
// times the values), lse ~ sink, and nothing overflows even for sink = 1e30.
TEST(Numerics, DominantSinksDriveTheOutputToZero) {
  for (DType dtype : kDtypes) {
    for (double sink : {60.0, 1e4, 1e30}) {
      Case c = base_case(dtype);
      c.sink = true;
      c.sink_lo = c.sink_hi = sink;
      c.stats = StatsLayout::kRowMajor;
      c.lse = true;
      CaseTensors t;
      build_tensors(c, &t);
      const Outcome o = evaluate(c, t);
      ASSERT_TRUE(o.status.ok);
      const double s = static_cast<float>(sink);  // the sink is float32
      for (double x : o.kernel.out) {
        ASSERT_TRUE(std::isfinite(x));
        // logits are in [0, d) (uniform inputs), so every probability is below exp(d - sink).
        ASSERT_LE(std::fabs(x), c.skv * std::exp(static_cast<double>(c.d) - s)) << sink;
      }
      for (size_t r = 0; r < o.kernel.lse.size(); ++r) {
        EXPECT_NEAR(o.kernel.lse[r], s, 1e-6 * s);
        EXPECT_EQ(o.kernel.neg_max[r], -s);
        EXPECT_NEAR(o.kernel.sum_recip[r], 1.0,
                    1e-6 + std::exp(static_cast<double>(c.d) - s) * c.skv);
      }
      EXPECT_TRUE(compare(c, o)) << "sink " << sink;
    }
  }
}

// A sink of -1e30 or -inf contributes exp(-huge) = 0: the result is the sink-free one.
TEST(Numerics, NegligibleSinksChangeNothing) {
  for (DType dtype : kDtypes) {
    for (double sink : {-1e30, -kInf}) {
      Case c = base_case(dtype);
      c.lse = true;
      CaseTensors plain;
      build_tensors(c, &plain);
      ASSERT_TRUE(run_kernel(plain).ok);
      c.sink = true;
      c.sink_lo = c.sink_hi = 0;  // drawn after q, k and v, so those match; then overwritten
      CaseTensors with_sink;
      build_tensors(c, &with_sink);
      for (int64_t b = 0; b < c.bs; ++b) with_sink.sink.set(b, 0, 0, sink);
      ASSERT_TRUE(run_kernel(with_sink).ok);
      const Outputs64 a = read_outputs(c, plain), b = read_outputs(c, with_sink);
      EXPECT_EQ(a.out, b.out) << "sink " << sink;
      EXPECT_EQ(a.lse, b.lse) << "sink " << sink;
    }
  }
}

// ---- subnormal inputs ------------------------------------------------------------------------

// Subnormal values, logits and outputs are numbers like any other: no flush to zero. Values of
// ~1e-39 (float32 and bfloat16 subnormals) or ~1e-6 (float16 subnormals) give outputs of the same
// size, which must match the reference to within the rounding of the subnormal grid.
TEST(Numerics, SubnormalInputsAreNotFlushed) {
  for (DType dtype : kDtypes) {
    const double tiny = dtype == DType::kFloat16 ? std::ldexp(1.0, -20) : 1e-39;
    const double quantum =
        dtype == DType::kFloat16
            ? std::ldexp(1.0, -24)
            : (dtype == DType::kBFloat16 ? std::ldexp(1.0, -133) : std::ldexp(1.0, -149));
    for (int what = 0; what < 3; ++what) {  // 0: v subnormal, 1: q and k subnormal, 2: all
      Case c = base_case(dtype);
      c.lse = true;
      CaseTensors t;
      build_tensors(c, &t);
      auto shrink = [&](HostTensor& h) {
        const auto& s = h.shape();
        for (int64_t a = 0; a < s[0]; ++a)
          for (int64_t b = 0; b < s[1]; ++b)
            for (int64_t d = 0; d < s[2]; ++d) h.set(a, b, d, h.get(a, b, d) * tiny);
      };
      if (what != 1) shrink(t.v);
      if (what != 0) {
        shrink(t.q);
        shrink(t.k);
      }
      const Outcome o = evaluate(c, t);
      ASSERT_TRUE(o.status.ok);
      double m = 0;
      for (double x : o.exact.out) m = std::max(m, std::fabs(x));
      // The outputs are subnormal in their dtype.
      if (what != 1) {
        ASSERT_LT(m, std::ldexp(1.0, dtype == DType::kFloat16 ? -14 : -126));
      }
      // Float32 arithmetic on subnormals is exact up to the quantum per operation: Skv products
      // and sums, a reciprocal and a product, then the rounding to the output dtype's grid.
      // Where the outputs are normal (case 1), the rounding to the dtype: u * m.
      const double u = dtype == DType::kFloat32    ? std::ldexp(1.0, -24)
                       : dtype == DType::kBFloat16 ? std::ldexp(1.0, -8)
                                                   : std::ldexp(1.0, -11);
      const double tol = (1e-5 + u) * m + (c.skv + 4) * std::ldexp(1.0, -149) + quantum;
      int64_t nonzero = 0;
      for (size_t i = 0; i < o.kernel.out.size(); ++i) {
        ASSERT_NEAR(o.kernel.out[i], o.exact.out[i], tol)
            << dtype_label(dtype) << " case " << what << " element " << i;
        nonzero += o.kernel.out[i] != 0;
      }
      EXPECT_GT(nonzero, static_cast<int64_t>(o.kernel.out.size()) / 2);
      for (size_t r = 0; r < o.kernel.lse.size(); ++r) {
        ASSERT_NEAR(o.kernel.lse[r], o.exact.lse[r], 1e-5 * (1 + std::fabs(o.exact.lse[r])));
      }
    }
  }
}

}  // namespace
}  // namespace flashcte::test
