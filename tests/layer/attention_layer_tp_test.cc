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

// Runs a 20-token prefill and two decode steps; `layer` may be a rank, made by create() from the
// full weights or, with `shard`, by create_from_shard from the rank's own.
Outputs run_calls(const LayerConfig& config, const LayerWeights& weights, bool shard = false) {
  std::unique_ptr<AttentionLayer> layer;
  const Status created = shard ? AttentionLayer::create_from_shard(config, weights, &layer)
                               : AttentionLayer::create(config, weights, &layer);
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

// A rank made from its own shard (create_from_shard, the shard cut here by rank_heads) computes
// bitwise what the rank made from the full weights computes, with pad heads, replicated KV heads
// and every optional weight.
TEST(AttentionLayerShard, EachRankBitwiseTheRankCutFromTheFullWeights) {
  using Strategy = LayerConfig::GqaStrategy;
  struct Case {
    int64_t heads, kv_heads, tp;
    Strategy strategy;
  };
  bool saw_pad = false;
  for (const Case& k : {Case{8, 2, 4, Strategy::kAuto}, Case{6, 3, 4, Strategy::kAuto},
                        Case{8, 2, 4, Strategy::kConvertToMha}, Case{4, 4, 2, Strategy::kAuto},
                        Case{4, 2, 1, Strategy::kAuto}}) {
    LayerConfig c = small_config(24, k.heads, k.kv_heads, 8);
    c.qkv_bias = c.o_bias = c.sinks = c.qk_norm = true;
    c.tp_degree = k.tp;
    c.gqa_strategy = k.strategy;
    std::mt19937 rng(11);
    const LayerWeights full = random_weights(c, &rng);
    for (int64_t r = 0; r < k.tp; ++r) {
      SCOPED_TRACE(std::to_string(k.heads) + "/" + std::to_string(k.kv_heads) + " at tp " +
                   std::to_string(k.tp) + ", rank " + std::to_string(r));
      c.tp_rank = r;
      RankHeads heads;
      ASSERT_TRUE(rank_heads(c, &heads).ok);
      saw_pad |= std::count(heads.query_heads.begin(), heads.query_heads.end(), -1) > 0 &&
                 std::count(heads.kv_heads.begin(), heads.kv_heads.end(), -1) > 0;
      const Outputs cut = run_calls(c, full);
      const Outputs own = run_calls(c, cut_shard(c, heads, full), true);
      ASSERT_EQ(own.steps.size(), cut.steps.size());
      for (size_t step = 0; step < cut.steps.size(); ++step) {
        EXPECT_TRUE(own.steps[step] == cut.steps[step]) << "call " << step;
      }
    }
  }
  EXPECT_TRUE(saw_pad);  // 6/3 at tp 4 (CONVERT_TO_MHA) pads query and KV heads
}

// A shard of the wrong size, or with a pad head's block not zero, is refused naming the weight.
TEST(AttentionLayerShard, AWrongShardIsRefusedNamingTheWeight) {
  LayerConfig c = small_config(24, 6, 3, 8);
  c.qkv_bias = c.sinks = true;
  c.tp_degree = 4;
  c.tp_rank = 3;  // holds pad heads: query heads [6, 7] of 8 and KV heads [6, 7] of 8
  std::mt19937 rng(3);
  const LayerWeights full = random_weights(c, &rng);
  RankHeads heads;
  ASSERT_TRUE(rank_heads(c, &heads).ok);
  ASSERT_EQ(heads.query_heads.back(), -1);
  ASSERT_EQ(heads.kv_heads.back(), -1);
  const LayerWeights shard = cut_shard(c, heads, full);
  std::unique_ptr<AttentionLayer> layer;
  ASSERT_TRUE(AttentionLayer::create_from_shard(c, shard, &layer).ok);
  const auto refused = [&](const LayerWeights& w, const std::string& message) {
    std::unique_ptr<AttentionLayer> l;
    expect_error(AttentionLayer::create_from_shard(c, w, &l), message);
    EXPECT_EQ(l, nullptr);
  };
  LayerWeights w = full;  // the full layer's weights are not the rank's shard
  refused(w, "q_proj: expected 384 floats, got 1152 (the rank's shard");
  const int64_t d = 8, hidden = 24, last_q = static_cast<int64_t>(heads.query_heads.size()) - 1;
  w = shard;
  w.q_proj[static_cast<size_t>(last_q * d * hidden + 5)] = 1.0f;
  refused(w, "q_proj: the rows of pad query head 1 must be 0 (the rank's shard)");
  w = shard;
  w.o_proj[static_cast<size_t>(3 * 2 * d + last_q * d)] = 1.0f;  // row 3, the pad head's column
  refused(w, "o_proj: the columns of pad query head 1 must be 0 (the rank's shard)");
  w = shard;
  w.sinks.back() = 0.5f;
  refused(w, "sinks: the entry of pad query head 1 must be 0 (the rank's shard)");
  w = shard;
  w.v_bias.back() = 0.5f;
  refused(w, "v_bias: the rows of pad KV head 1 must be 0 (the rank's shard)");
}

}  // namespace
}  // namespace flashcte::reference::test
