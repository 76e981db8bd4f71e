// flash_attn_with_kvcache (include/flashcte/kvcache.h): validate everything, turn the queries
// (rotary), save the cache slots the append overwrites, append the new keys (rotary) and values
// through the caches' K/V sources, then attend the updated cache: a few queries per sequence on
// the decode kernel, longer chunks (prefill, chunked prefill) on attention_cte with the cache as
// its prior, read from the pages in place. Should the kernel fail (memory), the saved slots go
// back, so a failed call leaves the caches as they were.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <tuple>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/core/convert.h"
#include "src/dispatch/kvcache.h"
#include "src/dispatch/validate.h"
#include "src/dispatch/views.h"
#include "src/kernel/decode.h"
#include "src/schedule/decode_schedule.h"
#include "src/schedule/region.h"

namespace flashcte::internal {
namespace {

// Rotates x[0, rotary_dim) in place by the angles of row `pos` of cos / sin: pairs (2i, 2i + 1)
// when interleaved, else (i, i + rotary_dim / 2), as FlashAttention's apply_rotary_emb; float32
// arithmetic, as its kernel.
void rotate(const KvAppend& a, int64_t pos, float* x) {
  const int64_t half = a.rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c =
        load_as_float(a.cos.data, pos * a.cos.strides[0] + i * a.cos.strides[1], a.cos.dtype);
    const float s =
        load_as_float(a.sin.data, pos * a.sin.strides[0] + i * a.sin.strides[1], a.sin.dtype);
    float& x0 = x[a.interleaved ? 2 * i : i];
    float& x1 = x[a.interleaved ? 2 * i + 1 : i + half];
    const float r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
    x0 = r0;
    x1 = r1;
  }
}

// q turned at its positions, as a (batch, heads, seqlen_q, d) tensor of q's dtype that replaces
// q in the problem (the caller's q is not written).
std::vector<unsigned char> rotated_q(const KvAppend& a, DecodeProblem* p) {
  const int64_t d = p->head_dim, elem = dtype_size(p->dtype);
  std::vector<unsigned char> out(static_cast<size_t>(p->batch * p->q_heads * p->tokens * d * elem));
  std::vector<float> row(static_cast<size_t>(d));
  const auto& st = p->q_strides;
  for (int64_t b = 0; b < p->batch; ++b) {
    for (int64_t h = 0; h < p->q_heads; ++h) {
      for (int64_t i = 0; i < p->tokens; ++i) {
        load_row_as_float(p->q, b * st[0] + h * st[1] + i * st[2], st[3], p->dtype, row.data(), d);
        rotate(a, a.start[b] + (a.q_per_token ? i : 0), row.data());
        store_row_from_float(out.data(), ((b * p->q_heads + h) * p->tokens + i) * d, 1, p->dtype,
                             row.data(), d);
      }
    }
  }
  p->q = out.data();
  p->q_strides = {p->q_heads * p->tokens * d, p->tokens * d, d, 1};
  return out;
}

// Calls f(source, new tensor, channels, b, t, head, element offset of the cache row) for every
// row the append writes, K rows first.
template <class F>
void for_each_new_row(const DecodeProblem& p, const KvAppend& a, const F& f) {
  for (auto [src, t, channels] :
       {std::tuple{&p.k, &a.k, p.head_dim}, std::tuple{&p.v, &a.v, p.value_dim}}) {
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t i = 0; i < a.tokens; ++i) {
        for (int64_t h = 0; h < p.kv_heads; ++h) {
          f(*src, *t, channels, b, i, h, src->offset(b, h, a.start[b] + i));
        }
      }
    }
  }
}

// The bytes of the cache elements the append overwrites, in its order, to put back on failure:
// a row at a time where its channels are back to back (the usual layouts), else element by
// element.
std::vector<unsigned char> save_slots(const DecodeProblem& p, const KvAppend& a) {
  std::vector<unsigned char> saved;
  saved.reserve(static_cast<size_t>(p.batch * a.tokens * p.kv_heads * (p.head_dim + p.value_dim) *
                                    dtype_size(p.dtype)));
  for_each_new_row(p, a,
                   [&](const KvSource& src, const TensorView&, int64_t channels, int64_t, int64_t,
                       int64_t, int64_t offset) {
                     const int64_t elem = src.element_bytes(), step = src.strides[3] * elem;
                     const unsigned char* e =
                         static_cast<const unsigned char*>(src.data) + offset * elem;
                     if (src.strides[3] == 1) {
                       saved.insert(saved.end(), e, e + channels * elem);
                       return;
                     }
                     for (int64_t x = 0; x < channels; ++x, e += step) {
                       saved.insert(saved.end(), e, e + elem);
                     }
                   });
  return saved;
}

