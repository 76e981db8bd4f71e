#include "src/layer/config.h"

#include <cmath>
#include <string>
#include <vector>

#include "src/core/kv8.h"

namespace flashcte::layer {
namespace {

Status error(const std::string& field, const std::string& rule) {
  return Status::Error(field + ": " + rule);
}

Status check_rope(const LayerConfig& c, int64_t head_dim) {
  const int64_t rotary = c.rotary_dim != 0 ? c.rotary_dim : head_dim;
  if (rotary < 2 || rotary > head_dim || rotary % 2 != 0) {
    return error("rotary_dim", "must be even and in [2, head_dim = " + std::to_string(head_dim) +
                                   "], got " + std::to_string(rotary));
  }
  if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta)) {
    return error("rope_theta", "must be finite and > 0");
  }
  if (!c.rope_scaling) return Status::Ok();
  const Llama3RopeScaling& s = *c.rope_scaling;
  if (!(s.factor > 0)) return error("rope_scaling.factor", "must be > 0");
  if (!(s.low_freq_factor > 0) || !(s.high_freq_factor > 0)) {
    return error("rope_scaling", "low_freq_factor and high_freq_factor must be > 0");
  }
  // The smooth band divides by their difference (LAYER.md section 9 item 13).
  if (s.low_freq_factor == s.high_freq_factor) {
    return error("rope_scaling", "low_freq_factor and high_freq_factor must differ");
  }
  if (s.original_max_position_embeddings < 1) {
    return error("rope_scaling.original_max_position_embeddings", "must be >= 1");
  }
  return Status::Ok();
}

// One weight: present exactly when `wanted`, with `size` floats, all finite.
Status check_weight(const char* name, const std::vector<float>& w, bool wanted, int64_t size,
                    const char* flag) {
  if (!wanted) {
    if (w.empty()) return Status::Ok();
    return error(name, std::string("given, but config.") + flag + " is off (leave it empty)");
  }
  if (static_cast<int64_t>(w.size()) != size) {
    return error(name, "expected " + std::to_string(size) + " floats, got " +
                           std::to_string(static_cast<int64_t>(w.size())));
  }
  for (size_t i = 0; i < w.size(); ++i) {
    if (!std::isfinite(w[i]))
      return error(name, "element " + std::to_string(static_cast<int64_t>(i)) + " is not finite");
  }
  return Status::Ok();
}

}  // namespace

int64_t head_dim_of(const LayerConfig& c) {
  return c.head_dim != 0 || c.num_heads <= 0 ? c.head_dim : c.hidden_size / c.num_heads;
}

Status check_config(const LayerConfig& c) {
  if (c.hidden_size < 1) return error("hidden_size", "must be >= 1");
  if (c.num_heads < 1) return error("num_heads", "must be >= 1");
  if (c.num_kv_heads < 1) return error("num_kv_heads", "must be >= 1");
  if (c.num_heads % c.num_kv_heads != 0) {
    return error("num_kv_heads", "must divide num_heads (" + std::to_string(c.num_heads) + " % " +
                                     std::to_string(c.num_kv_heads) + " != 0)");
  }
  const int64_t d = head_dim_of(c);
  if (d < 1 || d > 1024) {
    return error("head_dim", "must be in [1, 1024] (0 means hidden_size / num_heads), got " +
                                 std::to_string(d));
  }
  if (c.rope) {
    if (Status s = check_rope(c, d); !s.ok) return s;
  }
  if (c.sliding_window < 0) return error("sliding_window", "must be >= 0 (0: off)");
  if (!std::isfinite(c.qk_scale)) return error("qk_scale", "must be finite");
  if (c.qk_norm && !(c.qk_norm_eps > 0)) return error("qk_norm_eps", "must be > 0");
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16 && c.dtype != DType::kFloat16) {
    return error("dtype", "must be float32, bfloat16 or float16");
  }
  if (c.kv_cache_dtype && *c.kv_cache_dtype != c.dtype && !kv8::is_8bit(*c.kv_cache_dtype)) {
    return error("kv_cache_dtype",
                 "must be int8, float8_e4m3fn, float8_e5m2 or the activation "
                 "dtype (" +
                     std::string(dtype_name(c.dtype)) + "), got " + dtype_name(*c.kv_cache_dtype));
  }
  return Status::Ok();
}

Status check_weights(const LayerConfig& c, const LayerWeights& w) {
  const int64_t d = head_dim_of(c), q = c.num_heads * d, kv = c.num_kv_heads * d;
  const struct {
    const char* name;
    const std::vector<float>& weight;
    bool wanted;
    int64_t size;
    const char* flag;
  } weights[] = {
      {"q_proj", w.q_proj, true, q * c.hidden_size, ""},
      {"k_proj", w.k_proj, true, kv * c.hidden_size, ""},
      {"v_proj", w.v_proj, true, kv * c.hidden_size, ""},
      {"o_proj", w.o_proj, true, c.hidden_size * q, ""},
      {"q_bias", w.q_bias, c.qkv_bias, q, "qkv_bias"},
      {"k_bias", w.k_bias, c.qkv_bias, kv, "qkv_bias"},
      {"v_bias", w.v_bias, c.qkv_bias, kv, "qkv_bias"},
      {"o_bias", w.o_bias, c.o_bias, c.hidden_size, "o_bias"},
      {"q_norm", w.q_norm, c.qk_norm, d, "qk_norm"},
      {"k_norm", w.k_norm, c.qk_norm, d, "qk_norm"},
      {"sinks", w.sinks, c.sinks, c.num_heads, "sinks"},
  };
  for (const auto& item : weights) {
    if (Status s = check_weight(item.name, item.weight, item.wanted, item.size, item.flag); !s.ok) {
      return s;
    }
  }
  return Status::Ok();
}

}  // namespace flashcte::layer
