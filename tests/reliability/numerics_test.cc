// Numerical edge cases: extreme logits and scales, fully masked rows, a single unmasked key,
// dominant sinks, subnormal inputs, and NaN / Inf in the inputs.
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

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string dtype_label(DType d) { return dtype_name(d); }

// The kernel's outputs as plain arrays: out (bs, Sq, dv) whatever tp_out says; stats (bs, Sq).
struct Outputs64 {
  std::vector<double> out, neg_max, sum_recip, lse;
};

Outputs64 read_outputs(const Case& c, const CaseTensors& t) {
  Outputs64 r;
  const int64_t dv = c.value_dim();
  for (int64_t b = 0; b < c.bs; ++b) {
    for (int64_t i = 0; i < c.sq; ++i) {
      for (int64_t ch = 0; ch < dv; ++ch) {
        r.out.push_back(c.options.tp_out ? t.out.get(b, ch, i) : t.out.get(b, i, ch));
      }
      auto stat = [&](const HostTensor& s) {
        return c.stats == StatsLayout::kNeuron ? s.get(b, i % 128, i / 128) : s.get(b, i);
      };
      if (c.stats != StatsLayout::kNone) {
        r.neg_max.push_back(stat(t.neg_max));
        r.sum_recip.push_back(stat(t.sum_recip));
      }
      if (c.lse) r.lse.push_back(t.lse.get(b, i));
    }
  }
  return r;
}

Status run_kernel(CaseTensors& t) {
  return attention_cte(t.q.view(), t.k.view(), t.v.view(), t.outputs, t.options);
}

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

Case base_case(DType dtype) {
  Case c;
  c.dtype = dtype;
  c.bs = 2;
  c.bs_kv = 1;
  c.sq = 24;
  c.skv = 24;
  c.d = 8;
  c.options.num_threads = 2;
  return c;
}

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

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

// ---- NaN and Inf in the inputs ---------------------------------------------------------------

// Causal with a window of 7 over a prior of 6 tokens (all used) and Sq = Skv = 24. On the
// concatenated KV axis j (prior first), row i attends j in [i, i + 6]: new key n (j = n + 6) is
// attended by rows n..n+6, prior key p by rows 0..p. bs 2 over bs_kv 1, so both query heads read
// the same K and V.
constexpr int64_t kWindow = 7;
constexpr int64_t kPrior = 6;
bool attends(int64_t i, int64_t j) { return j >= i && j <= i + kWindow - 1; }
bool attends_new(int64_t i, int64_t n) { return attends(i, n + kPrior); }

struct Poison {
  const char* name;
  // Writes the non-finite value into the tensors.
  void (*apply)(CaseTensors& t, double value);
  // For output (b, i, channel): must it be non-finite (true) or equal to the clean run (false)?
  bool (*affected)(int64_t b, int64_t i, int64_t ch);
  bool lse_affected_too;  // a poisoned logit makes the row's lse NaN as well
};

// k is (bs_kv, d, Skv) and k_prior (bs_kv, d, S_prior) (tp_k false); v and v_prior
// (bs_kv, S, dv).
const Poison kPoisons[] = {
    {"q_row10", [](CaseTensors& t, double x) { t.q.set(1, 10, 3, x); },
     [](int64_t b, int64_t i, int64_t) { return b == 1 && i == 10; }, true},
    {"k_key9", [](CaseTensors& t, double x) { t.k.set(0, 2, 9, x); },
     [](int64_t, int64_t i, int64_t) { return attends_new(i, 9); }, true},
    {"k_key0", [](CaseTensors& t, double x) { t.k.set(0, 0, 0, x); },
     [](int64_t, int64_t i, int64_t) { return attends_new(i, 0); }, true},
    {"k_prior_key3", [](CaseTensors& t, double x) { t.k_prior.set(0, 4, 3, x); },
     [](int64_t, int64_t i, int64_t) { return attends(i, 3); }, true},
    {"v_key9_channel5", [](CaseTensors& t, double x) { t.v.set(0, 9, 5, x); },
     [](int64_t, int64_t i, int64_t ch) { return ch == 5 && attends_new(i, 9); }, false},
    {"v_key23_channel0", [](CaseTensors& t, double x) { t.v.set(0, 23, 0, x); },
     [](int64_t, int64_t i, int64_t ch) { return ch == 0 && attends_new(i, 23); }, false},
    {"v_prior_key2_channel7", [](CaseTensors& t, double x) { t.v_prior.set(0, 2, 7, x); },
     [](int64_t, int64_t i, int64_t ch) { return ch == 7 && attends(i, 2); }, false},
};

// (dtype, tiling, value, poison index, head dim). At d = 16, float32 V is read in place rather
// than packed (src/kernel/pack.cc); the prior's end falls inside a section in tiling 1 (packed)
// and on a section boundary in tiling 2 (in place).
using NonFiniteParam = std::tuple<DType, int, double, int, int64_t>;
class NonFinite : public ::testing::TestWithParam<NonFiniteParam> {};

