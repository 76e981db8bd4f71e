// Beyond the Neuron kernel (issue 4): softcap, ALiBi and key_bias score modifiers,
// FlashAttention's window_size and bottom-right causal alignment, and large head dims, each
// against the float64 reference and combined with the kernel's own modes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

// Per-query-batch ALiBi slopes as in the ALiBi paper (2^(-8h/H)), and a key bias with a few
// -inf entries (masked keys), owned here and attached to the case's options.
struct Modifiers {
  std::vector<float> slopes;
  std::vector<float> bias;

  void attach(Case* c, bool alibi, bool key_bias) {
    const int64_t total = (c->has_prior ? max_used(*c) : 0) + c->skv;
    if (alibi) {
      slopes.resize(static_cast<size_t>(c->bs));
      for (int64_t b = 0; b < c->bs; ++b) {
        slopes[b] = std::pow(2.0f, -8.0f * static_cast<float>(b + 1) / static_cast<float>(c->bs));
      }
      c->options.alibi_slopes = TensorView::contiguous(slopes.data(), DType::kFloat32, {c->bs});
    }
    if (key_bias) {
      std::mt19937_64 rng(c->seed + 7);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      bias.resize(static_cast<size_t>(c->bs * total));
      for (size_t i = 0; i < bias.size(); ++i) {
        bias[i] = i % 13 == 5 ? -std::numeric_limits<float>::infinity() : normal(rng);
      }
      c->options.key_bias = TensorView::contiguous(bias.data(), DType::kFloat32, {c->bs, total});
    }
  }

  static int64_t max_used(const Case& c) {
    int64_t m = c.options.prior_used_len.empty() ? c.s_prior : 0;
    for (int64_t u : c.options.prior_used_len) m = std::max(m, u);
    return m;
  }
};

Case base(DType dt, int64_t sq, int64_t skv, int64_t d, uint64_t seed) {
  Case c;
  c.dtype = dt;
  c.bs = 4;
  c.bs_kv = 2;
  c.sq = sq;
  c.skv = skv;
  c.d = d;
  c.seed = seed;
  c.options.scale = static_cast<float>(1 / std::sqrt(static_cast<double>(d)));
  c.stats = StatsLayout::kRowMajor;
  c.lse = true;
  c.dist = Dist::kNormal;
  return c;
}

// ---- each modifier alone, in every dtype, causal and not ---------------------------------------

const char* modifier_name(int which) {
  static const char* kNames[] = {"softcap", "alibi", "key_bias"};
  return kNames[which];
}

class ModifierTest : public ::testing::TestWithParam<std::tuple<int, DType, bool>> {};

TEST_P(ModifierTest, MatchesReference) {
  const auto [which, dt, causal] = GetParam();
  Case c = base(dt, 67, 91, 40, 11 + which);
  c.options.causal_mask = causal;
  c.qk_mult = 3;  // logits of tens: softcap 5 really bends them
  Modifiers m;
  if (which == 0) c.options.softcap = 5.0f;
  m.attach(&c, which == 1, which == 2);
  EXPECT_TRUE(check_case(c));
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c));
}

INSTANTIATE_TEST_SUITE_P(Modifiers, ModifierTest,
                         ::testing::Combine(::testing::Values(0, 1, 2),
                                            ::testing::ValuesIn(kDtypes), ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(modifier_name(std::get<0>(param_info.param))) + "_" +
                                  dtype_name(std::get<1>(param_info.param)) +
                                  (std::get<2>(param_info.param) ? "_causal" : "_full");
                         });

// ---- all modifiers together with the kernel's modes ---------------------------------------------

TEST(Modifiers, CombineWithEveryMode) {
  for (int mode = 0; mode < 6; ++mode) {
    Case c = base(DType::kFloat32, 150, 170, 32, 100 + mode);
    c.options.softcap = 8.0f;
    switch (mode) {
      case 0:  // prefix caching with one used length per KV batch
        c.has_prior = true;
        c.s_prior = 60;
        c.options.prior_used_len = {0, 45};
        break;
      case 1:  // strided context parallelism, last rank
        c.options.cp_offset = 7;
        c.options.global_cp_deg = 8;
        c.options.cp_strided_q_slicing = true;
        break;
      case 2:  // sliding window and sink
        c.options.sliding_window = 33;
        c.sink = true;
        break;
      case 3:  // packing
        c.pack_lengths = {50, 60, 40};
        break;
      case 4:  // transposes and bf16
        c.dtype = DType::kBFloat16;
        c.options.tp_q = false;
        c.options.tp_k = true;
        c.options.tp_out = true;
        break;
      default:  // contiguous context parallelism with FlashAttention's window
        c.options.cp_offset = 300;
        c.options.window_left = 100;
        break;
    }
    Modifiers m;
    m.attach(&c, true, true);
    SCOPED_TRACE("mode " + std::to_string(mode));
    EXPECT_TRUE(check_case(c));
  }
}

// ---- FlashAttention's window_size and bottom-right alignment --------------------------------

TEST(WindowSize, LeftRightAndAlignment) {
  struct W {
    int64_t left, right;
    bool causal, bottom_right;
    int64_t sq, skv;
  };
  for (const W& w : {W{16, 0, false, false, 90, 90}, W{16, 5, false, false, 90, 90},
                     W{-1, 3, false, false, 60, 100}, W{7, -1, false, true, 60, 100},
                     W{0, 0, false, false, 40, 40}, W{10, -1, true, true, 100, 60},
                     W{-1, -1, true, true, 37, 120}, W{-1, -1, true, true, 120, 37},
                     W{300, 300, false, false, 50, 50}}) {
    for (DType dt : kDtypes) {
      Case c = base(dt, w.sq, w.skv, 24, static_cast<uint64_t>(w.left * 31 + w.right + w.sq));
      c.options.window_left = w.left;
      c.options.window_right = w.right;
      c.options.causal_mask = w.causal;
      c.options.bottom_right = w.bottom_right;
      SCOPED_TRACE(c.describe());
      EXPECT_TRUE(check_case(c));
    }
  }
}

