// The layer oracle (src/reference/layer_reference.h): shared/spec/LAYER.md in float64, one token
// and one head at a time, with the module's roundings to the activation dtype marked R1-R7 (the
// header lists them). No tiling, no batching of heads, no code shared with the fast layer.
#include "src/reference/layer_reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "src/reference/layer_common.h"
#include "src/reference/reference.h"

namespace flashcte::reference {
namespace layer_detail {

Status error(const std::string& field, const std::string& rule) {
  return Status::Error(field + ": " + rule);
}

double to_f32(double x) { return round_to_dtype(x, DType::kFloat32); }

int64_t head_dim_of(const LayerConfig& c) {
  return c.head_dim != 0 || c.num_heads <= 0 ? c.head_dim : c.hidden_size / c.num_heads;
}
int64_t rotary_dim_of(const LayerConfig& c) {
  return c.rotary_dim != 0 ? c.rotary_dim : head_dim_of(c);
}

namespace {

// The largest finite value of an 8-bit cache format; 0 for any other dtype.
double largest_code(DType dtype) {
  switch (dtype) {
    case DType::kInt8:
      return 127;
    case DType::kFloat8E4M3:
      return 448;
    case DType::kFloat8E5M2:
      return 57344;
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      return 0;
  }
  return 0;
}

// rotary_dim, rope_theta and the Llama 3 scaling, when the layer has RoPE.
Status check_rope(const LayerConfig& c) {
  const int64_t d = head_dim_of(c), rd = rotary_dim_of(c);
  if (rd < 2 || rd > d || rd % 2 != 0) {
    return error("rotary_dim", "must be even and in [2, head_dim = " + std::to_string(d) +
                                   "], got " + std::to_string(rd) +
                                   (c.rotary_dim == 0 ? " (the head_dim)" : ""));
  }
  if (!(c.rope_theta > 0)) return error("rope_theta", "must be > 0");
  if (c.rope_scaling) {
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
  }
  return Status::Ok();
}

}  // namespace

Status check_config(const LayerConfig& c) {
  if (c.hidden_size < 1) return error("hidden_size", "must be >= 1");
  if (c.num_heads < 1) return error("num_heads", "must be >= 1");
  if (c.num_kv_heads < 1) return error("num_kv_heads", "must be >= 1");
  if (c.num_heads % c.num_kv_heads != 0) {
    return error("num_kv_heads", "must divide num_heads (" + std::to_string(c.num_heads) + " % " +
                                     std::to_string(c.num_kv_heads) + " != 0)");
  }
  if (head_dim_of(c) < 1) {
    return error("head_dim", "must be >= 1 (0 means hidden_size / num_heads, here " +
                                 std::to_string(head_dim_of(c)) + ")");
  }
  if (c.rope) {
    if (Status s = check_rope(c); !s.ok) return s;
  }
  if (c.sliding_window < 0) return error("sliding_window", "must be >= 0 (0: off)");
  if (!std::isfinite(c.qk_scale)) return error("qk_scale", "must be finite");
  if (c.qk_norm && !(c.qk_norm_eps > 0)) return error("qk_norm_eps", "must be > 0");
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kBFloat16 && c.dtype != DType::kFloat16) {
    return error("dtype", "must be float32, bfloat16 or float16");
  }
  if (c.kv_cache_dtype && *c.kv_cache_dtype != c.dtype && largest_code(*c.kv_cache_dtype) == 0) {
    return error("kv_cache_dtype", "must be an 8-bit format or the activation dtype");
  }
  return Status::Ok();
}

// x' = x*cos + rotate_half(x)*sin over the first rotary_dim = cos.size() channels, with
// rotate_half(x) = concat(-x[half:], x[:half]) (section 3); later channels pass through. R5.
void rotate(const std::vector<double>& cos, const std::vector<double>& sin, DType dtype,
            double* x) {
  const size_t half = cos.size() / 2;
  for (size_t i = 0; i < half; ++i) {
    const double lo = x[i], hi = x[i + half];
    x[i] = round_to_dtype(lo * cos[i] - hi * sin[i], dtype);
    x[i + half] = round_to_dtype(hi * cos[i + half] + lo * sin[i + half], dtype);
  }
}

}  // namespace layer_detail

