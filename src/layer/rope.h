// Rotary position embedding (LAYER.md section 3), the half-split ("rotate_half") convention over
// the first rotary_dim channels of each head, with Llama-3's frequency remap. Precision as the
// module: inv_freq and theta = position * inv_freq are float32, cos/sin are computed from them,
// rounded to float32 and then to the activation dtype (R4); the rotated values are rounded to the
// activation dtype (R5).
#ifndef FLASHCTE_SRC_LAYER_ROPE_H_
#define FLASHCTE_SRC_LAYER_ROPE_H_

#include <cstdint>
#include <vector>

#include "flashcte/layer.h"

namespace flashcte::layer {

class Rope {
 public:
  // config must have been checked (rotary_dim even, in [2, head_dim]).
  Rope(const LayerConfig& config, int64_t head_dim);

  int64_t rotary_dim() const { return rotary_dim_; }
  // cos and sin of `position`, rotary_dim / 2 values each (emb = concat(theta, theta), so the
  // second half repeats the first), rounded as R4 says.
  void cos_sin(int64_t position, float* cos, float* sin) const;
  // Rotates `heads` consecutive head vectors of head_dim floats in place (x' = x cos +
  // rotate_half(x) sin on the first rotary_dim channels), rounding to the activation dtype.
  void rotate(const float* cos, const float* sin, float* x, int64_t heads) const;

 private:
  std::vector<float> inv_freq_;  // rotary_dim / 2
  int64_t head_dim_, rotary_dim_;
  DType dtype_;
};

}  // namespace flashcte::layer

#endif  // FLASHCTE_SRC_LAYER_ROPE_H_