void restore_slots(const DecodeProblem& p, const KvAppend& a,
                   const std::vector<unsigned char>& saved) {
  size_t at = 0;
  for_each_new_row(p, a,
                   [&](const KvSource& src, const TensorView&, int64_t channels, int64_t, int64_t,
                       int64_t, int64_t offset) {
                     const int64_t elem = src.element_bytes(), step = src.strides[3] * elem;
                     // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the caller's writable
                     // cache
                     auto* e =
                         static_cast<unsigned char*>(const_cast<void*>(src.data)) + offset * elem;
                     const int64_t run = src.strides[3] == 1 ? channels : 1;
                     for (int64_t x = 0; x < channels; x += run, e += step * run) {
                       std::memcpy(e, &saved[at], static_cast<size_t>(run * elem));
                       at += static_cast<size_t>(run * elem);
                     }
                   });
}

// Writes k (turned) and v into their slots. Values of the caches' dtype round-trip float32
// exactly, so v is copied bit for bit (a NaN's payload aside) and k rounds once after turning.
void append(const DecodeProblem& p, const KvAppend& a) {
  std::vector<float> row(static_cast<size_t>(std::max(p.head_dim, p.value_dim)));
  for_each_new_row(p, a,
                   [&](const KvSource& src, const TensorView& t, int64_t channels, int64_t b,
                       int64_t i, int64_t h, int64_t offset) {
                     load_row_as_float(t.data,
                                       b * t.strides[0] + i * t.strides[1] + h * t.strides[2],
                                       t.strides[3], t.dtype, row.data(), channels);
                     if (a.rotary_dim > 0 && &t == &a.k) rotate(a, a.start[b] + i, row.data());
                     // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the caller's writable
                     // cache
                     store_row_from_float(const_cast<void*>(src.data), offset, src.strides[3],
                                          src.dtype, row.data(), channels);
                   });
}

}  // namespace