using layer_detail::check_config;
using layer_detail::error;
using layer_detail::head_dim_of;
using layer_detail::largest_code;
using layer_detail::rotate;
using layer_detail::to_f32;

namespace {

// R8: an 8-bit cache (kv_cache_dtype) holds a written row (one token's K or V of one KV head,
// after R5) as codes of the format with a float32 scale: the row's largest finite |value| over
// the format's largest (1 for a row without a finite nonzero value, the smallest float should the
// quotient underflow), each value / scale rounded to the format; the slot holds code x scale.
void store_row(DType cache_dtype, const double* row, int64_t d, double* slot) {
  const double top = largest_code(cache_dtype);
  if (top == 0) {  // the activation dtype: the values themselves
    std::copy_n(row, d, slot);
    return;
  }
  double absmax = 0;
  for (int64_t c = 0; c < d; ++c) {
    if (std::isfinite(row[c])) absmax = std::max(absmax, std::fabs(row[c]));
  }
  double scale = absmax == 0 ? 1.0 : to_f32(absmax / top);
  if (scale == 0) scale = std::numeric_limits<float>::denorm_min();
  for (int64_t c = 0; c < d; ++c) slot[c] = round_to_dtype(row[c] / scale, cache_dtype) * scale;
}

// `v` must have `size` floats when `on`, and be empty otherwise.
Status check_part(const char* name, const std::vector<float>& v, bool on, int64_t size,
                  const char* flag) {
  const int64_t n = static_cast<int64_t>(v.size());
  if (!on && n != 0) {
    return error(name, std::string("given, but config.") + flag + " is off (leave it empty)");
  }
  if (on && n != size) {
    return error(name, "expected " + std::to_string(size) + " floats, got " + std::to_string(n));
  }
  return Status::Ok();
}

// The dense weights, rounded to the activation dtype (R1).
struct Params {
  int64_t hidden = 0, heads = 0, kv_heads = 0, d = 0, group = 0;
  double scale = 0;
  std::vector<double> wq, wk, wv, wo, bq, bk, bv, bo, norm_q, norm_k, sinks;
};

std::vector<double> rounded(const std::vector<float>& v, DType dtype) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = round_to_dtype(v[i], dtype);
  return out;
}

Params load_params(const LayerConfig& c, const LayerWeights& w) {
  Params p;
  p.hidden = c.hidden_size;
  p.heads = c.num_heads;
  p.kv_heads = c.num_kv_heads;
  p.d = head_dim_of(c);
  p.group = c.num_heads / c.num_kv_heads;
  p.scale = c.qk_scale != 0 ? c.qk_scale : 1.0 / std::sqrt(static_cast<double>(p.d));
  const DType t = c.dtype;
  p.wq = rounded(w.q_proj, t);
  p.wk = rounded(w.k_proj, t);
  p.wv = rounded(w.v_proj, t);
  p.wo = rounded(w.o_proj, t);
  p.bq = rounded(w.q_bias, t);
  p.bk = rounded(w.k_bias, t);
  p.bv = rounded(w.v_bias, t);
  p.bo = rounded(w.o_bias, t);
  p.norm_q = rounded(w.q_norm, t);
  p.norm_k = rounded(w.k_norm, t);
  p.sinks = rounded(w.sinks, t);
  return p;
}

