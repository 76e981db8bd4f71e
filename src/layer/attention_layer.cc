// AttentionLayer (include/flashcte/layer.h): NeuronAttentionBase.forward (LAYER.md section 1)
// with the cache write of the decoder model folded in.
//
//   x -> QKV GEMM (one fused [Wq; Wk; Wv] product, OpenBLAS, src/layer/blas.h) + bias -> round
//     -> per head: q/k RMSNorm (before RoPE) -> RoPE (src/layer/rope.h)
//     -> K, V appended into the cache at the positions and the attention over it, in one
//        flash_attn_with_kvcache call (flashcte/kvcache.h) on the dense cache or the block pool:
//        T <= kMaxDecodeTokens on the decode kernel, longer chunks (context encoding, chunked
//        prefill over cached tokens: prefix caching) on attention_cte with the cache as its
//        prior; causal, window, sinks. Every check comes before the append, and a failed call
//        leaves the cache as it was.
//     -> O GEMM -> round -> + o_bias -> round (R7) -> out.
// Roundings to the activation dtype follow the oracle's R1-R7 (src/reference/layer_reference.h).
// The GEMMs are the layer's arithmetic: 2 * T * hidden * (H + 2 KV + H) * D FLOP per sequence
// against the weights' 4 * hidden * (2 H + 2 KV) * D bytes, so decode (small T) reads weights
// at the memory bandwidth and prefill runs at SGEMM speed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "flashcte/layer.h"
#include "src/core/convert.h"
#include "src/layer/blas.h"
#include "src/layer/config.h"
#include "src/layer/gqa.h"
#include "src/layer/rope.h"
#include "src/layer/shard.h"

namespace flashcte {
namespace {

std::vector<float> rounded(const std::vector<float>& w, DType dtype) {
  std::vector<float> r(w.size());
  for (size_t i = 0; i < w.size(); ++i) r[i] = internal::round_to(dtype, w[i]);
  return r;
}

// x' = x * rsqrt(mean(x^2) + eps) * w in float32, cast back (LAYER.md section 8).
void rms_norm(float* x, const float* weight, int64_t n, double eps, DType dtype) {
  double squares = 0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) x[i] = internal::round_to(dtype, x[i] * inv * weight[i]);
}

}  // namespace

struct AttentionLayer::Impl {
  LayerConfig config;
  int64_t d = 0, heads = 0, kv_heads = 0, hidden = 0;
  std::vector<float> w_qkv, b_qkv;  // (H + 2 KV) * D rows of hidden: [Wq; Wk; Wv], rounded
  std::vector<float> w_o, b_o;      // (hidden, H * D), (hidden)
  std::vector<float> q_norm, k_norm, sinks;
  float scale = 1.0f;
  DType cache_dtype = DType::kFloat32;  // kv_cache_dtype, else the activation dtype
  layer::Rope rope;

  Impl(const LayerConfig& c, const LayerWeights& w)
      : config(c),
        d(layer::head_dim_of(c)),
        heads(c.num_heads),
        kv_heads(c.num_kv_heads),
        hidden(c.hidden_size),
        cache_dtype(c.kv_cache_dtype.value_or(c.dtype)),
        rope(c, layer::head_dim_of(c)) {
    const DType t = c.dtype;
    for (const std::vector<float>* part : {&w.q_proj, &w.k_proj, &w.v_proj}) {
      const std::vector<float> r = rounded(*part, t);
      w_qkv.insert(w_qkv.end(), r.begin(), r.end());
    }
    if (c.qkv_bias) {
      for (const std::vector<float>* part : {&w.q_bias, &w.k_bias, &w.v_bias}) {
        const std::vector<float> r = rounded(*part, t);
        b_qkv.insert(b_qkv.end(), r.begin(), r.end());
      }
    }
    w_o = rounded(w.o_proj, t);
    b_o = rounded(w.o_bias, t);
    q_norm = rounded(w.q_norm, t);
    k_norm = rounded(w.k_norm, t);
    sinks = rounded(w.sinks, t);
    // qk_scale 0 means unset (LAYER.md section 9 item 14).
    scale = static_cast<float>(c.qk_scale != 0.0 ? c.qk_scale : 1.0 / std::sqrt(double(d)));
  }