Status prefill_problem(const DecodeProblem& p, const KvAppend& a, const MutableTensorView& k_cache,
                       const MutableTensorView& v_cache, const KvCacheOptions& o, int64_t b,
                       Problem* problem) {
  const bool paged = o.block_table.present();
  const int64_t elem = dtype_size(p.dtype), kv_heads = p.kv_heads;
  const int64_t seqlen_k = a.start[b] + a.tokens;
  const auto* q = static_cast<const unsigned char*>(p.q) + b * p.q_strides[0] * elem;
  const TensorView qv{q,
                      p.dtype,
                      3,
                      {p.q_heads, p.tokens, p.head_dim},
                      {p.q_strides[1], p.q_strides[2], p.q_strides[3]}};
  const TensorView none_k{q, p.dtype, 3, {kv_heads, 0, p.head_dim}, {p.head_dim, p.head_dim, 1}};
  const TensorView none_v{q, p.dtype, 3, {kv_heads, 0, p.value_dim}, {p.value_dim, p.value_dim, 1}};
  Options opt;
  opt.tp_k = true;
  opt.causal_mask = false;
  opt.bottom_right = true;
  opt.scale = p.scale;
  opt.softcap = p.softcap;
  opt.window_left = o.window_left;
  opt.window_right = o.causal ? 0 : o.window_right;
  opt.num_threads = p.threads;
  opt.prior_used_len = {seqlen_k};
  // The cache as the prior: its pages with this sequence's row of the table, or its cache row.
  for (auto [prior, cache] :
       {std::pair{&opt.k_prior, &k_cache}, std::pair{&opt.v_prior, &v_cache}}) {
    const auto& st = cache->strides;
    if (paged) {
      *prior = {cache->data,
                p.dtype,
                4,
                {cache->shape[0], cache->shape[2], cache->shape[1], cache->shape[3]},
                {st[0], st[2], st[1], st[3]}};
    } else {
      const int64_t row = p.k.paged() ? p.k.table[static_cast<size_t>(b)] : b;
      *prior = {static_cast<const unsigned char*>(cache->data) + row * st[0] * elem,
                p.dtype,
                3,
                {kv_heads, cache->shape[1], cache->shape[3]},
                {st[2], st[1], st[3]}};
    }
  }
  if (paged) {
    const TensorView& t = o.block_table;
    opt.prior_block_table = {static_cast<const int32_t*>(t.data) + b * t.strides[0],
                             DType::kInt32,
                             2,
                             {1, t.shape[1]},
                             {t.shape[1] * t.strides[1], t.strides[1]}};
  }
  // Left padding as packing bounds (copied by the validation).
  std::vector<int64_t> lo_bound, hi_bound;
  if (o.cache_leftpad.present()) {
    const TensorView& t = o.cache_leftpad;
    lo_bound.assign(static_cast<size_t>(p.tokens),
                    static_cast<const int32_t*>(t.data)[b * t.strides[0]]);
    hi_bound.assign(lo_bound.size(), seqlen_k);
    opt.bound_min = TensorView::contiguous(lo_bound.data(), DType::kInt64, {p.tokens});
    opt.bound_max = TensorView::contiguous(hi_bound.data(), DType::kInt64, {p.tokens});
  }
  if (p.alibi) {
    opt.alibi_slopes = {
        p.alibi + b * p.alibi_strides[0], DType::kFloat32, 1, {p.q_heads}, {p.alibi_strides[1]}};
  }
  if (p.sink) opt.sink = {p.sink, DType::kFloat32, 2, {p.q_heads, 1}, {p.sink_stride, 1}};
  Outputs out;
  out.out = {static_cast<unsigned char*>(p.out) + b * p.out_strides[0] * elem,
             p.dtype,
             3,
             {p.q_heads, p.tokens, p.value_dim},
             {p.out_strides[1], p.out_strides[2], p.out_strides[3]}};
  if (p.lse) {
    out.lse = {p.lse + b * p.lse_strides[0],
               DType::kFloat32,
               2,
               {p.q_heads, p.tokens},
               {p.lse_strides[1], p.lse_strides[2]}};
  }
  return validate(qv, none_k, none_v, out, opt, false, problem);
}

}  // namespace flashcte::internal

namespace flashcte {

Status flash_attn_with_kvcache(const TensorView& q, const MutableTensorView& k_cache,
                               const MutableTensorView& v_cache, const MutableTensorView& out,
                               const MutableTensorView& lse, const KvCacheOptions& options) {
  internal::DecodeProblem problem;
  internal::KvAppend append;
  std::vector<unsigned char> saved;
  bool appended = false;
  try {
    Status s =
        internal::validate_kvcache(q, k_cache, v_cache, out, lse, options, &problem, &append);
    if (!s.ok) return s;
    std::vector<unsigned char> q_turned;
    if (append.rotary_dim > 0) q_turned = internal::rotated_q(append, &problem);
    saved = internal::save_slots(problem, append);
    appended = true;
    internal::append(problem, append);
    if (problem.tokens <= internal::kDecodeMaxQueries) {
      internal::run_decode(internal::DecodeKernel(problem));
      return Status::Ok();
    }
    // Longer chunks: one attention_cte problem per sequence, all in one parallel region.
    std::vector<internal::Problem> prefills(static_cast<size_t>(problem.batch));
    for (int64_t b = 0; b < problem.batch; ++b) {
      s = internal::prefill_problem(problem, append, k_cache, v_cache, options, b, &prefills[b]);
      if (!s.ok) {
        internal::restore_slots(problem, append, saved);
        return s;
      }
    }
    const std::vector<internal::AttentionKernel> kernels(prefills.begin(), prefills.end());
    internal::run_kernels(internal::addresses(kernels), {}, problem.threads);
    return Status::Ok();
  } catch (const std::exception& e) {
    if (appended) internal::restore_slots(problem, append, saved);
    if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
      return Status::Error(
          "memory: allocation of the call's scratch failed; the caches are as "
          "they were");
    }
    return Status::Error(std::string("internal: ") + e.what());
  }
}

}  // namespace flashcte
