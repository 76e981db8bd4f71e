// The layer oracle (src/reference/layer_reference.h) on cases small enough to work by hand: the
// expected values are closed forms computed here from LAYER.md's formulas, never by the code
// under test (RoPE, Llama-3 scaling, projections, q/k norm, scale, GQA, sinks, window).
#include "src/reference/layer_reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tests/layer/layer_test_util.h"

namespace flashcte::reference::test {
namespace {

TEST(LayerReferenceRope, RotatesKnownVectorHalfSplit) {
  const LayerConfig c = small_config(4, 1, 1, 4);
  std::vector<double> x = {1, 2, 3, 4};
  ASSERT_TRUE(apply_rope(c, 3, &x).ok);
  // inv_freq = 1 / 10000^(2i/4) = {1, 0.01} in float32; theta = 3 * inv_freq in float32.
  const float inv1 = f32(1.0 / 100.0);
  const double t0 = 3.0, t1 = f32(3.0f * inv1);
  const double c0 = f32(std::cos(t0)), s0 = f32(std::sin(t0));
  const double c1 = f32(std::cos(t1)), s1 = f32(std::sin(t1));
  // Pairs (i, i + d/2): x'[i] = x[i] cos - x[i+2] sin, x'[i+2] = x[i+2] cos + x[i] sin.
  EXPECT_NEAR(x[0], 1 * c0 - 3 * s0, 1e-6);
  EXPECT_NEAR(x[2], 3 * c0 + 1 * s0, 1e-6);
  EXPECT_NEAR(x[1], 2 * c1 - 4 * s1, 1e-6);
  EXPECT_NEAR(x[3], 4 * c1 + 2 * s1, 1e-6);
}

TEST(LayerReferenceRope, CosSinRoundedToTheActivationDtype) {
  LayerConfig c = small_config(2, 1, 1, 2);
  // cos(1) = 0.5403023, sin(1) = 0.8414710. bfloat16 keeps 8 significant bits (steps of 2^-8 in
  // [0.5, 1)): 138/256 and 215/256. float16 keeps 11 (steps of 2^-11): 1107/2048 and 1723/2048.
  const struct {
    DType dtype;
    double cos, sin;
  } cases[] = {{DType::kBFloat16, 138.0 / 256, 215.0 / 256},
               {DType::kFloat16, 1107.0 / 2048, 1723.0 / 2048}};
  for (const auto& k : cases) {
    c.dtype = k.dtype;
    std::vector<double> cos, sin, x = {1, 0};
    ASSERT_TRUE(rope_cos_sin(c, 1, &cos, &sin).ok);
    EXPECT_EQ(cos, (std::vector<double>{k.cos, k.cos}));
    EXPECT_EQ(sin, (std::vector<double>{k.sin, k.sin}));
    ASSERT_TRUE(apply_rope(c, 1, &x).ok);
    EXPECT_EQ(x, (std::vector<double>{k.cos, k.sin}));
  }
}

TEST(LayerReferenceRope, PartialRotaryRotatesTheFirstChannelsOnly) {
  LayerConfig c = small_config(4, 1, 1, 4);
  c.rotary_dim = 2;
  std::vector<double> x = {1, 2, 3, 4};
  ASSERT_TRUE(apply_rope(c, 1, &x).ok);
  const double c1 = f32(std::cos(1.0)), s1 = f32(std::sin(1.0));  // inv_freq = {1}
  EXPECT_NEAR(x[0], 1 * c1 - 2 * s1, 1e-6);
  EXPECT_NEAR(x[1], 2 * c1 + 1 * s1, 1e-6);
  EXPECT_EQ(x[2], 3);
  EXPECT_EQ(x[3], 4);
  // inv_freq uses rotary_dim as its dim: 1 / 100^(2i/4) = {1, 0.1}.
  c = small_config(8, 1, 1, 8);
  c.rotary_dim = 4;
  c.rope_theta = 100;
  std::vector<double> inv;
  ASSERT_TRUE(rope_inverse_frequencies(c, &inv).ok);
  EXPECT_EQ(inv, (std::vector<double>{1.0, f32(0.1)}));
}

// Section 3's Llama-3 remap on frequencies {1, 0.01, 0.0001} (base 1e6, d = 6) with
// original_max_position_embeddings 1000, low 1, high 4, factor 8: lo_wl = 1000, hi_wl = 250, so
// wavelengths 2*pi (kept), 200*pi = 628 (smooth band) and 20000*pi (divided by 8).
TEST(LayerReferenceRope, Llama3ScalingFrequenciesByHand) {
  LayerConfig c = small_config(6, 1, 1, 6);
  c.rope_theta = 1e6;
  c.rope_scaling = Llama3RopeScaling{8.0, 1.0, 4.0, 1000};
  std::vector<double> inv;
  ASSERT_TRUE(rope_inverse_frequencies(c, &inv).ok);
  ASSERT_EQ(inv.size(), 3u);
  const double smooth = (1000.0 / (2 * kPi / 0.01) - 1.0) / (4.0 - 1.0);  // 0.19718
  EXPECT_EQ(inv[0], 1.0);
  EXPECT_NEAR(inv[1], (1 - smooth) * 0.01 / 8 + smooth * 0.01, 1e-6 * 0.003);  // 0.0029753
  EXPECT_NEAR(inv[2], 0.0001 / 8, 1e-6 * 1.25e-5);
  // The defaults (Llama-3-8B, d = 128, base 500000): the first frequency is kept, the last one
  // (wavelength 2*pi*500000^(126/128), far above 8192) is divided by 8.
  c = small_config(128, 1, 1, 128);
  c.rope_theta = 500000;
  c.rope_scaling = Llama3RopeScaling{};
  ASSERT_TRUE(rope_inverse_frequencies(c, &inv).ok);
  EXPECT_EQ(inv[0], 1.0);
  EXPECT_NEAR(inv[63], std::pow(500000.0, -126.0 / 128) / 8, 1e-6 * inv[63]);
  LayerConfig plain = c;
  plain.rope_scaling.reset();
  std::vector<double> unscaled;
  ASSERT_TRUE(rope_inverse_frequencies(plain, &unscaled).ok);
  int kept = 0, divided = 0;
  for (int i = 0; i < 64; ++i) {
    const double wavelen = 2 * kPi / unscaled[i];
    if (wavelen < 2048) kept += inv[i] == unscaled[i];
    if (wavelen > 8192) divided += std::abs(inv[i] - unscaled[i] / 8) < 1e-7 * unscaled[i];
  }
  EXPECT_GT(kept, 20);
  EXPECT_GT(divided, 20);
}

// --- The layer on hand-checkable weights.

// One token at position 0 sees only itself: out = Wo (Wv x + bv) + bo whatever Q and K are.
// Wv shifts (v[i] = x[i+1]) and Wo reverses, so a transposed weight layout would show.
TEST(LayerReference, OneTokenIdentityLikeWeights) {
  LayerConfig c = small_config(4, 1, 1, 4);
  c.qkv_bias = c.o_bias = true;
  LayerWeights w = identity_weights(4);
  w.v_proj.assign(16, 0.0f);
  w.o_proj.assign(16, 0.0f);
  for (int i = 0; i < 3; ++i) w.v_proj[i * 4 + i + 1] = 1.0f;  // row = output feature
  for (int i = 0; i < 4; ++i) w.o_proj[i * 4 + (3 - i)] = 1.0f;
  w.q_bias = {5, 6, 7, 8};
  w.k_bias = {-1, 2, -3, 4};
  w.v_bias = {0.5f, 0.25f, 0.125f, 1.0f};
  w.o_bias = {10, 20, 30, 40};
  LayerCache cache = new_cache(c, 1, 4);
  const std::vector<double> out = run(c, w, &cache, {1, 2, 3, 4}, {0}, 1);
  const double v[4] = {2 + 0.5, 3 + 0.25, 4 + 0.125, 0 + 1.0};
  EXPECT_EQ(out, (std::vector<double>{v[3] + 10, v[2] + 20, v[1] + 30, v[0] + 40}));
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{1}));
  // The cache holds V unrotated and K after RoPE at position 0 (the identity): k = x + bk.
  EXPECT_EQ(std::vector<double>(cache.v.begin(), cache.v.begin() + 4),
            (std::vector<double>{v[0], v[1], v[2], v[3]}));
  EXPECT_EQ(std::vector<double>(cache.k.begin(), cache.k.begin() + 4),
            (std::vector<double>{0, 4, 0, 8}));
}