  int64_t qkv_width() const { return (heads + 2 * kv_heads) * d; }
  Status check_call(const TensorView& x, const TensorView& positions, const KvCache& cache,
                    const MutableTensorView& out, std::vector<int64_t>* pos) const;
  void project_qkv(const std::vector<float>& qkv, const std::vector<int64_t>& pos, int64_t batch,
                   int64_t tokens, void* q_act, void* k_new, void* v_new) const;
  Status attend(const void* q_act, const void* k_new, const void* v_new,
                const std::vector<int64_t>& pos, int64_t batch, int64_t tokens, KvCache* cache,
                void* attn, int threads) const;
};

Status AttentionLayer::Impl::check_call(const TensorView& x, const TensorView& positions,
                                        const KvCache& cache, const MutableTensorView& out,
                                        std::vector<int64_t>* pos) const {
  if (x.rank != 3 || x.data == nullptr) {
    return Status::Error("x: must be a tensor of shape (batch, T, hidden_size)");
  }
  if (x.dtype != DType::kFloat32 && x.dtype != DType::kBFloat16 && x.dtype != DType::kFloat16) {
    return Status::DtypeError("x: dtype must be float32, bfloat16 or float16");
  }
  if (x.shape[2] != hidden) {
    return Status::Error("x: last dimension " + std::to_string(x.shape[2]) +
                         " must be hidden_size = " + std::to_string(hidden));
  }
  const int64_t batch = x.shape[0], tokens = x.shape[1];
  if (cache.batch() != batch || cache.kv_heads() != kv_heads || cache.head_dim() != d ||
      cache.dtype() != cache_dtype) {
    return Status::Error("cache: holds (batch " + std::to_string(cache.batch()) + ", kv_heads " +
                         std::to_string(cache.kv_heads()) + ", head_dim " +
                         std::to_string(cache.head_dim()) + ", " + dtype_name(cache.dtype()) +
                         ") but this call needs (batch " + std::to_string(batch) + ", kv_heads " +
                         std::to_string(kv_heads) + ", head_dim " + std::to_string(d) + ", " +
                         dtype_name(cache_dtype) + "): a cache of another layer or batch");
  }
  if (positions.rank != 2 || positions.dtype != DType::kInt64 || positions.data == nullptr ||
      positions.shape[0] != batch || positions.shape[1] != tokens) {
    return Status::Error("positions: must be an int64 tensor of shape (batch, T) = (" +
                         std::to_string(batch) + ", " + std::to_string(tokens) + ")");
  }
  if (out.rank != 3 || out.data == nullptr || out.shape[0] != batch || out.shape[1] != tokens ||
      out.shape[2] != hidden || out.dtype != config.dtype) {
    return Status::Error("out: must be a " + std::string(dtype_name(config.dtype)) +
                         " tensor of shape (batch, T, hidden_size) = (" + std::to_string(batch) +
                         ", " + std::to_string(tokens) + ", " + std::to_string(hidden) + ")");
  }
  pos->resize(static_cast<size_t>(batch * tokens));
  const auto* p = static_cast<const int64_t*>(positions.data);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t at = p[b * positions.strides[0] + t * positions.strides[1]];
      (*pos)[static_cast<size_t>(b * tokens + t)] = at;
      const auto where = [&] {  // only for a message: not a string per token of every call
        return "positions: row " + std::to_string(b) + " token " + std::to_string(t) + " is " +
               std::to_string(at);
      };
      if (t == 0 && (at < 0 || at > cache.length(b))) {
        return Status::Error(where() + "; a row must start in [0, cached length = " +
                             std::to_string(cache.length(b)) +
                             "] (a later start would skip cache slots)");
      }
      if (t > 0 && at != (*pos)[static_cast<size_t>(b * tokens + t - 1)] + 1) {
        return Status::Error(where() + "; positions within a row must go up by 1");
      }
      if (at >= cache.capacity(b)) {
        return Status::Error(where() + ", past " +
                             (cache.paged()
                                  ? "sequence " + std::to_string(b) + "'s pages (" +
                                        std::to_string(cache.capacity(b)) + " slots)"
                                  : "the cache's max_len = " + std::to_string(cache.max_len())));
      }
    }
  }
  if (!cache.paged() || tokens == 0) return Status::Ok();
  // A page this call writes belongs to its sequence alone: shared prefix pages are read-only.
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<int32_t>& pages = cache.pages(b);
    const int64_t first = (*pos)[static_cast<size_t>(b * tokens)] / cache.block_size();
    const int64_t last = (*pos)[static_cast<size_t>(b * tokens + tokens - 1)] / cache.block_size();
    for (int64_t i = first; i <= last; ++i) {
      for (int64_t other = 0; other < cache.batch(); ++other) {
        const std::vector<int32_t>& named = cache.pages(other);
        if (other != b && std::find(named.begin(), named.end(), pages[i]) != named.end()) {
          return Status::Error("positions: row " + std::to_string(b) + " writes into page " +
                               std::to_string(pages[i]) + ", which sequence " +
                               std::to_string(other) +
                               " also names; a shared prefix page is read-only (give the "
                               "sequence a page of its own)");
        }
      }
    }
  }
  return Status::Ok();
}

