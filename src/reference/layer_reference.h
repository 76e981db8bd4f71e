// The oracle of the attention layer: optimum-neuron's NeuronAttentionBase.forward as
// shared/spec/LAYER.md describes it (sections 1-3 and 5-8), in float64, one token and one head
// at a time. Like reference.h it is written for clarity only and shares no code with the fast
// layer (only the public types of flashcte.h and the dtype helpers of reference.h).
//
// It computes the layer of the model config, before any GQA padding (src/layer/gqa.h): pad heads
// contribute nothing (LAYER.md section 4), so the function does not depend on tp.
//
// Precision. Arithmetic is float64. Where the module materializes a tensor in the activation
// dtype, the value is rounded to it with round_to_dtype, once per tensor (the elementwise
// roundings inside one expression, such as q*cos + rotate_half(q)*sin in bf16, are arithmetic
// precision and left to the tolerance):
//   R1 x, the weights, biases, norm weights and sinks: the module lives in the activation dtype
//      (section 1, `neuron_config.torch_dtype`);
//   R2 the outputs of q/k/v_proj, bias included (section 2, one F.linear);
//   R3 the q/k RMSNorm output ("computed in fp32 and cast back", section 8);
//   R4 RoPE: inv_freq and theta = position * inv_freq are float32 values, cos/sin are computed
//      from them, rounded to float32 and then cast to the activation dtype (section 3);
//   R5 the rotated Q and K (they stay activation-dtype tensors; the cache holds K after RoPE and
//      V in the activation dtype, sections 1 step 7 and 7);
//   R6 the attention output, the input of o_proj (section 1 step 5);
//   R7 o_proj: the partial x*W^T, then (when there is one) the bias added after the reduce and
//      rounded again (section 2);
//   R8 an 8-bit kv_cache_dtype (flashcte's, not the module's; vLLM's per-token fp8 cache): each
//      written K/V row of a KV head is quantized with a float32 scale from its absmax, and the
//      cache holds code x scale (store_row in layer_reference.cc).
#ifndef FLASHCTE_SRC_REFERENCE_LAYER_REFERENCE_H_
#define FLASHCTE_SRC_REFERENCE_LAYER_REFERENCE_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/layer.h"

namespace flashcte::reference {

// The layer's config and weights are the public types of include/flashcte/layer.h (plain data:
// the oracle shares no code with the fast layer).
using Llama3RopeScaling = flashcte::Llama3RopeScaling;
using LayerConfig = flashcte::LayerConfig;
using LayerWeights = flashcte::LayerWeights;

// The KV cache of one layer (section 7), in float64 holding activation-dtype values (R8: the
// dequantized values of an 8-bit kv_cache_dtype).
struct LayerCache {
  int64_t batch = 0, kv_heads = 0, max_len = 0, head_dim = 0;
  std::vector<double> k;  // (batch, kv_heads, max_len, head_dim): K after q/k norm and RoPE
  std::vector<double> v;  // (batch, kv_heads, max_len, head_dim)
  // Per sequence: slots [0, lengths[b]) hold tokens. A call may start at any position
  // <= lengths[b] (an earlier one rewrites slots) and never past it.
  std::vector<int64_t> lengths;
};

// Checks the config and the weights against it; errors name the field and the rule.
Status check_layer(const LayerConfig& config, const LayerWeights& weights);

// An empty (zero, all lengths 0) cache for `batch` sequences of up to `max_len` tokens.
Status make_layer_cache(const LayerConfig& config, int64_t batch, int64_t max_len,
                        LayerCache* cache);

// NeuronAttentionBase.forward on one rank with tp = 1, with the cache write of the decoder model
// folded in. x: (batch, T, hidden_size), any float dtype (read exactly, then rounded, R1).
// positions: (batch, T) int64, the absolute position of each token; in each row they go up by 1
// from one token to the next, or repeat the previous one (chunk padding, section 6: a repeat is
// a query but neither a key nor a cache write), start at most at the row's cache length, and stay
// below max_len. Each token's K/V is written at its position, then every token attends to every
// cache slot at a position <= its own (and within the window), sinks add a value-less logit, and
// o_proj gives out: (batch, T, hidden_size) row-major, activation-dtype values.
Status layer_forward(const LayerConfig& config, const LayerWeights& weights, const TensorView& x,
                     const TensorView& positions, LayerCache* cache, std::vector<double>* out);

// Pieces of the forward pass, for tests.
// inv_freq (rotary_dim / 2 values) after the Llama-3 remap when configured, as float32 values.
Status rope_inverse_frequencies(const LayerConfig& config, std::vector<double>* inv_freq);
// cos(emb) and sin(emb) of `position` (rotary_dim values, emb = concat(theta, theta)), rounded
// as R4 says.
Status rope_cos_sin(const LayerConfig& config, int64_t position, std::vector<double>* cos,
                    std::vector<double>* sin);
// One head vector (head_dim values) rotated to `position` and rounded (R5).
Status apply_rope(const LayerConfig& config, int64_t position, std::vector<double>* head);

}  // namespace flashcte::reference

#endif  // FLASHCTE_SRC_REFERENCE_LAYER_REFERENCE_H_