// One non-finite input element against the clean run, across tilings that put the poisoned key
// in full, masked and skipped tiles of different rows.
TEST_P(NonFinite, PropagatesToTheAffectedOutputsOnly) {
  const auto [dtype, tiling, value, index, head_dim] = GetParam();
  const Poison& poison = kPoisons[index];
  Case c = base_case(dtype);
  c.d = head_dim;
  c.has_prior = true;
  c.s_prior = kPrior;
  c.options.sliding_window = kWindow;
  c.lse = true;
  c.options.tiles = tiling == 0   ? TileConfig{}
                    : tiling == 1 ? TileConfig{8, 4, 8, 0}
                                  : TileConfig{3, 5, 0, 0};
  // Two identical sets of tensors with inputs moved to [0.5, 1); one gets the poison. With every
  // q.k term positive, +Inf in q or k gives +Inf logits (not NaN from 0 * Inf), and the NaN
  // comes from the softmax (inf - inf), as in IEEE arithmetic.
  auto make = [&](CaseTensors* t) {
    build_tensors(c, t);
    for (HostTensor* h : {&t->q, &t->k, &t->v, &t->k_prior, &t->v_prior}) {
      const auto& s = h->shape();
      for (int64_t a = 0; a < s[0]; ++a)
        for (int64_t b = 0; b < s[1]; ++b)
          for (int64_t d = 0; d < s[2]; ++d) h->set(a, b, d, 0.5 + 0.5 * h->get(a, b, d));
    }
  };
  CaseTensors clean, bad;
  make(&clean);
  make(&bad);
  poison.apply(bad, value);
  ASSERT_TRUE(run_kernel(clean).ok);
  const Status s = run_kernel(bad);
  ASSERT_TRUE(s.ok) << s.message;
  const Outputs64 a = read_outputs(c, clean), b = read_outputs(c, bad);
  int64_t wrong = 0, affected = 0;
  std::string first;
  for (int64_t bb = 0; bb < c.bs; ++bb) {
    for (int64_t i = 0; i < c.sq; ++i) {
      const int64_t row = bb * c.sq + i;
      bool row_affected = false;
      for (int64_t ch = 0; ch < c.d; ++ch) {
        const double x = b.out[row * c.d + ch], ref = a.out[row * c.d + ch];
        const bool hit = poison.affected(bb, i, ch);
        row_affected = row_affected || hit;
        affected += hit;
        const bool ok = hit ? std::isnan(value) ? std::isnan(x) : !std::isfinite(x) : x == ref;
        if (!ok && wrong++ == 0) {
          first = "out[b=" + std::to_string(bb) + ", i=" + std::to_string(i) +
                  ", c=" + std::to_string(ch) + "] = " + std::to_string(x) +
                  (hit ? " (must be non-finite)" : ", clean run " + std::to_string(ref));
        }
      }
      const bool lse_hit = row_affected && poison.lse_affected_too;
      const bool lse_ok = lse_hit ? std::isnan(b.lse[row]) : b.lse[row] == a.lse[row];
      if (!lse_ok && wrong++ == 0) {
        first = "lse[b=" + std::to_string(bb) + ", i=" + std::to_string(i) +
                "] = " + std::to_string(b.lse[row]) +
                (lse_hit ? " (must be NaN)" : ", clean run " + std::to_string(a.lse[row]));
      }
    }
  }
  EXPECT_GT(affected, 0);  // the poison is attended by some row
  EXPECT_EQ(wrong, 0) << poison.name << " = " << value << ", " << dtype_label(dtype) << ", tiling "
                      << tiling << ": " << wrong << " wrong output(s), first " << first;
}

std::string non_finite_name(const ::testing::TestParamInfo<NonFiniteParam>& p) {
  return dtype_label(std::get<0>(p.param)) + "_tiling" + std::to_string(std::get<1>(p.param)) +
         (std::isnan(std::get<2>(p.param)) ? "_nan_" : "_inf_") +
         kPoisons[std::get<3>(p.param)].name + "_d" + std::to_string(std::get<4>(p.param));
}

// Every poison: NaN or +Inf in a logit (q or a key) or in a value.
INSTANTIATE_TEST_SUITE_P(Poisons, NonFinite,
                         ::testing::Combine(::testing::ValuesIn(kDtypes),
                                            ::testing::Values(0, 1, 2),
                                            ::testing::Values(kNaN, kInf), ::testing::Range(0, 7),
                                            ::testing::Values(int64_t{8}, int64_t{16})),
                         non_finite_name);

// A NaN sink poisons every row of its batch (it enters every row's max and sum), and nothing
// else; refusing it with a "sink: ..." error is an acceptable alternative.
TEST(Numerics, NanSinkPoisonsItsBatchOnlyOrIsRefused) {
  for (DType dtype : kDtypes) {
    Case c = base_case(dtype);
    c.sink = true;
    c.sink_lo = 0;
    c.sink_hi = 2;
    c.lse = true;
    CaseTensors clean, bad;
    build_tensors(c, &clean);
    build_tensors(c, &bad);
    bad.sink.set(1, 0, 0, kNaN);
    ASSERT_TRUE(run_kernel(clean).ok);
    BufferSnapshot snap;  // every buffer of the call, for the refusal
    for (const auto& [name, t] : {std::pair<const char*, HostTensor*>{"q", &bad.q},
                                  {"k", &bad.k},
                                  {"v", &bad.v},
                                  {"sink", &bad.sink},
                                  {"out", &bad.out},
                                  {"lse", &bad.lse}}) {
      snap.add(name, t->bytes());
    }
    const Status s = run_kernel(bad);
    if (!s.ok) {
      EXPECT_EQ(s.message.rfind("sink: ", 0), 0u) << s.message;
      EXPECT_TRUE(snap.unchanged()) << dtype_label(dtype);
      continue;
    }
    const Outputs64 a = read_outputs(c, clean), b = read_outputs(c, bad);
    for (int64_t i = 0; i < c.sq * c.d; ++i) {
      EXPECT_EQ(b.out[i], a.out[i]) << dtype_label(dtype);                   // batch 0
      EXPECT_TRUE(std::isnan(b.out[c.sq * c.d + i])) << dtype_label(dtype);  // batch 1
    }
  }
}

}  // namespace
}  // namespace flashcte::test