// From the QKV GEMM's rows (rounded, biased): q/k norm and RoPE per head, Q into q_act (batch,
// T, H, D), the new K and V into k_new / v_new (batch, T, KV, D), in the activation dtype.
void AttentionLayer::Impl::project_qkv(const std::vector<float>& qkv,
                                       const std::vector<int64_t>& pos, int64_t batch,
                                       int64_t tokens, void* q_act, void* k_new,
                                       void* v_new) const {
  const DType t = config.dtype;
  std::vector<float> cos(static_cast<size_t>(rope.rotary_dim() / 2));
  std::vector<float> sin(cos.size()), row(static_cast<size_t>(qkv_width()));
  for (int64_t token = 0; token < batch * tokens; ++token) {
    std::copy_n(qkv.data() + token * qkv_width(), qkv_width(), row.data());
    float* q = row.data();
    float* k = q + heads * d;
    const float* v = k + kv_heads * d;
    if (config.qk_norm) {
      for (int64_t h = 0; h < heads; ++h)
        rms_norm(q + h * d, q_norm.data(), d, config.qk_norm_eps, t);
      for (int64_t h = 0; h < kv_heads; ++h)
        rms_norm(k + h * d, k_norm.data(), d, config.qk_norm_eps, t);
    }
    if (config.rope) {
      rope.cos_sin(pos[static_cast<size_t>(token)], cos.data(), sin.data());
      rope.rotate(cos.data(), sin.data(), q, heads);
      rope.rotate(cos.data(), sin.data(), k, kv_heads);
    }
    internal::store_row_from_float(q_act, token * heads * d, 1, t, q, heads * d);
    internal::store_row_from_float(k_new, token * kv_heads * d, 1, t, k, kv_heads * d);
    internal::store_row_from_float(v_new, token * kv_heads * d, 1, t, v, kv_heads * d);
  }
}