// y = W x (+ b), W (rows, cols) row-major: one torch.nn.Linear.
std::vector<double> linear(const std::vector<double>& w, const std::vector<double>& b, int64_t rows,
                           int64_t cols, const double* x) {
  std::vector<double> y(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double acc = 0;
    for (int64_t c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
    y[r] = acc + (b.empty() ? 0.0 : b[r]);
  }
  return y;
}

void round_all(std::vector<double>* v, DType dtype) {
  for (double& x : *v) x = round_to_dtype(x, dtype);
}

// NeuronRMSNorm along one head: x * rsqrt(mean(x^2) + eps) * w, then R3.
void rms_norm(double* head, const std::vector<double>& weight, int64_t d, double eps, DType dtype) {
  double mean_square = 0;
  for (int64_t c = 0; c < d; ++c) mean_square += head[c] * head[c];
  mean_square /= static_cast<double>(d);
  const double inv_rms = 1.0 / std::sqrt(mean_square + eps);
  for (int64_t c = 0; c < d; ++c) head[c] = round_to_dtype(head[c] * inv_rms * weight[c], dtype);
}

// positions (batch, T) int64, read into a dense vector and checked against the cache (section
// 7: writes land at the positions, so a position past a row's length would leave slots unwritten
// that later queries attend to; section 9 item 11: nothing in the module checks pos < N).
Status read_positions(const TensorView& positions, int64_t batch, int64_t tokens,
                      const LayerCache& cache, std::vector<int64_t>* pos) {
  if (positions.rank != 2 || positions.dtype != DType::kInt64 || positions.data == nullptr) {
    return error("positions", "must be an int64 tensor of shape (batch, T)");
  }
  if (positions.shape[0] != batch || positions.shape[1] != tokens) {
    return error("positions", "shape (" + std::to_string(positions.shape[0]) + ", " +
                                  std::to_string(positions.shape[1]) +
                                  ") differs from x's (batch, T) = (" + std::to_string(batch) +
                                  ", " + std::to_string(tokens) + ")");
  }
  pos->resize(batch * tokens);
  const auto* data = static_cast<const int64_t*>(positions.data);
  for (int64_t b = 0; b < batch; ++b) {
    const std::string row = "row " + std::to_string(b);
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t p = data[b * positions.strides[0] + t * positions.strides[1]];
      (*pos)[b * tokens + t] = p;
      if (p < 0) return error("positions", row + " has a negative position " + std::to_string(p));
      if (p >= cache.max_len) {
        return error("positions", row + " reaches position " + std::to_string(p) +
                                      ", past the cache's " + "max_len " +
                                      std::to_string(cache.max_len));
      }
      if (t == 0 && p > cache.lengths[b]) {
        return error("positions", row + " starts at " + std::to_string(p) +
                                      " but the cache holds " + std::to_string(cache.lengths[b]) +
                                      " tokens of it: slots " + std::to_string(cache.lengths[b]) +
                                      ".." + std::to_string(p - 1) + " would be skipped");
      }
      const int64_t prev = t > 0 ? (*pos)[b * tokens + t - 1] : p;
      if (t > 0 && p != prev && p != prev + 1) {
        return error("positions", row + " goes from " + std::to_string(prev) + " to " +
                                      std::to_string(p) + " at token " + std::to_string(t) +
                                      ": each token is the previous + 1, or repeats it");
      }
    }
  }
  return Status::Ok();
}

Status check_inputs(const LayerConfig& c, const TensorView& x, const LayerCache& cache) {
  if (x.rank != 3 || x.data == nullptr ||
      (x.dtype != DType::kFloat32 && x.dtype != DType::kBFloat16 && x.dtype != DType::kFloat16)) {
    return error("x", "must be a float32, bfloat16 or float16 tensor (batch, T, hidden_size)");
  }
  if (x.shape[2] != c.hidden_size) {
    return error("x", "last dim " + std::to_string(x.shape[2]) + " differs from hidden_size " +
                          std::to_string(c.hidden_size));
  }
  const int64_t d = head_dim_of(c);
  if (cache.kv_heads != c.num_kv_heads || cache.head_dim != d) {
    return error("cache", "holds " + std::to_string(cache.kv_heads) + " KV heads of dim " +
                              std::to_string(cache.head_dim) + ", the layer has " +
                              std::to_string(c.num_kv_heads) + " of dim " + std::to_string(d));
  }
  const int64_t size = cache.batch * cache.kv_heads * cache.max_len * cache.head_dim;
  if (static_cast<int64_t>(cache.k.size()) != size ||
      static_cast<int64_t>(cache.v.size()) != size ||
      static_cast<int64_t>(cache.lengths.size()) != cache.batch) {
    return error("cache",
                 "k, v and lengths disagree with its (batch, kv_heads, max_len, "
                 "head_dim); build it with make_layer_cache");
  }
  if (x.shape[0] != cache.batch) {
    return error("x", "batch " + std::to_string(x.shape[0]) + " differs from the cache's " +
                          std::to_string(cache.batch));
  }
  for (int64_t b = 0; b < cache.batch; ++b) {
    if (cache.lengths[b] < 0 || cache.lengths[b] > cache.max_len) {
      return error("cache", "lengths[" + std::to_string(b) + "] outside [0, max_len]");
    }
  }
  return Status::Ok();
}