// Two tokens at positions 0 and 1 with identity weights (d = 2): the scores of the second token
// are scale * (R(1) x1) . x0 and scale * |x1|^2; V is not rotated.
TEST(LayerReference, RopeRotatesScoresNotValues) {
  const LayerConfig c = small_config(2, 1, 1, 2);
  LayerCache cache = new_cache(c, 1, 2);
  const std::vector<double> out = run(c, identity_weights(2), &cache, {1, 0, 0.5f, 1}, {0, 1}, 1);
  const double cs = f32(std::cos(1.0)), sn = f32(std::sin(1.0));
  const double q1[2] = {0.5 * cs - 1 * sn, 1 * cs + 0.5 * sn};  // R(1) x1
  const double scale = 1 / std::sqrt(2.0);
  const double s0 = scale * (q1[0] * 1 + q1[1] * 0), s1 = scale * (0.5 * 0.5 + 1 * 1);
  const double w0 = std::exp(s0) / (std::exp(s0) + std::exp(s1)), w1 = 1 - w0;
  EXPECT_NEAR(out[0], 1, 1e-6);
  EXPECT_NEAR(out[1], 0, 1e-6);
  EXPECT_NEAR(out[2], w0 * 1 + w1 * 0.5, 1e-6);
  EXPECT_NEAR(out[3], w0 * 0 + w1 * 1, 1e-6);
}