// attn (batch, T, H, D) in the activation dtype: the new K/V appended into the cache at the
// positions and the queries attending it, causal within the window, with the sinks; one
// flash_attn_with_kvcache call, which writes nothing unless every check passes and puts the
// slots back should the kernel fail.
Status AttentionLayer::Impl::attend(const void* q_act, const void* k_new, const void* v_new,
                                    const std::vector<int64_t>& pos, int64_t batch, int64_t tokens,
                                    KvCache* cache, void* attn, int threads) const {
  const DType t = config.dtype;
  KvCacheOptions o;
  o.k = TensorView::contiguous(k_new, t, {batch, tokens, kv_heads, d});
  o.v = TensorView::contiguous(v_new, t, {batch, tokens, kv_heads, d});
  std::vector<int32_t> starts(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    starts[static_cast<size_t>(b)] = static_cast<int32_t>(pos[static_cast<size_t>(b * tokens)]);
  }
  o.cache_seqlens = TensorView::contiguous(starts.data(), DType::kInt32, {batch});
  o.softmax_scale = scale;
  o.causal = true;
  if (config.sliding_window > 0) o.window_left = config.sliding_window - 1;
  if (config.sinks) o.sinks = TensorView::contiguous(sinks.data(), DType::kFloat32, {heads});
  o.num_threads = threads;
  // The storage as flash_attn_with_kvcache's (rows, slots, kv_heads, d): dense rows are
  // sequences of max_len slots, pages are rows of block_size slots; (kv_heads, slots) permuted.
  const int64_t slots = cache->paged() ? cache->block_size() : cache->max_len();
  const int64_t rows = cache->paged() ? cache->num_blocks() : cache->batch();
  std::vector<int32_t> table;
  if (cache->paged()) {
    const int64_t width = std::max<int64_t>(cache->max_len() / slots, 1);
    table.assign(static_cast<size_t>(batch * width), -1);  // -1 past a sequence's pages: unread
    for (int64_t b = 0; b < batch; ++b) {
      std::copy(cache->pages(b).begin(), cache->pages(b).end(), table.begin() + b * width);
    }
    o.block_table = TensorView::contiguous(table.data(), DType::kInt32, {batch, width});
  }
  MutableTensorView k_cache =
      MutableTensorView::contiguous(cache->k_data(), cache_dtype, {rows, kv_heads, slots, d});
  MutableTensorView v_cache =
      MutableTensorView::contiguous(cache->v_data(), cache_dtype, {rows, kv_heads, slots, d});
  std::vector<MutableTensorView*> permuted = {&k_cache, &v_cache};
  if (cache->k_scale_data() != nullptr) {  // 8-bit: per-slot scales, quantized on append
    o.k_scale = MutableTensorView::contiguous(cache->k_scale_data(), DType::kFloat32,
                                              {rows, kv_heads, slots});
    o.v_scale = MutableTensorView::contiguous(cache->v_scale_data(), DType::kFloat32,
                                              {rows, kv_heads, slots});
    permuted.insert(permuted.end(), {&o.k_scale, &o.v_scale});
  }
  for (MutableTensorView* view : permuted) {
    std::swap(view->shape[1], view->shape[2]);
    std::swap(view->strides[1], view->strides[2]);
  }
  const TensorView q = TensorView::contiguous(q_act, t, {batch, tokens, heads, d});
  const MutableTensorView out = MutableTensorView::contiguous(attn, t, {batch, tokens, heads, d});
  const Status s = flash_attn_with_kvcache(q, k_cache, v_cache, out, {}, o);
  if (!s.ok) return Status::Error("attention: " + s.message, s.kind);
  return Status::Ok();
}

AttentionLayer::AttentionLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AttentionLayer::~AttentionLayer() = default;

const LayerConfig& AttentionLayer::config() const { return impl_->config; }
int64_t AttentionLayer::head_dim() const { return impl_->d; }

Status AttentionLayer::create(const LayerConfig& config, const LayerWeights& weights,
                              std::unique_ptr<AttentionLayer>* layer) {
  if (layer == nullptr) return Status::Error("layer: must not be null");
  if (Status s = layer::check_config(config); !s.ok) return s;
  if (Status s = layer::check_weights(config, weights); !s.ok) return s;
  try {
    if (config.tp_degree != 1 || config.tp_rank != 0) {
      LayerConfig rank_config;
      LayerWeights rank_weights;
      if (Status s = layer::rank_layer(config, weights, &rank_config, &rank_weights); !s.ok) {
        return s;
      }
      layer->reset(new AttentionLayer(std::make_unique<Impl>(rank_config, rank_weights)));
      return Status::Ok();
    }
    layer->reset(new AttentionLayer(std::make_unique<Impl>(config, weights)));
  } catch (const std::bad_alloc&) {
    return Status::Error("weights: allocation of the layer's weight copies failed",
                         ErrorKind::kMemory);
  }
  return Status::Ok();
}

Status AttentionLayer::create_from_shard(const LayerConfig& config, const LayerWeights& shard,
                                         std::unique_ptr<AttentionLayer>* layer) {
  if (layer == nullptr) return Status::Error("layer: must not be null");
  LayerConfig rank;
  if (Status s = rank_config(config, &rank); !s.ok) return s;
  if (Status s = layer::check_shard(config, rank, shard); !s.ok) return s;
  try {
    layer->reset(new AttentionLayer(std::make_unique<Impl>(rank, shard)));
  } catch (const std::bad_alloc&) {
    return Status::Error("weights: allocation of the layer's weight copies failed",
                         ErrorKind::kMemory);
  }
  return Status::Ok();
}

Status AttentionLayer::new_cache(int64_t batch, int64_t max_len, KvCache* cache) const {
  return KvCache::create(batch, impl_->kv_heads, max_len, impl_->d, impl_->cache_dtype, cache);
}

Status AttentionLayer::new_paged_cache(int64_t batch, int64_t num_blocks, int64_t block_size,
                                       KvCache* cache) const {
  return KvCache::create_paged(batch, num_blocks, block_size, impl_->kv_heads, impl_->d,
                               impl_->cache_dtype, cache);
}

