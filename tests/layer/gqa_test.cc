// GQA sharding (src/layer/gqa.h) against shared/spec/LAYER.md section 4: every row of its
// worked-examples table (counts, then what changes in the weights), the section 9 items about
// sharding, the invariants behind them on a grid of configurations, and the layer oracle run
// rank by rank (the ranks' o_proj partials must sum to the unsharded layer).
#include "src/layer/gqa.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "src/reference/layer_reference.h"
#include "tests/test_util.h"

namespace flashcte::layer {
namespace {

using S = GqaStrategy;

struct Example {
  const char* name;
  int64_t heads, kv_heads, tp;
  S strategy;
  int64_t padded_heads, padded_kv_heads, h, kv, n_rep, kv_repeats;
};

// LAYER.md section 4, "Worked examples", row by row (kv_repeats from its "what changes" column).
const Example kExamples[] = {
    {"H32_KV8_tp2", 32, 8, 2, S::kConvertToMha, 32, 8, 16, 4, 4, 1},
    {"H32_KV8_tp4", 32, 8, 4, S::kConvertToMha, 32, 8, 8, 2, 4, 1},
    {"H32_KV8_tp8", 32, 8, 8, S::kReplicateToTpDegree, 32, 8, 4, 1, 4, 1},
    {"H32_KV8_tp32", 32, 8, 32, S::kReplicateToTpDegree, 32, 32, 1, 1, 1, 4},
    {"H56_KV8_tp32", 56, 8, 32, S::kReplicateToTpDegree, 64, 32, 2, 1, 2, 4},
    {"H40_KV8_tp16", 40, 8, 16, S::kReplicateToTpDegree, 48, 16, 3, 1, 3, 2},
    {"H40_KV8_tp12", 40, 8, 12, S::kConvertToMha, 48, 48, 4, 4, 1, 5},
    {"H20_KV20_tp8", 20, 20, 8, S::kConvertToMha, 24, 24, 3, 3, 1, 1},
};

class GqaWorkedExample : public ::testing::TestWithParam<Example> {};

TEST_P(GqaWorkedExample, HeadCounts) {
  const Example& e = GetParam();
  EXPECT_EQ(choose_gqa_strategy(e.tp, e.kv_heads), e.strategy);
  GqaSharding s;
  ASSERT_TRUE(plan_gqa_sharding(e.tp, e.heads, e.kv_heads, &s).ok);
  EXPECT_EQ(s.strategy, e.strategy);
  EXPECT_EQ(s.padded_heads, e.padded_heads);
  EXPECT_EQ(s.padded_kv_heads, e.padded_kv_heads);
  EXPECT_EQ(s.heads_per_rank, e.h);
  EXPECT_EQ(s.kv_heads_per_rank, e.kv);
  EXPECT_EQ(s.n_rep, e.n_rep);
  EXPECT_EQ(s.kv_repeats, e.kv_repeats);
}

INSTANTIATE_TEST_SUITE_P(LayerMd, GqaWorkedExample, ::testing::ValuesIn(kExamples),
                         [](const auto& example) { return std::string(example.param.name); });

TEST(GqaStrategyName, IsOnsEnumValue) {
  EXPECT_STREQ(gqa_strategy_name(S::kReplicateToTpDegree), "replicate-to-tp-degree");
  EXPECT_STREQ(gqa_strategy_name(S::kConvertToMha), "convert-to-mha");
}

// --- Weights: every element of source head s's block is tag(s, row, col), so a gathered block
// can be traced back to its source head and checked whole.
constexpr int64_t kD = 2, kHidden = 3;
float tag(int64_t head, int64_t r, int64_t c) { return (head + 1) * 100.0f + r * 10.0f + c; }

ProjectionWeights tagged_weights(int64_t heads, int64_t kv_heads, bool bias, bool sinks) {
  ProjectionWeights w;
  w.q_proj.resize(heads * kD * kHidden);
  w.k_proj.resize(kv_heads * kD * kHidden);
  w.v_proj.resize(kv_heads * kD * kHidden);
  w.o_proj.resize(kHidden * heads * kD);
  for (int64_t r = 0; r < heads * kD; ++r) {
    for (int64_t c = 0; c < kHidden; ++c) {
      w.q_proj[r * kHidden + c] = tag(r / kD, r % kD, c);
      w.o_proj[c * heads * kD + r] = -tag(r / kD, r % kD, c);  // column block of head r / D
    }
  }
  for (int64_t r = 0; r < kv_heads * kD; ++r) {
    for (int64_t c = 0; c < kHidden; ++c) {
      w.k_proj[r * kHidden + c] = tag(r / kD, r % kD, c);
      w.v_proj[r * kHidden + c] = 0.5f * tag(r / kD, r % kD, c);
    }
  }
  if (bias) {
    for (int64_t r = 0; r < heads * kD; ++r) w.q_bias.push_back(tag(r / kD, r % kD, 7));
    for (int64_t r = 0; r < kv_heads * kD; ++r) w.k_bias.push_back(tag(r / kD, r % kD, 8));
    w.v_bias = w.k_bias;
    w.o_bias = {1.5f, 2.5f, 3.5f};
  }
  if (sinks) {
    for (int64_t h = 0; h < heads; ++h) w.sinks.push_back(static_cast<float>(h + 1));
  }
  return w;
}

// The 1-based source head of each D-row block of `w` (0 for a zero block); every element of a
// block must be its source's (factor * tag).
std::vector<int64_t> row_block_heads(const std::vector<float>& w, float factor) {
  std::vector<int64_t> heads;
  const int64_t blocks = static_cast<int64_t>(w.size()) / (kD * kHidden);
  for (int64_t b = 0; b < blocks; ++b) {
    const float first = w[b * kD * kHidden];
    const int64_t head = std::lround(first / factor / 100.0f);
    for (int64_t r = 0; r < kD; ++r) {
      for (int64_t c = 0; c < kHidden; ++c) {
        const float expected = head == 0 ? 0.0f : factor * tag(head - 1, r, c);
        EXPECT_EQ(w[(b * kD + r) * kHidden + c], expected) << "block " << b;
      }
    }
    heads.push_back(head);
  }
  return heads;
}

// The same for the D-column blocks of an o_proj (hidden, heads * D).
std::vector<int64_t> col_block_heads(const std::vector<float>& o) {
  std::vector<int64_t> heads;
  const int64_t cols = static_cast<int64_t>(o.size()) / kHidden, blocks = cols / kD;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t head = std::lround(-o[b * kD] / 100.0f);
    for (int64_t c = 0; c < kHidden; ++c) {
      for (int64_t r = 0; r < kD; ++r) {
        const float expected = head == 0 ? 0.0f : -tag(head - 1, r, c);
        EXPECT_EQ(o[c * cols + b * kD + r], expected) << "column block " << b;
      }
    }
    heads.push_back(head);
  }
  return heads;
}

// 1-based head numbers first..last, as the table writes them.
std::vector<int64_t> range(int64_t first, int64_t last) {
  std::vector<int64_t> v;
  for (int64_t i = first; i <= last; ++i) v.push_back(i);
  return v;
}
std::vector<int64_t> cat(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Sharded {
  GqaSharding s;
  ProjectionWeights padded;
  std::vector<ProjectionWeights> ranks;
};

Sharded shard(int64_t heads, int64_t kv_heads, int64_t tp) {
  Sharded out;
  EXPECT_TRUE(plan_gqa_sharding(tp, heads, kv_heads, &out.s).ok);
  const ProjectionWeights w = tagged_weights(heads, kv_heads, true, true);
  EXPECT_TRUE(pad_weights(out.s, kHidden, kD, w, &out.padded).ok);
  out.ranks.resize(tp);
  for (int64_t r = 0; r < tp; ++r) {
    EXPECT_TRUE(shard_weights(out.s, kHidden, kD, w, r, &out.ranks[r]).ok);
  }
  return out;
}

// The 1-based source of the Q heads, checked to agree across q_proj, o_proj, bias and sinks.
std::vector<int64_t> q_heads(const ProjectionWeights& w) {
  const std::vector<int64_t> heads = row_block_heads(w.q_proj, 1.0f);
  EXPECT_EQ(col_block_heads(w.o_proj), heads);
  std::vector<int64_t> sinks;
  for (float s : w.sinks) sinks.push_back(std::lround(s));
  EXPECT_EQ(sinks, heads);
  for (size_t i = 0; i < w.q_bias.size(); ++i) {
    const int64_t h = heads[i / kD];
    EXPECT_EQ(w.q_bias[i], h == 0 ? 0.0f : tag(h - 1, i % kD, 7));
  }
  EXPECT_EQ(w.o_bias, (std::vector<float>{1.5f, 2.5f, 3.5f}));  // never sharded
  return heads;
}
std::vector<int64_t> kv_heads(const ProjectionWeights& w) {
  const std::vector<int64_t> heads = row_block_heads(w.k_proj, 1.0f);
  EXPECT_EQ(row_block_heads(w.v_proj, 0.5f), heads);
  for (size_t i = 0; i < w.k_bias.size(); ++i) {
    const int64_t h = heads[i / kD];
    EXPECT_EQ(w.k_bias[i], h == 0 ? 0.0f : tag(h - 1, i % kD, 8));
  }
  EXPECT_EQ(w.v_bias, w.k_bias);
  return heads;
}

TEST(GqaWeights, H32KV8Tp2PlainContiguousSplit) {
  const Sharded x = shard(32, 8, 2);
  EXPECT_EQ(q_heads(x.padded), range(1, 32));
  EXPECT_EQ(kv_heads(x.padded), range(1, 8));
  EXPECT_EQ(q_heads(x.ranks[1]), range(17, 32));
  EXPECT_EQ(kv_heads(x.ranks[1]), range(5, 8));
}

TEST(GqaWeights, H32KV8Tp4RankHoldsEightQueryAndTwoKvHeads) {
  const Sharded x = shard(32, 8, 4);
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(q_heads(x.ranks[r]), range(8 * r + 1, 8 * r + 8));
    EXPECT_EQ(kv_heads(x.ranks[r]), range(2 * r + 1, 2 * r + 2));
  }
}

TEST(GqaWeights, H32KV8Tp8Unchanged) {
  const Sharded x = shard(32, 8, 8);
  EXPECT_EQ(q_heads(x.padded), range(1, 32));
  EXPECT_EQ(kv_heads(x.padded), range(1, 8));
  EXPECT_EQ(q_heads(x.ranks[5]), range(21, 24));
  EXPECT_EQ(kv_heads(x.ranks[5]), range(6, 6));
}

TEST(GqaWeights, H32KV8Tp32KvRepeatedFourTimesConsecutively) {
  const Sharded x = shard(32, 8, 32);
  std::vector<int64_t> kv;
  for (int64_t g = 1; g <= 8; ++g) kv = cat(kv, {g, g, g, g});
  EXPECT_EQ(kv_heads(x.padded), kv);  // repeat-interleave, not tiling
  EXPECT_EQ(q_heads(x.padded), range(1, 32));
  for (int64_t r = 0; r < 32; ++r) {  // rank r: Q_{r+1} with K_{floor(r/4)+1}
    EXPECT_EQ(q_heads(x.ranks[r]), range(r + 1, r + 1));
    EXPECT_EQ(kv_heads(x.ranks[r]), range(r / 4 + 1, r / 4 + 1));
  }
}

TEST(GqaWeights, H56KV8Tp32GroupsOfSevenPlusOneZeroHead) {
  const Sharded x = shard(56, 8, 32);
  std::vector<int64_t> q;
  for (int64_t g = 0; g < 8; ++g) q = cat(cat(q, range(7 * g + 1, 7 * g + 7)), {0});
  EXPECT_EQ(q_heads(x.padded), q);
  for (int64_t g = 0; g < 8; ++g) {
    const std::vector<int64_t> k = {g + 1};
    EXPECT_EQ(q_heads(x.ranks[4 * g]), range(7 * g + 1, 7 * g + 2));
    EXPECT_EQ(q_heads(x.ranks[4 * g + 1]), range(7 * g + 3, 7 * g + 4));
    EXPECT_EQ(q_heads(x.ranks[4 * g + 2]), range(7 * g + 5, 7 * g + 6));
    EXPECT_EQ(q_heads(x.ranks[4 * g + 3]), (std::vector<int64_t>{7 * g + 7, 0}));
    for (int64_t r = 4 * g; r < 4 * g + 4; ++r) EXPECT_EQ(kv_heads(x.ranks[r]), k);
  }
}

TEST(GqaWeights, H40KV8Tp16GroupsOfFivePlusOneZeroHead) {
  const Sharded x = shard(40, 8, 16);
  std::vector<int64_t> kv;
  for (int64_t g = 1; g <= 8; ++g) kv = cat(kv, {g, g});
  EXPECT_EQ(kv_heads(x.padded), kv);
  for (int64_t g = 0; g < 8; ++g) {
    EXPECT_EQ(q_heads(x.ranks[2 * g]), range(5 * g + 1, 5 * g + 3));
    EXPECT_EQ(q_heads(x.ranks[2 * g + 1]), (std::vector<int64_t>{5 * g + 4, 5 * g + 5, 0}));
    EXPECT_EQ(kv_heads(x.ranks[2 * g]), (std::vector<int64_t>{g + 1}));
    EXPECT_EQ(kv_heads(x.ranks[2 * g + 1]), (std::vector<int64_t>{g + 1}));
  }
}

TEST(GqaWeights, H40KV8Tp12KvTimesFiveThenTailPads) {
  const Sharded x = shard(40, 8, 12);
  std::vector<int64_t> kv;
  for (int64_t g = 1; g <= 8; ++g) kv = cat(kv, {g, g, g, g, g});
  kv = cat(kv, std::vector<int64_t>(8, 0));
  EXPECT_EQ(kv_heads(x.padded), kv);
  EXPECT_EQ(q_heads(x.padded), cat(range(1, 40), std::vector<int64_t>(8, 0)));
  // Q head i (0-based) pairs with K_{floor(i/5)+1}: n_rep = 1, local query j reads local KV j.
  for (int64_t r = 0; r < 12; ++r) {
    LocalHeads local;
    ASSERT_TRUE(local_heads(x.s, r, &local).ok);
    EXPECT_EQ(local.kv_of_query, (std::vector<int64_t>{0, 1, 2, 3}));
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t i = 4 * r + j;
      EXPECT_EQ(local.query_heads[j], i < 40 ? i : -1);
      EXPECT_EQ(local.kv_heads[j], i < 40 ? i / 5 : -1);
    }
  }
}