// q/k RMSNorm per head, before RoPE (section 8): q = R(pos) (x / rms(x) * wq).
TEST(LayerReference, QkNormIsAppliedBeforeRope) {
  LayerConfig c = small_config(2, 1, 1, 2);
  c.qk_norm = true;
  c.qk_norm_eps = 0.25;
  LayerWeights w = identity_weights(2);
  w.q_norm = {1.0f, 3.0f};
  w.k_norm = {2.0f, 0.5f};
  LayerCache cache = new_cache(c, 1, 2);
  const std::vector<float> x = {1, 2, 3, -1};
  const std::vector<double> out = run(c, w, &cache, x, {0, 1}, 1);
  const auto norm = [&](double a, double b, const std::vector<float>& wn, double* o) {
    const double inv_rms = 1 / std::sqrt((a * a + b * b) / 2 + 0.25);
    o[0] = a * inv_rms * wn[0];
    o[1] = b * inv_rms * wn[1];
  };
  const auto rot = [](double* v) {
    const double cs = f32(std::cos(1.0)), sn = f32(std::sin(1.0)), a = v[0], b = v[1];
    v[0] = a * cs - b * sn;
    v[1] = b * cs + a * sn;
  };
  double q[2], k0[2], k1[2];
  norm(3, -1, w.q_norm, q);
  rot(q);
  norm(1, 2, w.k_norm, k0);
  norm(3, -1, w.k_norm, k1);
  rot(k1);
  const double scale = 1 / std::sqrt(2.0);
  const double s0 = scale * (q[0] * k0[0] + q[1] * k0[1]);
  const double s1 = scale * (q[0] * k1[0] + q[1] * k1[1]);
  const double w0 = 1 / (1 + std::exp(s1 - s0));
  EXPECT_NEAR(out[2], w0 * 1 + (1 - w0) * 3, 2e-6);
  EXPECT_NEAR(out[3], w0 * 2 + (1 - w0) * -1, 2e-6);
}

// NoPE, d = 1, weights 1: x = (1, 2) gives scores 2s and 4s for the second token.
TEST(LayerReference, QkScaleReplacesOneOverSqrtD) {
  LayerConfig c = small_config(1, 1, 1, 1);
  c.rope = false;
  const LayerWeights w = identity_weights(1);
  for (double scale : {0.0, 1.0, 0.5, 3.0}) {
    c.qk_scale = scale;
    const double s = scale == 0 ? 1.0 : scale;  // 0 means unset: 1/sqrt(1)
    LayerCache cache = new_cache(c, 1, 2);
    const std::vector<double> out = run(c, w, &cache, {1, 2}, {0, 1}, 1);
    const double e0 = std::exp(2 * s), e1 = std::exp(4 * s);
    EXPECT_NEAR(out[1], (e0 * 1 + e1 * 2) / (e0 + e1), 1e-6) << scale;
  }
}

