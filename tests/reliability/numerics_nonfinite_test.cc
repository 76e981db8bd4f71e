// Numerical edge cases: NaN / Inf in the inputs (q, keys, values, the prior and the sink), under
// the NaN / Inf contract of numerics_test.cc's file comment: a non-finite input affects exactly
// the outputs that depend on it, every other output is bitwise what it is without it. The other
// edge cases (extreme logits and scales, masked rows, sinks, subnormals): numerics_test.cc.
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
