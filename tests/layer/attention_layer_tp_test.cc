// The layer built as each rank of a tensor-parallel group (LayerConfig::tp_degree / tp_rank):
// the ranks' partial outputs, summed, plus o_bias once, equal the whole layer's output, under
// both GQA strategies of LAYER.md section 4 (float32, so the sum's rounding is the only
// difference: a relative 1e-5 of the largest output bounds it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "flashcte/layer.h"
#include "tests/layer/layer_test_util.h"
#include "tests/test_util.h"

namespace flashcte::reference::test {
namespace {

struct Outputs {
  std::vector<std::vector<float>> steps;  // one (batch, T, hidden) output per call
};

// Runs a 20-token prefill and two decode steps; `layer` may be a rank.
Outputs run_calls(const LayerConfig& config, const LayerWeights& weights) {
  std::unique_ptr<AttentionLayer> layer;
  const Status created = AttentionLayer::create(config, weights, &layer);
  EXPECT_TRUE(created.ok) << created.message;
  Outputs result;
  if (!created.ok) return result;
  KvCache cache;
  EXPECT_TRUE(layer->new_cache(1, 32, &cache).ok);
  std::mt19937 rng(5);  // the same x for every rank
  int64_t position = 0;
  for (int64_t tokens : {20, 1, 1}) {
    const std::vector<float> x = random_vector(&rng, tokens * config.hidden_size, 1.0f);
    std::vector<int64_t> positions(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) positions[static_cast<size_t>(t)] = position + t;
    position += tokens;
    std::vector<float> out(x.size());
    const Status s = layer->forward(
        TensorView::contiguous(x.data(), DType::kFloat32, {1, tokens, config.hidden_size}),
        TensorView::contiguous(positions.data(), DType::kInt64, {1, tokens}), &cache,
        MutableTensorView::contiguous(out.data(), DType::kFloat32,
                                      {1, tokens, config.hidden_size}));
    EXPECT_TRUE(s.ok) << s.message;
    result.steps.push_back(std::move(out));
  }
  return result;
}

void expect_ranks_sum_to_layer(
    int64_t heads, int64_t kv_heads, int64_t tp,
    LayerConfig::GqaStrategy strategy = LayerConfig::GqaStrategy::kAuto) {
  LayerConfig c = small_config(24, heads, kv_heads, 8);
  c.qkv_bias = c.o_bias = c.sinks = true;
  std::mt19937 rng(9);
  const LayerWeights w = random_weights(c, &rng);
  const Outputs whole = run_calls(c, w);
  std::vector<Outputs> ranks;
  for (int64_t r = 0; r < tp; ++r) {
    LayerConfig rank = c;
    rank.tp_degree = tp;
    rank.tp_rank = r;
    rank.gqa_strategy = strategy;
    ranks.push_back(run_calls(rank, w));
  }
  for (size_t step = 0; step < whole.steps.size(); ++step) {
    const std::vector<float>& expected = whole.steps[step];
    double largest = 0, worst = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      double sum = w.o_bias[i % static_cast<size_t>(c.hidden_size)];
      for (const Outputs& rank : ranks) sum += rank.steps[step][i];
      largest = std::max(largest, std::fabs(static_cast<double>(expected[i])));
      worst = std::max(worst, flashcte::test::abs_error(sum, expected[i]));
    }
    EXPECT_LE(worst, 1e-5 * largest)
        << heads << "/" << kv_heads << " heads at tp " << tp << ", call " << step;
  }
}

TEST(AttentionLayerTensorParallel, ReplicateToTpDegree) { expect_ranks_sum_to_layer(8, 2, 4); }
TEST(AttentionLayerTensorParallel, ConvertToMhaWithPadHeads) { expect_ranks_sum_to_layer(6, 3, 4); }
TEST(AttentionLayerTensorParallel, MhaSplitEvenly) { expect_ranks_sum_to_layer(4, 4, 2); }

// 8/2 at tp 4: ON picks REPLICATE (one KV head per rank); asked for CONVERT, each rank holds two
// KV heads, one per query head.
TEST(AttentionLayerTensorParallel, ConvertToMhaWhenAskedFor) {
  expect_ranks_sum_to_layer(8, 2, 4, LayerConfig::GqaStrategy::kConvertToMha);
}

TEST(AttentionLayerTensorParallel, RankConfigHoldsTheRanksHeads) {
  LayerConfig c = small_config(24, 8, 2, 8);
  c.o_bias = true;
  c.tp_degree = 4;
  c.tp_rank = 3;
  LayerConfig rank;
  ASSERT_TRUE(rank_config(c, &rank).ok);
  EXPECT_EQ(rank.num_heads, 2);
  EXPECT_EQ(rank.num_kv_heads, 1);
  EXPECT_FALSE(rank.o_bias);
  EXPECT_EQ(rank.tp_degree, 1);
  c.gqa_strategy = LayerConfig::GqaStrategy::kConvertToMha;
  ASSERT_TRUE(rank_config(c, &rank).ok);
  EXPECT_EQ(rank.num_heads, 2);
  EXPECT_EQ(rank.num_kv_heads, 2);
  c.tp_degree = 1;
  c.tp_rank = 0;
  ASSERT_TRUE(rank_config(c, &rank).ok);
  EXPECT_EQ(rank.num_heads, 8);
  EXPECT_TRUE(rank.o_bias);
}

TEST(AttentionLayerTensorParallel, ReplicateThatCannotShardIsRefused) {
  LayerConfig c = small_config(24, 6, 3, 8);
  c.tp_degree = 4;
  c.tp_rank = 1;
  c.gqa_strategy = LayerConfig::GqaStrategy::kReplicateToTpDegree;
  LayerConfig rank;
  expect_error(rank_config(c, &rank), "num_kv_heads: REPLICATE_TO_TP_DEGREE replicates");
  std::mt19937 rng(1);
  std::unique_ptr<AttentionLayer> layer;
  expect_error(AttentionLayer::create(c, random_weights(c, &rng), &layer),
               "num_kv_heads: REPLICATE_TO_TP_DEGREE replicates");
}

TEST(AttentionLayerTensorParallel, RankOutsideTheGroupIsRefused) {
  LayerConfig c = small_config(16, 2, 1, 8);
  std::mt19937 rng(1);
  c.tp_degree = 2;
  c.tp_rank = 2;
  std::unique_ptr<AttentionLayer> layer;
  expect_error(AttentionLayer::create(c, random_weights(c, &rng), &layer),
               "tp_rank: must be in [0, tp_degree = 2), got 2");
}

}  // namespace
}  // namespace flashcte::reference::test
