// The fast attention layer (include/flashcte/layer.h) against its float64 oracle
// (src/reference/layer_reference.h): a prefill on attention_cte, a prefix-cached second chunk
// that also rewrites one sequence's tail, then decode steps on decode_attention, with GQA, MQA,
// partial rotary, Llama-3 scaling, a window, sinks, biases and q/k norm, in every dtype.
//
// Tolerance. The oracle rounds to the activation dtype where the module does (R1-R7), in float64
// between them; the fast layer computes the same steps in float32 with other summation orders.
// Each rounded stage (projections, norm, RoPE, attention output, o_proj, bias) can land one ulp of
// the dtype away from the oracle's, and the weights here (|w| <= 0.5, fan-in <= 64) keep the gain
// of a stage near 1, so six stages stay within 6 ulps of the largest output; the bound is twice
// that. In float32 the same reasoning with the float32 ulp is far below the GEMMs' own summation
// error, so float32 uses 1e-5 relative to the largest output (the kernel tests' float32 floor,
// tests/test_util.cc) times the fan-in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flashcte/layer.h"
#include "src/core/half.h"
#include "src/reference/layer_reference.h"
#include "tests/layer/layer_test_util.h"
#include "tests/test_util.h"

namespace flashcte::reference::test {
namespace {

// The tolerance unit (see the file comment): the dtype's ulp, and in float32 the GEMMs' own
// summation error instead.
double ulp_of(DType dtype) {
  return dtype == DType::kFloat32 ? 1e-5 * 64 : flashcte::test::unit_roundoff(dtype);
}

double read(const std::vector<uint16_t>& bits, const std::vector<float>& floats, DType dtype,
            size_t i) {
  if (dtype == DType::kBFloat16) return half::bf16_to_float(bits[i]);
  if (dtype == DType::kFloat16) return half::f16_to_float(bits[i]);
  return floats[i];
}

// One layer run side by side: the fast layer and the oracle, each with its own cache.
class SideBySide {
 public:
  SideBySide(const LayerConfig& config, const LayerWeights& weights, int64_t batch, int64_t max_len)
      : config_(config), weights_(weights), batch_(batch), rng_(7) {
    const Status s = AttentionLayer::create(config, weights, &layer_);
    EXPECT_TRUE(s.ok) << s.message;
    EXPECT_TRUE(layer_->new_cache(batch, max_len, &cache_).ok);
    oracle_cache_ = new_cache(config, batch, max_len);
  }

  // Runs one call with random x at `positions` (batch rows of T each) and compares.
  void step(const std::vector<int64_t>& positions, const std::string& what) {
    const int64_t tokens = static_cast<int64_t>(positions.size()) / batch_;
    const int64_t hidden = config_.hidden_size, n = batch_ * tokens * hidden;
    const std::vector<float> x = random_vector(&rng_, n, 1.0f);
    const DType t = config_.dtype;
    std::vector<float> out_f(t == DType::kFloat32 ? n : 0);
    std::vector<uint16_t> out_h(t == DType::kFloat32 ? 0 : n);
    void* out_data = t == DType::kFloat32 ? static_cast<void*>(out_f.data()) : out_h.data();
    const TensorView xv =
        TensorView::contiguous(x.data(), DType::kFloat32, {batch_, tokens, hidden});
    const TensorView pv = TensorView::contiguous(positions.data(), DType::kInt64, {batch_, tokens});
    const Status s = layer_->forward(
        xv, pv, &cache_, MutableTensorView::contiguous(out_data, t, {batch_, tokens, hidden}));
    ASSERT_TRUE(s.ok) << what << ": " << s.message;
    std::vector<double> expected;
    ASSERT_TRUE(layer_forward(config_, weights_, xv, pv, &oracle_cache_, &expected).ok);
    double largest = 0, worst = 0;
    for (size_t i = 0; i < expected.size(); ++i)
      largest = std::max(largest, std::fabs(expected[i]));
    for (size_t i = 0; i < expected.size(); ++i) {
      worst = std::max(worst, std::fabs(read(out_h, out_f, t, i) - expected[i]));
    }
    const double bound = 12 * ulp_of(t) * std::max(largest, 1e-3);
    EXPECT_LE(worst, bound) << what << " (" << dtype_name(t) << "): largest output " << largest;
    for (int64_t b = 0; b < batch_; ++b) {
      EXPECT_EQ(cache_.length(b), oracle_cache_.lengths[static_cast<size_t>(b)]) << what;
    }
  }