// two query heads (section 5: repeat_kv, query head j reads KV head j / n_rep); MQA likewise.
TEST(LayerReference, GqaEqualsDuplicatedKv) {
  std::mt19937 rng(1);
  for (int64_t kv_heads : {2, 1}) {
    LayerConfig gqa = full_config(DType::kBFloat16);
    gqa.num_kv_heads = kv_heads;
    const LayerWeights w = random_weights(gqa, &rng);
    LayerConfig mha = gqa;
    mha.num_kv_heads = 4;
    LayerWeights dup = w;
    const int64_t block = gqa.head_dim * gqa.hidden_size, group = 4 / kv_heads;
    dup.k_proj.clear();
    dup.v_proj.clear();
    dup.k_bias.clear();
    dup.v_bias.clear();
    for (int64_t head = 0; head < 4; ++head) {
      const int64_t src = head / group;
      dup.k_proj.insert(dup.k_proj.end(), w.k_proj.begin() + src * block,
                        w.k_proj.begin() + (src + 1) * block);
      dup.v_proj.insert(dup.v_proj.end(), w.v_proj.begin() + src * block,
                        w.v_proj.begin() + (src + 1) * block);
      const auto b = w.k_bias.begin() + src * gqa.head_dim,
                 vb = w.v_bias.begin() + src * gqa.head_dim;
      dup.k_bias.insert(dup.k_bias.end(), b, b + gqa.head_dim);
      dup.v_bias.insert(dup.v_bias.end(), vb, vb + gqa.head_dim);
    }
    const std::vector<float> x = random_vector(&rng, 2 * 7 * 8, 2.0f);
    const std::vector<int64_t> pos = {0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6};
    LayerCache cache_gqa = new_cache(gqa, 2, 8), cache_mha = new_cache(mha, 2, 8);
    EXPECT_EQ(run(gqa, w, &cache_gqa, x, pos, 2), run(mha, dup, &cache_mha, x, pos, 2));
  }
}

// Sinks are value-less, unscaled logits: with Q = 0 every score is 0, and a sink of ln 3 takes
// 3/4 of the weight, whatever qk_scale is (section 8).
TEST(LayerReference, SinkIsAnUnscaledValuelessLogit) {
  LayerConfig c = small_config(2, 1, 1, 2);
  c.sinks = true;
  c.qk_scale = 7.0;
  LayerWeights w = identity_weights(2);
  w.q_proj.assign(4, 0.0f);
  w.sinks = {f32(std::log(3.0))};
  LayerCache cache = new_cache(c, 1, 1);
  const std::vector<double> out = run(c, w, &cache, {2, -4}, {0}, 1);
  const double weight = 1 / (1 + std::exp(static_cast<double>(w.sinks[0])));  // ~1/4
  EXPECT_NEAR(out[0], 2 * weight, 1e-6);
  EXPECT_NEAR(out[1], -4 * weight, 1e-6);
  EXPECT_NEAR(weight, 0.25, 1e-7);
}

TEST(LayerReference, HugeSinkSilencesTheHeadAndTinySinkChangesNothing) {
  std::mt19937 rng(2);
  LayerConfig c = full_config(DType::kFloat32);
  c.o_bias = false;
  LayerWeights w = random_weights(c, &rng);
  w.o_bias.clear();
  const std::vector<float> x = random_vector(&rng, 5 * 8, 2.0f);
  const std::vector<int64_t> pos = {0, 1, 2, 3, 4};
  w.sinks.assign(4, 1e4f);
  LayerCache cache = new_cache(c, 1, 5);
  for (double v : run(c, w, &cache, x, pos, 1)) EXPECT_LT(std::abs(v), 1e-30);
  w.sinks.assign(4, -1e4f);
  cache = new_cache(c, 1, 5);
  const std::vector<double> tiny = run(c, w, &cache, x, pos, 1);
  LayerConfig no_sinks = c;
  no_sinks.sinks = false;
  w.sinks.clear();
  cache = new_cache(no_sinks, 1, 5);
  EXPECT_EQ(tiny, run(no_sinks, w, &cache, x, pos, 1));
}

// With Q = 0 the weights are uniform over the visible keys: a window of 2 averages the token and
// its predecessor (section 8: j visible when i - j < w), no window averages everything so far.
TEST(LayerReference, WindowExcludesOldTokens) {
  LayerConfig c = small_config(2, 1, 1, 2);
  LayerWeights w = identity_weights(2);
  w.q_proj.assign(4, 0.0f);
  const std::vector<float> x = {1, 10, 2, 20, 4, 40, 8, 80};
  for (int64_t window : {0, 2}) {
    c.sliding_window = window;
    LayerCache cache = new_cache(c, 1, 4);
    const std::vector<double> out = run(c, w, &cache, x, {0, 1, 2, 3}, 1);
    const std::vector<double> expected =
        window == 2 ? std::vector<double>{1, 10, 1.5, 15, 3, 30, 6, 60}
                    : std::vector<double>{1, 10, 1.5, 15, 7.0 / 3, 70.0 / 3, 3.75, 37.5};
    for (int i = 0; i < 8; ++i) EXPECT_NEAR(out[i], expected[i], 1e-5) << window << " " << i;
  }
}

}  // namespace
}  // namespace flashcte::reference::test