// One token's activation-dtype Q (heads * d), K and V (kv_heads * d), after norm and RoPE.
struct TokenQkv {
  std::vector<double> q, k, v;
};

// Section 1 steps 1-3 for the token at (b, t): projections (R1, R2), q/k norm (R3), RoPE (R5).
TokenQkv project_token(const LayerConfig& c, const Params& p, const TensorView& x, int64_t b,
                       int64_t t, int64_t position) {
  std::vector<double> xr(p.hidden);
  for (int64_t i = 0; i < p.hidden; ++i) {
    const double v =
        load_element(x.data, x.dtype, b * x.strides[0] + t * x.strides[1] + i * x.strides[2]);
    xr[i] = round_to_dtype(v, c.dtype);
  }
  TokenQkv out;
  out.q = linear(p.wq, p.bq, p.heads * p.d, p.hidden, xr.data());
  out.k = linear(p.wk, p.bk, p.kv_heads * p.d, p.hidden, xr.data());
  out.v = linear(p.wv, p.bv, p.kv_heads * p.d, p.hidden, xr.data());
  round_all(&out.q, c.dtype);
  round_all(&out.k, c.dtype);
  round_all(&out.v, c.dtype);
  std::vector<double> cos, sin;
  if (c.rope) (void)rope_cos_sin(c, position, &cos, &sin);  // the caller checked the config
  const auto finish = [&](std::vector<double>* heads, int64_t count,
                          const std::vector<double>& norm) {
    for (int64_t h = 0; h < count; ++h) {
      double* head = heads->data() + h * p.d;
      if (c.qk_norm) rms_norm(head, norm, p.d, c.qk_norm_eps, c.dtype);  // before RoPE
      if (c.rope) rotate(cos, sin, c.dtype, head);
    }
  };
  finish(&out.q, p.heads, p.norm_q);
  finish(&out.k, p.kv_heads, p.norm_k);
  return out;
}

// Section 6 (one softmax over every visible slot, the split into prior and active parts being
// an implementation detail) and section 8 (window, sinks) for one query head of one token: the
// head's output (d values) into `out`, before R6.
void attend(const LayerConfig& c, const Params& p, const LayerCache& cache, int64_t b, int64_t head,
            int64_t position, const double* q, double* out) {
  const int64_t kv = head / p.group;  // repeat_kv: query head j reads KV head j / n_rep
  const int64_t first =
      c.sliding_window > 0 ? std::max<int64_t>(0, position - c.sliding_window + 1) : 0;
  const double* k_base = cache.k.data() + (b * cache.kv_heads + kv) * cache.max_len * p.d;
  const double* v_base = cache.v.data() + (b * cache.kv_heads + kv) * cache.max_len * p.d;
  std::vector<double> scores(position - first + 1);
  double max = c.sinks ? p.sinks[head] : -std::numeric_limits<double>::infinity();
  for (int64_t j = first; j <= position; ++j) {
    double dot = 0;
    for (int64_t i = 0; i < p.d; ++i) dot += q[i] * k_base[j * p.d + i];
    scores[j - first] = p.scale * dot;
    max = std::max(max, scores[j - first]);
  }
  double sum = c.sinks ? std::exp(p.sinks[head] - max) : 0.0;  // the sink has no value
  for (double s : scores) sum += std::exp(s - max);
  std::fill(out, out + p.d, 0.0);
  for (int64_t j = first; j <= position; ++j) {
    const double weight = std::exp(scores[j - first] - max) / sum;
    for (int64_t i = 0; i < p.d; ++i) out[i] += weight * v_base[j * p.d + i];
  }
}

}  // namespace

