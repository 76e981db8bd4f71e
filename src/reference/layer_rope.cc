// The layer oracle's rotary embedding (layer_reference.h, LAYER.md section 3): the inverse
// frequencies and Llama 3's remap of them, cos and sin of a position, and one head turned, every
// step rounded as the module rounds it (R4, R5).
#include <cmath>
#include <string>
#include <vector>

#include "src/reference/layer_common.h"
#include "src/reference/layer_reference.h"
#include "src/reference/reference.h"

namespace flashcte::reference {
namespace {

using layer_detail::error;
using layer_detail::head_dim_of;
using layer_detail::rotary_dim_of;
using layer_detail::to_f32;

// Llama3RotaryEmbedding's remap of one frequency (section 3). The result is kept in float32.
double llama3_remap(double f, const Llama3RopeScaling& s) {
  const double pi = std::acos(-1.0);
  const double orig = static_cast<double>(s.original_max_position_embeddings);
  const double wavelen = 2 * pi / f;
  const double lo_wl = orig / s.low_freq_factor;
  const double hi_wl = orig / s.high_freq_factor;
  if (wavelen < hi_wl) return f;
  if (wavelen > lo_wl) return to_f32(f / s.factor);
  const double smooth =
      (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return to_f32((1 - smooth) * f / s.factor + smooth * f);
}

}  // namespace

Status rope_inverse_frequencies(const LayerConfig& c, std::vector<double>* inv_freq) {
  if (Status s = layer_detail::check_config(c); !s.ok) return s;
  if (!c.rope) return error("rope", "the layer has no RoPE (NoPE)");
  const int64_t rd = rotary_dim_of(c);
  inv_freq->resize(rd / 2);
  // 1 / base^(arange(0, rd, 2).float() / rd), every step in float32 (R4).
  const double base = to_f32(c.rope_theta);
  for (int64_t i = 0; i < rd / 2; ++i) {
    const double exponent = to_f32(static_cast<double>(2 * i) / static_cast<double>(rd));
    double f = to_f32(1.0 / to_f32(std::pow(base, exponent)));
    if (c.rope_scaling) f = llama3_remap(f, *c.rope_scaling);
    (*inv_freq)[i] = f;
  }
  return Status::Ok();
}

Status rope_cos_sin(const LayerConfig& c, int64_t position, std::vector<double>* cos,
                    std::vector<double>* sin) {
  std::vector<double> inv_freq;
  if (Status s = rope_inverse_frequencies(c, &inv_freq); !s.ok) return s;
  const int64_t half = static_cast<int64_t>(inv_freq.size());
  cos->resize(2 * half);
  sin->resize(2 * half);
  for (int64_t i = 0; i < half; ++i) {
    // theta = position * inv_freq as a float32 matmul; cos/sin in float32, then cast (R4).
    const double theta = to_f32(to_f32(static_cast<double>(position)) * inv_freq[i]);
    const double c_i = round_to_dtype(to_f32(std::cos(theta)), c.dtype);
    const double s_i = round_to_dtype(to_f32(std::sin(theta)), c.dtype);
    (*cos)[i] = (*cos)[i + half] = c_i;  // emb = concat(theta, theta)
    (*sin)[i] = (*sin)[i + half] = s_i;
  }
  return Status::Ok();
}

Status apply_rope(const LayerConfig& c, int64_t position, std::vector<double>* head) {
  std::vector<double> cos, sin;
  if (Status s = rope_cos_sin(c, position, &cos, &sin); !s.ok) return s;
  if (static_cast<int64_t>(head->size()) != head_dim_of(c)) {
    return error("head", "must hold head_dim = " + std::to_string(head_dim_of(c)) + " values");
  }
  layer_detail::rotate(cos, sin, c.dtype, head->data());
  return Status::Ok();
}

}  // namespace flashcte::reference