Status AttentionLayer::forward(const TensorView& x, const TensorView& positions, KvCache* cache,
                               const MutableTensorView& out, int num_threads) const {
  if (cache == nullptr) return Status::Error("cache: must not be null");
  const Impl& m = *impl_;
  try {
    std::vector<int64_t> pos;
    if (Status s = m.check_call(x, positions, *cache, out, &pos); !s.ok) return s;
    const int64_t batch = x.shape[0], tokens = x.shape[1], rows = batch * tokens;
    const DType t = m.config.dtype;
    // x rounded to the activation dtype (R1), as float32 rows for the GEMM.
    std::vector<float> xf(static_cast<size_t>(rows * m.hidden));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < tokens; ++i) {
        float* x_row = xf.data() + (b * tokens + i) * m.hidden;
        internal::load_row_as_float(x.data, b * x.strides[0] + i * x.strides[1], x.strides[2],
                                    x.dtype, x_row, m.hidden);
        for (int64_t c = 0; c < m.hidden; ++c) x_row[c] = internal::round_to(t, x_row[c]);
      }
    }
    std::vector<float> qkv(static_cast<size_t>(rows * m.qkv_width()));
    if (Status s = layer::gemm_nt(rows, m.qkv_width(), m.hidden, xf.data(), m.hidden,
                                  m.w_qkv.data(), m.hidden, qkv.data(), m.qkv_width(), num_threads);
        !s.ok) {
      return s;
    }
    for (int64_t r = 0; r < rows; ++r) {  // + bias, rounded (R2)
      float* y = qkv.data() + r * m.qkv_width();
      for (int64_t c = 0; c < m.qkv_width(); ++c) {
        y[c] =
            internal::round_to(t, m.b_qkv.empty() ? y[c] : y[c] + m.b_qkv[static_cast<size_t>(c)]);
      }
    }
    const int64_t element = dtype_size(t), row = m.heads * m.d;
    std::vector<uint8_t> q_act(static_cast<size_t>(rows * row * element));
    std::vector<uint8_t> k_new(static_cast<size_t>(rows * m.kv_heads * m.d * element));
    std::vector<uint8_t> v_new(k_new.size());
    m.project_qkv(qkv, pos, batch, tokens, q_act.data(), k_new.data(), v_new.data());
    std::vector<uint8_t> attn(q_act.size());
    // The O projection's buffers too: once attend() has written the cache, nothing may fail.
    std::vector<float> attn_f(static_cast<size_t>(rows * row)),
        y(static_cast<size_t>(rows * m.hidden));
    if (Status s = m.attend(q_act.data(), k_new.data(), v_new.data(), pos, batch, tokens, cache,
                            attn.data(), num_threads);
        !s.ok) {
      return s;
    }
    // The chunk's slots are filled once its attention ran (a failed call adds no tokens).
    for (int64_t b = 0; b < batch; ++b) {
      cache->lengths_[static_cast<size_t>(b)] =
          std::max(cache->length(b), pos[static_cast<size_t>(b * tokens + tokens - 1)] + 1);
    }
    // O projection (R6: attn holds activation-dtype values), rounded, + bias, rounded (R7).
    internal::load_row_as_float(attn.data(), 0, 1, t, attn_f.data(), rows * row);
    if (Status s = layer::gemm_nt(rows, m.hidden, row, attn_f.data(), row, m.w_o.data(), row,
                                  y.data(), m.hidden, num_threads);
        !s.ok) {
      return s;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* y_row = y.data() + r * m.hidden;
      for (int64_t c = 0; c < m.hidden; ++c) {
        y_row[c] = internal::round_to(t, y_row[c]);
        if (!m.b_o.empty())
          y_row[c] = internal::round_to(t, y_row[c] + m.b_o[static_cast<size_t>(c)]);
      }
      internal::store_row_from_float(out.data,
                                     r / tokens * out.strides[0] + r % tokens * out.strides[1],
                                     out.strides[2], t, y_row, m.hidden);
    }
  } catch (const std::bad_alloc&) {
    return Status::Error("memory: allocation of the layer's activations failed",
                         ErrorKind::kMemory);
  }
  return Status::Ok();
}

std::string layer_gemm_backend() { return layer::gemm_backend(); }

void set_layer_gemm_fallback(const std::string& path, const std::string& symbol_prefix) {
  layer::set_gemm_fallback(path, symbol_prefix);
}

}  // namespace flashcte