Status check_layer(const LayerConfig& c, const LayerWeights& w) {
  if (Status s = check_config(c); !s.ok) return s;
  const int64_t d = head_dim_of(c), q_rows = c.num_heads * d, kv_rows = c.num_kv_heads * d;
  const int64_t hidden = c.hidden_size;
  const struct {
    const char* name;
    const std::vector<float>& v;
    bool on;
    int64_t size;
    const char* flag;
  } parts[] = {
      {"q_proj", w.q_proj, true, q_rows * hidden, ""},
      {"k_proj", w.k_proj, true, kv_rows * hidden, ""},
      {"v_proj", w.v_proj, true, kv_rows * hidden, ""},
      {"o_proj", w.o_proj, true, hidden * q_rows, ""},
      {"q_bias", w.q_bias, c.qkv_bias, q_rows, "qkv_bias"},
      {"k_bias", w.k_bias, c.qkv_bias, kv_rows, "qkv_bias"},
      {"v_bias", w.v_bias, c.qkv_bias, kv_rows, "qkv_bias"},
      {"o_bias", w.o_bias, c.o_bias, hidden, "o_bias"},
      {"q_norm", w.q_norm, c.qk_norm, d, "qk_norm"},
      {"k_norm", w.k_norm, c.qk_norm, d, "qk_norm"},
      {"sinks", w.sinks, c.sinks, c.num_heads, "sinks"},
  };
  for (const auto& part : parts) {
    if (Status s = check_part(part.name, part.v, part.on, part.size, part.flag); !s.ok) return s;
  }
  return Status::Ok();
}

Status make_layer_cache(const LayerConfig& c, int64_t batch, int64_t max_len, LayerCache* cache) {
  if (Status s = check_config(c); !s.ok) return s;
  if (batch < 0) return error("batch", "must be >= 0");
  if (max_len < 1) return error("max_len", "must be >= 1");
  cache->batch = batch;
  cache->kv_heads = c.num_kv_heads;
  cache->max_len = max_len;
  cache->head_dim = head_dim_of(c);
  const int64_t size = batch * c.num_kv_heads * max_len * cache->head_dim;
  cache->k.assign(size, 0.0);  // zero-initialised, as the module's cache (section 7)
  cache->v.assign(size, 0.0);
  cache->lengths.assign(batch, 0);
  return Status::Ok();
}

Status layer_forward(const LayerConfig& c, const LayerWeights& w, const TensorView& x,
                     const TensorView& positions, LayerCache* cache, std::vector<double>* out) {
  if (Status s = check_layer(c, w); !s.ok) return s;
  if (cache == nullptr) return error("cache", "must not be null");
  if (Status s = check_inputs(c, x, *cache); !s.ok) return s;
  const int64_t batch = x.shape[0], tokens = x.shape[1];
  std::vector<int64_t> pos;
  if (Status s = read_positions(positions, batch, tokens, *cache, &pos); !s.ok) return s;

  const Params p = load_params(c, w);
  const int64_t slot_stride = cache->max_len * p.d;  // one KV head of one sequence
  std::vector<TokenQkv> qkv(batch * tokens);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t position = pos[b * tokens + t];
      TokenQkv& token = qkv[b * tokens + t] = project_token(c, p, x, b, t, position);
      // A repeated position is chunk padding: not written, so not a key (section 6).
      if (t > 0 && pos[b * tokens + t - 1] == position) continue;
      for (int64_t kv = 0; kv < p.kv_heads; ++kv) {
        const int64_t at = (b * p.kv_heads + kv) * slot_stride + position * p.d;
        const DType stored = c.kv_cache_dtype.value_or(c.dtype);
        store_row(stored, token.k.data() + kv * p.d, p.d, cache->k.data() + at);  // R8
        store_row(stored, token.v.data() + kv * p.d, p.d, cache->v.data() + at);
      }
    }
    if (tokens > 0) {
      cache->lengths[b] = std::max(cache->lengths[b], pos[b * tokens + tokens - 1] + 1);
    }
  }

  out->assign(batch * tokens * p.hidden, 0.0);
  std::vector<double> attn(p.heads * p.d);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < tokens; ++t) {
      const TokenQkv& token = qkv[b * tokens + t];
      for (int64_t h = 0; h < p.heads; ++h) {
        attend(c, p, *cache, b, h, pos[b * tokens + t], token.q.data() + h * p.d,
               attn.data() + h * p.d);
      }
      round_all(&attn, c.dtype);  // R6
      std::vector<double> y = linear(p.wo, {}, p.hidden, p.heads * p.d, attn.data());
      round_all(&y, c.dtype);  // R7: the partial (the whole sum at tp = 1)
      for (int64_t i = 0; i < p.hidden; ++i) {
        double v = y[i];
        if (c.o_bias) v = round_to_dtype(v + p.bo[i], c.dtype);  // R7: bias after the reduce
        (*out)[(b * tokens + t) * p.hidden + i] = v;
      }
    }
  }
  return Status::Ok();
}

}  // namespace flashcte::reference
