// A tensor-parallel rank of the attention layer (LAYER.md section 4): its config, the heads of
// the full layer it holds, and its weights, either cut from the full layer's (rank_layer) or
// given as the rank's own shard (check_shard). rank_config and rank_heads are the public face
// (include/flashcte/layer.h).
#ifndef FLASHCTE_SRC_LAYER_SHARD_H_
#define FLASHCTE_SRC_LAYER_SHARD_H_

#include "flashcte/layer.h"

namespace flashcte::layer {

// The config and weights of rank config.tp_rank of config.tp_degree, cut from the full layer's
// weights (checked against config by the caller).
Status rank_layer(const LayerConfig& config, const LayerWeights& weights, LayerConfig* rank_config,
                  LayerWeights* rank_weights);

// A rank's own shard against `rank`, the rank's config (rank_config(config)): every weight sized
// for the rank's heads and finite, and the blocks of its pad heads (rank_heads: -1) zero, as
// rank_layer cuts them. Messages name the weight and say it is the rank's shard.
Status check_shard(const LayerConfig& config, const LayerConfig& rank, const LayerWeights& shard);

}  // namespace flashcte::layer

#endif  // FLASHCTE_SRC_LAYER_SHARD_H_
