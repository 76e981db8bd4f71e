#include "src/layer/rope.h"

#include <cmath>

#include "src/core/convert.h"

namespace flashcte::layer {
namespace {

// Llama3RotaryEmbedding's remap of one frequency (LAYER.md section 3), in float32.
float llama3_remap(float frequency, const Llama3RopeScaling& s) {
  const double pi = std::acos(-1.0);
  const double f = frequency;
  const double original = static_cast<double>(s.original_max_position_embeddings);
  const double wavelength = 2 * pi / f;
  if (wavelength < original / s.high_freq_factor) return frequency;
  if (wavelength > original / s.low_freq_factor) return static_cast<float>(f / s.factor);
  const double smooth =
      (original / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return static_cast<float>((1 - smooth) * f / s.factor + smooth * f);
}

}  // namespace

Rope::Rope(const LayerConfig& config, int64_t head_dim)
    : head_dim_(head_dim),
      rotary_dim_(config.rotary_dim != 0 ? config.rotary_dim : head_dim),
      dtype_(config.dtype) {
  // 1 / base^(arange(0, rd, 2).float() / rd), every step in float32.
  const float base = static_cast<float>(config.rope_theta);
  inv_freq_.resize(static_cast<size_t>(rotary_dim_ / 2));
  for (int64_t i = 0; i < rotary_dim_ / 2; ++i) {
    const float exponent =
        static_cast<float>(static_cast<double>(2 * i) / static_cast<double>(rotary_dim_));
    const float power = static_cast<float>(std::pow(static_cast<double>(base), exponent));
    float frequency = static_cast<float>(1.0 / static_cast<double>(power));
    if (config.rope_scaling) frequency = llama3_remap(frequency, *config.rope_scaling);
    inv_freq_[static_cast<size_t>(i)] = frequency;
  }
}

void Rope::cos_sin(int64_t position, float* cos, float* sin) const {
  const float pos = static_cast<float>(position);
  for (size_t i = 0; i < inv_freq_.size(); ++i) {
    const float theta = pos * inv_freq_[i];  // a float32 product, as the module's matmul
    cos[i] = internal::round_to(dtype_, static_cast<float>(std::cos(static_cast<double>(theta))));
    sin[i] = internal::round_to(dtype_, static_cast<float>(std::sin(static_cast<double>(theta))));
  }
}

void Rope::rotate(const float* cos, const float* sin, float* x, int64_t heads) const {
  const int64_t half = rotary_dim_ / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* head = x + h * head_dim_;
    for (int64_t i = 0; i < half; ++i) {
      const float lo = head[i], hi = head[i + half];
      head[i] = internal::round_to(dtype_, lo * cos[i] - hi * sin[i]);
      head[i + half] = internal::round_to(dtype_, hi * cos[i] + lo * sin[i]);
    }
  }
}

}  // namespace flashcte::layer
