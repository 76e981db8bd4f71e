// Checks of the layer's config and weights (include/flashcte/layer.h), each error naming the
// field and the rule. The float64 oracle (src/reference/layer_reference.cc) checks the same rules
// with its own code, on purpose: it shares nothing with the fast path.
#ifndef FLASHCTE_SRC_LAYER_CONFIG_H_
#define FLASHCTE_SRC_LAYER_CONFIG_H_

#include <cstdint>

#include "flashcte/layer.h"

namespace flashcte::layer {

// config.head_dim, or hidden_size / num_heads when it is 0 (LAYER.md section 1).
int64_t head_dim_of(const LayerConfig& config);

Status check_config(const LayerConfig& config);
Status check_weights(const LayerConfig& config, const LayerWeights& weights);

}  // namespace flashcte::layer

#endif  // FLASHCTE_SRC_LAYER_CONFIG_H_