TEST(GqaWeights, H20KV20Tp8MhaTailPadsQkvAndO) {
  const Sharded x = shard(20, 20, 8);
  const std::vector<int64_t> padded = cat(range(1, 20), {0, 0, 0, 0});
  EXPECT_EQ(q_heads(x.padded), padded);
  EXPECT_EQ(kv_heads(x.padded), padded);
  EXPECT_EQ(q_heads(x.ranks[7]), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(q_heads(x.ranks[6]), (std::vector<int64_t>{19, 20, 0}));
}

// Section 4's caveat / section 9 item 6: the CONVERT label with KV' == KV (H=24, KV=8, D=128,
// tp=4, where ON's tail pad of K/V would be -16) leaves K and V as they are.
TEST(GqaWeights, ConvertWithoutReplicationLeavesKvAlone) {
  GqaSharding s;
  ASSERT_TRUE(plan_gqa_sharding(4, 24, 8, &s).ok);
  EXPECT_EQ(s.strategy, S::kConvertToMha);
  EXPECT_EQ(s.padded_kv_heads, 8);
  EXPECT_EQ(s.kv_repeats, 1);
  const int64_t d = 128, hidden = 4;
  ProjectionWeights w;
  w.q_proj.assign(24 * d * hidden, 1.0f);
  w.k_proj.resize(8 * d * hidden);
  for (size_t i = 0; i < w.k_proj.size(); ++i) w.k_proj[i] = static_cast<float>(i);
  w.v_proj = w.k_proj;
  w.o_proj.assign(hidden * 24 * d, 1.0f);
  ProjectionWeights padded;
  ASSERT_TRUE(pad_weights(s, hidden, d, w, &padded).ok);
  EXPECT_EQ(padded.k_proj, w.k_proj);
  EXPECT_EQ(padded.v_proj, w.v_proj);
}

// Section 9 item 6 (fused QKV with a bias): the bias is fused per rank like the weight.
TEST(GqaWeights, FusedQkvConcatenatesTheRanksBlocksWeightAndBias) {
  const Sharded x = shard(40, 8, 16);
  std::vector<float> wqkv, bqkv;
  const ProjectionWeights& local = x.ranks[3];
  ASSERT_TRUE(fuse_qkv(x.s, kHidden, kD, local, &wqkv, &bqkv).ok);
  std::vector<float> expected = local.q_proj;
  expected.insert(expected.end(), local.k_proj.begin(), local.k_proj.end());
  expected.insert(expected.end(), local.v_proj.begin(), local.v_proj.end());
  EXPECT_EQ(wqkv, expected);
  ASSERT_EQ(bqkv.size(), static_cast<size_t>((3 + 2 * 1) * kD));
  // q_end = h*D = 6, k_end = q_end + kv*D = 8: rank 3 holds Q9, Q10 and a pad, then K2 and V2.
  EXPECT_EQ(bqkv[0], tag(8, 0, 7));
  EXPECT_EQ(bqkv[4], 0.0f);
  EXPECT_EQ(bqkv[6], tag(1, 0, 8));
  EXPECT_EQ(bqkv[8], tag(1, 0, 8));
}

// Section 9 item 4: REPLICATE_TO_TP_DEGREE needs tp % KV == 0 when it replicates. ON chooses it
// only then; asked for explicitly, it is refused (ON would compute 0 or fractional repeats).
TEST(GqaErrors, ReplicateWithoutDivisibleTpIsRefused) {
  GqaSharding s;
  Status st = plan_gqa_sharding(12, 40, 8, S::kReplicateToTpDegree, &s);
  EXPECT_FALSE(st.ok);
  EXPECT_EQ(st.message.rfind("num_kv_heads: ", 0), 0u) << st.message;
  EXPECT_NE(st.message.find("tp % num_kv_heads == 0"), std::string::npos) << st.message;
  st = plan_gqa_sharding(8, 20, 20, S::kReplicateToTpDegree, &s);  // MHA, 8 % 20 != 0
  EXPECT_FALSE(st.ok);
  // Where no replication is needed the label does not matter (KV' = KV = 8 at tp 4).
  ASSERT_TRUE(plan_gqa_sharding(4, 32, 8, S::kReplicateToTpDegree, &s).ok);
  EXPECT_EQ(s.padded_kv_heads, 8);
}

TEST(GqaErrors, BadArgumentsAreNamed) {
  GqaSharding s;
  const struct {
    int64_t tp, heads, kv;
    const char* prefix;
  } cases[] = {{0, 32, 8, "tp: "},
               {4, 0, 8, "num_heads: "},
               {4, 32, 0, "num_kv_heads: "},
               {4, 32, 6, "num_kv_heads: "},
               {4, 8, 16, "num_kv_heads: "}};
  for (const auto& c : cases) {
    const Status st = plan_gqa_sharding(c.tp, c.heads, c.kv, &s);
    EXPECT_FALSE(st.ok);
    EXPECT_EQ(st.message.rfind(c.prefix, 0), 0u) << st.message;
  }
  ASSERT_TRUE(plan_gqa_sharding(4, 32, 8, &s).ok);
  LocalHeads local;
  EXPECT_EQ(local_heads(s, 4, &local).message.rfind("rank: ", 0), 0u);
  ProjectionWeights w = tagged_weights(32, 8, false, false), out;
  EXPECT_EQ(shard_weights(s, kHidden, kD, w, -1, &out).message.rfind("rank: ", 0), 0u);
  w.k_proj.pop_back();
  EXPECT_EQ(pad_weights(s, kHidden, kD, w, &out).message.rfind("k_proj: ", 0), 0u);
  w = tagged_weights(32, 8, true, false);
  w.v_bias.clear();
  EXPECT_EQ(pad_weights(s, kHidden, kD, w, &out).message.rfind("q_bias, k_bias, v_bias: ", 0), 0u);
}

// Section 9 item 3 and section 4's alignment rule on every (H, KV, tp) with H <= 64, tp <= 64 and
// both strategies: the counts divide, every source query head appears once, and each real query
// head reads, on its own rank, a KV head whose source is its own group's (i / (H/KV)).
TEST(GqaInvariants, EveryQueryHeadMeetsItsKvHeadOnItsRank) {
  int64_t checked = 0;
  for (int64_t heads = 1; heads <= 64; ++heads) {
    for (int64_t kv = 1; kv <= heads; ++kv) {
      if (heads % kv != 0) continue;
      for (int64_t tp = 1; tp <= 64; ++tp) {
        for (S strategy : {S::kConvertToMha, S::kReplicateToTpDegree}) {
          GqaSharding s;
          if (!plan_gqa_sharding(tp, heads, kv, strategy, &s).ok) {
            ASSERT_EQ(strategy, S::kReplicateToTpDegree);
            ASSERT_NE(tp % kv, 0);
            continue;
          }
          ASSERT_EQ(s.padded_heads % tp, 0);
          ASSERT_EQ(s.padded_kv_heads % tp, 0);
          ASSERT_EQ(s.n_rep * s.kv_heads_per_rank, s.heads_per_rank);
          std::vector<int> seen(heads, 0);
          for (int64_t r = 0; r < tp; ++r) {
            LocalHeads local;
            ASSERT_TRUE(local_heads(s, r, &local).ok);
            for (int64_t j = 0; j < s.heads_per_rank; ++j) {
              const int64_t i = local.query_heads[j];
              if (i < 0) continue;
              ++seen[i];
              ASSERT_EQ(local.kv_heads[local.kv_of_query[j]], i / (heads / kv))
                  << heads << "/" << kv << " @ " << tp << " " << gqa_strategy_name(strategy);
            }
          }
          for (int count : seen) ASSERT_EQ(count, 1);
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 10000);
}

// The ranks, each run through the layer oracle with its own heads and o_proj columns, give
// partials that sum (plus the bias, once) to the unsharded layer: the padding and pairing change
// nothing (section 4, "Pad heads ... change nothing").
TEST(GqaLayer, RankPartialsSumToTheUnshardedLayer) {
  const struct {
    int64_t heads, kv, tp;
  } cases[] = {{40, 8, 12}, {40, 8, 16}, {56, 8, 32}, {20, 20, 8}, {6, 2, 4}, {6, 3, 2}};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  const int64_t d = 4, hidden = 8, tokens = 3;
  for (const auto& c : cases) {
    SCOPED_TRACE(std::to_string(c.heads) + "/" + std::to_string(c.kv) + " @ " +
                 std::to_string(c.tp));
    reference::LayerConfig config;
    config.hidden_size = hidden;
    config.num_heads = c.heads;
    config.num_kv_heads = c.kv;
    config.head_dim = d;
    config.qkv_bias = config.o_bias = config.sinks = true;
    ProjectionWeights w;
    const auto fill = [&](std::vector<float>* v, int64_t n) {
      v->resize(n);
      for (float& f : *v) f = u(rng);
    };
    fill(&w.q_proj, c.heads * d * hidden);
    fill(&w.k_proj, c.kv * d * hidden);
    fill(&w.v_proj, c.kv * d * hidden);
    fill(&w.o_proj, hidden * c.heads * d);
    fill(&w.q_bias, c.heads * d);
    fill(&w.k_bias, c.kv * d);
    fill(&w.v_bias, c.kv * d);
    fill(&w.o_bias, hidden);
    fill(&w.sinks, c.heads);
    std::vector<float> x(tokens * hidden);
    for (float& f : x) f = 4 * u(rng);
    const std::vector<int64_t> pos = {0, 1, 2};
    const TensorView xv = TensorView::contiguous(x.data(), DType::kFloat32, {1, tokens, hidden});
    const TensorView pv = TensorView::contiguous(pos.data(), DType::kInt64, {1, tokens});
    const auto run = [&](const reference::LayerConfig& cfg, const ProjectionWeights& pw) {
      const reference::LayerWeights lw{pw.q_proj, pw.k_proj, pw.v_proj, pw.o_proj,
                                       pw.q_bias, pw.k_bias, pw.v_bias, pw.o_bias,
                                       {},        {},        pw.sinks};
      reference::LayerCache cache;
      EXPECT_TRUE(reference::make_layer_cache(cfg, 1, tokens, &cache).ok);
      std::vector<double> out;
      const Status st = reference::layer_forward(cfg, lw, xv, pv, &cache, &out);
      EXPECT_TRUE(st.ok) << st.message;
      return out;
    };
    const std::vector<double> full = run(config, w);
    GqaSharding s;
    ASSERT_TRUE(plan_gqa_sharding(c.tp, c.heads, c.kv, &s).ok);
    std::vector<double> sum(full.size(), 0.0);
    for (int64_t r = 0; r < c.tp; ++r) {
      ProjectionWeights local;
      ASSERT_TRUE(shard_weights(s, hidden, d, w, r, &local).ok);
      local.o_bias.clear();  // added once, after the reduce
      reference::LayerConfig rank_config = config;
      rank_config.num_heads = s.heads_per_rank;
      rank_config.num_kv_heads = s.kv_heads_per_rank;
      rank_config.o_bias = false;
      const std::vector<double> partial = run(rank_config, local);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += partial[i];
    }
    double max_error = 0, max_abs = 0;
    for (size_t i = 0; i < sum.size(); ++i) {
      const double with_bias = sum[i] + w.o_bias[i % hidden];
      max_error = std::max(max_error, flashcte::test::abs_error(with_bias, full[i]));
      max_abs = std::max(max_abs, std::abs(full[i]));
    }
    EXPECT_GT(max_abs, 0.1);
    // float32 roundings of the partials (R7), one per rank: tp ulps of the output's magnitude.
    EXPECT_LT(max_error, 4.0 * c.tp * max_abs * 6e-8) << max_error;
  }
}

}  // namespace
}  // namespace flashcte::layer