// The FlashAttention README's examples of bottom-right causal masks, read back through the
// kernel: all-equal scores (q = 0) and one-hot values make output[i][j] = 1/n_i where row i may
// attend key j and 0 elsewhere.
std::vector<std::vector<int>> attended(int64_t sq, int64_t skv) {
  std::vector<float> q(sq * 4, 0.0f), k(4 * skv, 1.0f), v(skv * skv, 0.0f), out(sq * skv, -1.0f);
  for (int64_t j = 0; j < skv; ++j) v[j * skv + j] = 1.0f;
  Options o;
  o.causal_mask = true;
  o.bottom_right = true;
  Outputs outputs;
  outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, sq, skv});
  const Status s =
      attention_cte(TensorView::contiguous(q.data(), DType::kFloat32, {1, sq, 4}),
                    TensorView::contiguous(k.data(), DType::kFloat32, {1, 4, skv}),
                    TensorView::contiguous(v.data(), DType::kFloat32, {1, skv, skv}), outputs, o);
  EXPECT_TRUE(s.ok) << s.message;
  std::vector<std::vector<int>> mask(sq, std::vector<int>(skv));
  for (int64_t i = 0; i < sq; ++i) {
    for (int64_t j = 0; j < skv; ++j) mask[i][j] = out[i * skv + j] > 0.0f ? 1 : 0;
  }
  return mask;
}

TEST(WindowSize, FlashAttentionReadmeExamples) {
  EXPECT_EQ(attended(2, 5), (std::vector<std::vector<int>>{{1, 1, 1, 1, 0}, {1, 1, 1, 1, 1}}));
  EXPECT_EQ(attended(5, 2),
            (std::vector<std::vector<int>>{{0, 0}, {0, 0}, {0, 0}, {1, 0}, {1, 1}}));
}

// ---- large head dims (the flash_fwd_large_d shapes, any d) -----------------------------------

std::string large_d_name(const std::tuple<int, DType, int>& param) {
  static const char* kDims[] = {"d160", "d192", "d256", "d384", "d512", "d576_dv512"};
  static const char* kVariants[] = {"causal", "window1024", "ragged"};
  return std::string(kDims[std::get<0>(param)]) + "_" + dtype_name(std::get<1>(param)) + "_" +
         kVariants[std::get<2>(param)];
}

class LargeHeadDimTest : public ::testing::TestWithParam<std::tuple<int, DType, int>> {};

TEST_P(LargeHeadDimTest, MatchesReference) {
  static const std::pair<int64_t, int64_t> kDims[] = {{160, 160}, {192, 192}, {256, 256},
                                                      {384, 384}, {512, 512}, {576, 512}};
  const auto [dim_index, dt, variant] = GetParam();
  const auto [d, dv] = kDims[dim_index];
  // variant 0: causal S = 2048; 1: causal with a 1024 window; 2: ragged non-causal lengths.
  const int64_t sq = variant == 2 ? 1037 : 2048, skv = variant == 2 ? 1531 : 2048;
  Case c = base(dt, sq, skv, d, static_cast<uint64_t>(d * 10 + variant));
  c.bs = 2;
  c.bs_kv = 1;
  c.dv = dv;
  c.stats = StatsLayout::kNone;
  c.options.causal_mask = variant != 2;
  if (variant == 1) c.options.sliding_window = 1024;
  c.rows = sample_rows(sq, 12, c.seed);
  EXPECT_TRUE(check_case(c));
}

INSTANTIATE_TEST_SUITE_P(LargeD, LargeHeadDimTest,
                         ::testing::Combine(::testing::Range(0, 6),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16),
                                            ::testing::Range(0, 3)),
                         [](const auto& param_info) { return large_d_name(param_info.param); });

// ---- modifier arguments are validated like the others --------------------------------------

TEST(Modifiers, BadArgumentsAreRefused) {
  std::vector<float> q(16), k(16), v(16), out(16), lse(4), slopes(3), bias(8);
  Outputs outputs;
  outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, 4, 4});
  outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {1, 4});
  // Refused for `argument` with every buffer of the call as it was, out and lse included.
  const auto refuses = [&](const Options& o, const std::string& argument) {
    BufferSnapshot snap;
    snap.add("q", q).add("k", k).add("v", v).add("alibi_slopes", slopes).add("key_bias", bias);
    snap.add_output("out", out).add_output("lse", lse);
    EXPECT_TRUE(refused_for(
        attention_cte(TensorView::contiguous(q.data(), DType::kFloat32, {1, 4, 4}),
                      TensorView::contiguous(k.data(), DType::kFloat32, {1, 4, 4}),
                      TensorView::contiguous(v.data(), DType::kFloat32, {1, 4, 4}), outputs, o),
        argument));
    EXPECT_TRUE(snap.unchanged()) << argument;
  };
  Options o;
  o.softcap = -1.0f;
  refuses(o, "softcap");
  o = {};
  o.alibi_slopes = TensorView::contiguous(slopes.data(), DType::kFloat32, {3});
  refuses(o, "alibi_slopes");
  o = {};
  o.key_bias = TensorView::contiguous(bias.data(), DType::kFloat32, {1, 8});
  refuses(o, "key_bias");
  o = {};
  o.window_left = -2;
  refuses(o, "window_left");
  o = {};
  o.window_right = -5;
  refuses(o, "window_right");
}

}  // namespace
}  // namespace flashcte::test