 private:
  LayerConfig config_;
  LayerWeights weights_;
  int64_t batch_;
  std::mt19937 rng_;
  std::unique_ptr<AttentionLayer> layer_;
  KvCache cache_;
  LayerCache oracle_cache_;
};

std::vector<int64_t> rows(const std::vector<std::pair<int64_t, int64_t>>& start_and_count) {
  std::vector<int64_t> positions;
  for (const auto& [start, count] : start_and_count) {
    for (int64_t t = 0; t < count; ++t) positions.push_back(start + t);
  }
  return positions;
}

// Prefill (attention_cte), a second chunk that continues sequence 0 and rewrites sequence 1 from
// position 30 (prefix caching at two prior lengths), then decode (decode_attention) at two
// different positions, single tokens and a 3-token speculation chunk.
void run_conversation(const LayerConfig& config) {
  std::mt19937 rng(11);
  SideBySide run(config, random_weights(config, &rng), 2, 96);
  run.step(rows({{0, 40}, {0, 40}}), "prefill");
  run.step(rows({{40, 24}, {30, 24}}), "second chunk");
  for (int step = 0; step < 3; ++step) {
    run.step(rows({{64 + step, 1}, {54 + step, 1}}), "decode " + std::to_string(step));
  }
  run.step(rows({{67, 3}, {57, 3}}), "speculation chunk");
}

class AttentionLayerTest : public ::testing::TestWithParam<DType> {};

TEST_P(AttentionLayerTest, GqaWithEverythingOn) {
  LayerConfig c = small_config(32, 4, 2, 8);
  c.rotary_dim = 6;
  c.rope_theta = 500;
  c.rope_scaling = Llama3RopeScaling{4.0, 1.0, 2.0, 16};
  c.sliding_window = 20;
  c.qkv_bias = c.o_bias = c.qk_norm = c.sinks = true;
  c.dtype = GetParam();
  run_conversation(c);
}

TEST_P(AttentionLayerTest, MqaPlain) {
  LayerConfig c = small_config(64, 8, 1, 16);
  c.dtype = GetParam();
  run_conversation(c);
}

TEST_P(AttentionLayerTest, MhaNoRopeCustomScale) {
  LayerConfig c = small_config(24, 3, 3, 8);
  c.rope = false;
  c.qk_scale = 0.2;
  c.dtype = GetParam();
  run_conversation(c);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AttentionLayerTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& param_info) {
                           return std::string(dtype_name(param_info.param));
                         });

TEST(AttentionLayerErrors, BadInputsAreRefusedWithTheArgumentNamed) {
  LayerConfig c = small_config(16, 2, 1, 8);
  std::mt19937 rng(3);
  std::unique_ptr<AttentionLayer> layer;
  ASSERT_TRUE(AttentionLayer::create(c, random_weights(c, &rng), &layer).ok);
  KvCache cache;
  ASSERT_TRUE(layer->new_cache(1, 8, &cache).ok);
  std::vector<float> x(4 * 16), out(4 * 16);
  const auto call = [&](const std::vector<int64_t>& positions, int64_t hidden, KvCache* kv) {
    const int64_t tokens = static_cast<int64_t>(positions.size());
    return layer->forward(
        TensorView::contiguous(x.data(), DType::kFloat32, {1, tokens, hidden}),
        TensorView::contiguous(positions.data(), DType::kInt64, {1, tokens}), kv,
        MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, tokens, 16}));
  };
  expect_error(call({0, 1}, 15, &cache), "x: last dimension 15");
  expect_error(call({1, 2}, 16, &cache), "positions: row 0 token 0 is 1; a row must start in [0,");
  expect_error(call({0, 2}, 16, &cache), "positions: row 0 token 1 is 2; positions within a row");
  ASSERT_TRUE(call({0, 1, 2, 3}, 16, &cache).ok);
  EXPECT_EQ(cache.length(0), 4);
  expect_error(call({4, 5, 6, 7, 8}, 16, &cache), "positions: row 0 token 4 is 8, past the cache");
  KvCache other;
  ASSERT_TRUE(KvCache::create(1, 2, 8, 8, DType::kFloat32, &other).ok);
  expect_error(call({0}, 16, &other), "cache: holds (batch 1, kv_heads 2");
  LayerWeights w = random_weights(c, &rng);
  w.k_proj.pop_back();
  expect_error(AttentionLayer::create(c, w, &layer), "k_proj: expected 128 floats, got 127");
  c.num_kv_heads = 3;
  expect_error(AttentionLayer::create(c, w, &layer), "num_kv_heads: must divide num_heads");
  expect_error(KvCache::create(1, 1, 0, 8, DType::kFloat32, &other), "max_len: must be >= 1");
}

}  // namespace
}  // namespace flashcte::reference::test
