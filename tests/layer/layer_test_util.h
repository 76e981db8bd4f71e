// Helpers of the layer oracle's tests (layer_reference_test.cc, layer_reference_cache_test.cc):
// small configs, hand-made and random weights, and one-call runs with the status checked.
#ifndef FLASHCTE_TESTS_LAYER_LAYER_TEST_UTIL_H_
#define FLASHCTE_TESTS_LAYER_LAYER_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "src/reference/layer_reference.h"

namespace flashcte::reference::test {

inline const double kPi = std::acos(-1.0);
inline float f32(double x) { return static_cast<float>(x); }

inline LayerConfig small_config(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d) {
  LayerConfig c;
  c.hidden_size = hidden;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = d;
  return c;
}

// A GQA layer (32 wide, 4 query heads over 2 KV heads of d = 8) with every option on: partial
// Llama-3-scaled RoPE, a sliding window, biases, QK norm and sinks.
inline LayerConfig everything_on(DType dtype) {
  LayerConfig c = small_config(32, 4, 2, 8);
  c.rotary_dim = 6;
  c.rope_theta = 500;
  c.rope_scaling = Llama3RopeScaling{4.0, 1.0, 2.0, 16};
  c.sliding_window = 20;
  c.qkv_bias = c.o_bias = c.qk_norm = c.sinks = true;
  c.dtype = dtype;
  return c;
}

inline std::vector<float> identity(int64_t n) {
  std::vector<float> w(n * n, 0.0f);
  for (int64_t i = 0; i < n; ++i) w[i * n + i] = 1.0f;
  return w;
}

inline LayerWeights identity_weights(int64_t n) {
  LayerWeights w;
  w.q_proj = w.k_proj = w.v_proj = w.o_proj = identity(n);
  return w;
}

// Runs one call; x is (batch, T, hidden) row-major, positions (batch, T).
inline std::vector<double> run(const LayerConfig& c, const LayerWeights& w, LayerCache* cache,
                               const std::vector<float>& x, const std::vector<int64_t>& positions,
                               int64_t batch) {
  const int64_t tokens = static_cast<int64_t>(positions.size()) / batch;
  std::vector<double> out;
  const Status s = layer_forward(
      c, w, TensorView::contiguous(x.data(), DType::kFloat32, {batch, tokens, c.hidden_size}),
      TensorView::contiguous(positions.data(), DType::kInt64, {batch, tokens}), cache, &out);
  EXPECT_TRUE(s.ok) << s.message;
  return out;
}

inline LayerCache new_cache(const LayerConfig& c, int64_t batch, int64_t max_len) {
  LayerCache cache;
  EXPECT_TRUE(make_layer_cache(c, batch, max_len, &cache).ok);
  return cache;
}

// --- RoPE (LAYER.md section 3).
inline std::vector<float> random_vector(std::mt19937* rng, int64_t n, float range = 0.5f) {
  std::uniform_real_distribution<float> u(-range, range);
  std::vector<float> v(n);
  for (float& f : v) f = u(*rng);
  return v;
}

// Everything on: GQA 4/2, biases, q/k norm, partial rotary, Llama-3 scaling, window, sinks.
inline LayerConfig full_config(DType dtype) {
  LayerConfig c = small_config(8, 4, 2, 6);
  c.rotary_dim = 4;
  c.rope_theta = 500;
  c.rope_scaling = Llama3RopeScaling{4.0, 1.0, 2.0, 16};
  c.sliding_window = 5;
  c.qkv_bias = c.o_bias = c.qk_norm = c.sinks = true;
  c.dtype = dtype;
  return c;
}

inline LayerWeights random_weights(const LayerConfig& c, std::mt19937* rng) {
  const int64_t d = c.head_dim, q = c.num_heads * d, kv = c.num_kv_heads * d, h = c.hidden_size;
  LayerWeights w;
  w.q_proj = random_vector(rng, q * h);
  w.k_proj = random_vector(rng, kv * h);
  w.v_proj = random_vector(rng, kv * h);
  w.o_proj = random_vector(rng, h * q);
  if (c.qkv_bias) {
    w.q_bias = random_vector(rng, q);
    w.k_bias = random_vector(rng, kv);
    w.v_bias = random_vector(rng, kv);
  }
  if (c.o_bias) w.o_bias = random_vector(rng, h);
  if (c.qk_norm) {
    w.q_norm = random_vector(rng, d, 2.0f);
    w.k_norm = random_vector(rng, d, 2.0f);
  }
  if (c.sinks) w.sinks = random_vector(rng, c.num_heads, 2.0f);
  return w;
}

// Rank `heads`' shard cut from the full weights (the blocks include/flashcte/layer.h's RankHeads
// names, zero for a pad head): what a loader reading only the rank's rows and columns of a
// checkpoint hands AttentionLayer::create_from_shard.
inline LayerWeights cut_shard(const LayerConfig& c, const RankHeads& heads,
                              const LayerWeights& full) {
  const int64_t d = c.head_dim, hidden = c.hidden_size, full_q = c.num_heads * d;
  const auto rows = [d](const std::vector<float>& source, const std::vector<int64_t>& of,
                        int64_t row_length) {
    std::vector<float> out;
    if (source.empty()) return out;
    for (const int64_t h : of) {
      for (int64_t i = 0; i < d * row_length; ++i) {
        out.push_back(h < 0 ? 0.0f : source[static_cast<size_t>(h * d * row_length + i)]);
      }
    }
    return out;
  };
  LayerWeights w;
  w.q_proj = rows(full.q_proj, heads.query_heads, hidden);
  w.k_proj = rows(full.k_proj, heads.kv_heads, hidden);
  w.v_proj = rows(full.v_proj, heads.kv_heads, hidden);
  for (int64_t r = 0; r < hidden; ++r) {
    for (const int64_t h : heads.query_heads) {
      for (int64_t i = 0; i < d; ++i) {
        w.o_proj.push_back(h < 0 ? 0.0f : full.o_proj[static_cast<size_t>(r * full_q + h * d + i)]);
      }
    }
  }
  w.q_bias = rows(full.q_bias, heads.query_heads, 1);
  w.k_bias = rows(full.k_bias, heads.kv_heads, 1);
  w.v_bias = rows(full.v_bias, heads.kv_heads, 1);
  if (c.tp_degree == 1) w.o_bias = full.o_bias;  // past one rank, added once after the sum
  w.q_norm = full.q_norm;
  w.k_norm = full.k_norm;
  for (const int64_t h : heads.query_heads) {
    if (!full.sinks.empty()) w.sinks.push_back(h < 0 ? 0.0f : full.sinks[static_cast<size_t>(h)]);
  }
  return w;
}

// GQA with 2 query heads per KV head equals MHA with each KV head's weights duplicated for its

inline void expect_error(const Status& s, const std::string& prefix) {
  EXPECT_FALSE(s.ok);
  EXPECT_EQ(s.message.rfind(prefix, 0), 0u)
      << "expected \"" << prefix << "...\", got \"" << s.message << "\"";
}

}  // namespace flashcte::reference::test

#endif  // FLASHCTE_TESTS_LAYER_LAYER_TEST_UTIL_H_
