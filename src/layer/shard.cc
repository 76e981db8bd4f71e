// A tensor-parallel rank of the attention layer (shard.h).
#include "src/layer/shard.h"

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "src/layer/config.h"
#include "src/layer/gqa.h"

namespace flashcte::layer {
namespace {

// The GQA sharding of the config's tensor-parallel rank (LAYER.md section 4, src/layer/gqa.h).
Status plan_sharding(const LayerConfig& config, GqaSharding* sharding) {
  if (config.tp_degree < 1) {
    return Status::Error("tp_degree: must be >= 1, got " + std::to_string(config.tp_degree));
  }
  if (config.tp_rank < 0 || config.tp_rank >= config.tp_degree) {
    return Status::Error("tp_rank: must be in [0, tp_degree = " + std::to_string(config.tp_degree) +
                         "), got " + std::to_string(config.tp_rank));
  }
  using Strategy = LayerConfig::GqaStrategy;
  switch (config.gqa_strategy) {
    case Strategy::kAuto:
      return plan_gqa_sharding(config.tp_degree, config.num_heads, config.num_kv_heads, sharding);
    case Strategy::kReplicateToTpDegree:
    case Strategy::kConvertToMha:
      return plan_gqa_sharding(config.tp_degree, config.num_heads, config.num_kv_heads,
                               config.gqa_strategy == Strategy::kConvertToMha
                                   ? GqaStrategy::kConvertToMha
                                   : GqaStrategy::kReplicateToTpDegree,
                               sharding);
  }
  return Status::Error("gqa_strategy: not one of kAuto, kReplicateToTpDegree, kConvertToMha");
}

LayerConfig rank_config_of(const LayerConfig& config, const GqaSharding& sharding) {
  LayerConfig rank = config;
  rank.num_heads = sharding.heads_per_rank;
  rank.num_kv_heads = sharding.kv_heads_per_rank;
  rank.head_dim = head_dim_of(config);
  rank.o_bias = false;  // added once, after the ranks' outputs are summed
  rank.tp_degree = 1;
  rank.tp_rank = 0;
  rank.gqa_strategy = LayerConfig::GqaStrategy::kAuto;
  return rank;
}

}  // namespace

Status rank_layer(const LayerConfig& config, const LayerWeights& weights, LayerConfig* rank_config,
                  LayerWeights* rank_weights) {
  GqaSharding sharding;
  if (Status s = plan_sharding(config, &sharding); !s.ok) return s;
  const int64_t d = head_dim_of(config);
  ProjectionWeights full{weights.q_proj, weights.k_proj, weights.v_proj, weights.o_proj,
                         weights.q_bias, weights.k_bias, weights.v_bias, {},
                         weights.sinks};
  ProjectionWeights local;
  if (Status s = shard_weights(sharding, config.hidden_size, d, full, config.tp_rank, &local);
      !s.ok) {
    return s;
  }
  *rank_config = rank_config_of(config, sharding);
  *rank_weights = LayerWeights{std::move(local.q_proj), std::move(local.k_proj),
                               std::move(local.v_proj), std::move(local.o_proj),
                               std::move(local.q_bias), std::move(local.k_bias),
                               std::move(local.v_bias), {},
                               weights.q_norm,          weights.k_norm,
                               std::move(local.sinks)};
  return Status::Ok();
}

namespace {

std::string shard_error(const char* name, const std::string& rule) {
  return std::string(name) + ": " + rule + " (the rank's shard)";
}

// Block `head` of `width` values in each of `rows` rows of `row_length` values is all zero.
bool zero_block(const std::vector<float>& w, int64_t rows, int64_t row_length, int64_t first,
                int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = first; c < first + width; ++c) {
      if (w[static_cast<size_t>(r * row_length + c)] != 0.0f) return false;
    }
  }
  return true;
}

}  // namespace

Status check_shard(const LayerConfig& config, const LayerConfig& rank, const LayerWeights& shard) {
  if (Status s = check_weights(rank, shard); !s.ok) {
    return Status::Error(s.message + " (the rank's shard: rank_heads' heads of each weight)",
                         s.kind);
  }
  RankHeads heads;
  if (Status s = rank_heads(config, &heads); !s.ok) return s;
  const int64_t d = head_dim_of(rank), hidden = rank.hidden_size;
  const int64_t q_width = rank.num_heads * d;
  for (size_t j = 0; j < heads.query_heads.size(); ++j) {
    if (heads.query_heads[j] >= 0) continue;
    const auto at = static_cast<int64_t>(j) * d;
    const std::string pad = "the rows of pad query head " + std::to_string(j) + " must be 0";
    if (!zero_block(shard.q_proj, 1, 0, at * hidden, d * hidden)) {
      return Status::Error(shard_error("q_proj", pad));
    }
    if (!shard.q_bias.empty() && !zero_block(shard.q_bias, 1, 0, at, d)) {
      return Status::Error(shard_error("q_bias", pad));
    }
    if (!zero_block(shard.o_proj, hidden, q_width, at, d)) {
      return Status::Error(shard_error(
          "o_proj", "the columns of pad query head " + std::to_string(j) + " must be 0"));
    }
    if (!shard.sinks.empty() && shard.sinks[j] != 0.0f) {
      return Status::Error(
          shard_error("sinks", "the entry of pad query head " + std::to_string(j) + " must be 0"));
    }
  }
  for (size_t j = 0; j < heads.kv_heads.size(); ++j) {
    if (heads.kv_heads[j] >= 0) continue;
    const auto at = static_cast<int64_t>(j) * d;
    const std::string pad = "the rows of pad KV head " + std::to_string(j) + " must be 0";
    for (const auto& [name, w, width] :
         {std::tuple{"k_proj", &shard.k_proj, d * hidden},
          std::tuple{"v_proj", &shard.v_proj, d * hidden}, std::tuple{"k_bias", &shard.k_bias, d},
          std::tuple{"v_bias", &shard.v_bias, d}}) {
      if (!w->empty() && !zero_block(*w, 1, 0, at * (width / d), width)) {
        return Status::Error(shard_error(name, pad));
      }
    }
  }
  return Status::Ok();
}

}  // namespace flashcte::layer

namespace flashcte {

Status rank_config(const LayerConfig& config, LayerConfig* rank) {
  if (rank == nullptr) return Status::Error("rank: must not be null");
  if (Status s = layer::check_config(config); !s.ok) return s;
  if (config.tp_degree == 1 && config.tp_rank == 0) {  // the whole layer
    *rank = config;
    return Status::Ok();
  }
  layer::GqaSharding sharding;
  if (Status s = layer::plan_sharding(config, &sharding); !s.ok) return s;
  *rank = layer::rank_config_of(config, sharding);
  return Status::Ok();
}

Status rank_heads(const LayerConfig& config, RankHeads* heads) {
  if (heads == nullptr) return Status::Error("heads: must not be null");
  if (Status s = layer::check_config(config); !s.ok) return s;
  layer::GqaSharding sharding;
  if (Status s = layer::plan_sharding(config, &sharding); !s.ok) return s;
  layer::LocalHeads local;
  if (Status s = layer::local_heads(sharding, config.tp_rank, &local); !s.ok) return s;
  heads->query_heads = std::move(local.query_heads);
  heads->kv_heads = std::move(local.kv_heads);
  return Status::Ok();
}

}  // namespace flashcte
