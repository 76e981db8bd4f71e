// flash_attn_with_kvcache's argument validation (kvcache.h). Messages follow the other
// validators: "<argument>: <rule it broke>". Every rule is checked before anything is written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "src/dispatch/decode_args.h"
#include "src/dispatch/kvcache.h"
#include "src/dispatch/kvcache_args.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

using std::to_string;

Status error(const std::string& message) { return Status::Error(message); }

// The caches' geometry (the call's sizes are the DecodeProblem's).
struct Shape {
  bool paged = false;
  int64_t cache_rows = 0;  // dense: batch_cache; paged: num_blocks
  int64_t row_slots = 0;   // dense: seqlen_cache; paged: page_block_size
  int64_t capacity = 0;    // slots per sequence
  int64_t pages_per_sequence = 1;
};

struct Extents {
  DecodeExtents shared;
  Extent k, v, cos, sin, seqlens, batch_idx, leftpad, table, alibi;
  bool k_scale_written = false, v_scale_written = false;  // per-token scales the append writes
};

// k and v, both or neither, (batch, seqlen_new, kv_heads, d / dv) in q's dtype.
Status check_new_kv(const KvCacheOptions& o, const DecodeProblem& p, KvAppend* a, Extents* e) {
  if (o.k.present() != o.v.present()) {
    return error(std::string(o.k.present() ? "v" : "k") +
                 ": k and v are appended together; give both or neither");
  }
  if (!o.k.present()) return Status::Ok();
  FLASHCTE_RETURN_IF_ERROR(check_tensor("k", o.k, 4, "(batch, seqlen_new, kv_heads, d)", &e->k));
  FLASHCTE_RETURN_IF_ERROR(check_tensor("v", o.v, 4, "(batch, seqlen_new, kv_heads, dv)", &e->v));
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("k", o.k.dtype, p.dtype, "q"));
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("v", o.v.dtype, p.dtype, "q"));
  for (auto [name, t, width, what] : {std::tuple{"k", &o.k, p.head_dim, "q's head dim d"},
                                      std::tuple{"v", &o.v, p.value_dim, "v_cache's dv"}}) {
    FLASHCTE_RETURN_IF_ERROR(expect_axis(name, *t, 0, p.batch, "q's batch"));
    FLASHCTE_RETURN_IF_ERROR(expect_axis(name, *t, 2, p.kv_heads, "k_cache's kv_heads"));
    FLASHCTE_RETURN_IF_ERROR(expect_axis(name, *t, 3, width, what));
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("v", o.v, 1, o.k.shape[1], "k's seqlen_new"));
  a->tokens = o.k.shape[1];
  a->k = o.k;
  a->v = o.v;
  return Status::Ok();
}

// rotary_cos / rotary_sin: both or neither, only with k and v, (seqlen_ro, rotary_dim / 2).
Status check_rotary(const KvCacheOptions& o, const DecodeProblem& p, KvAppend* a, Extents* e) {
  if (o.rotary_cos.present() != o.rotary_sin.present()) {
    return error(std::string(o.rotary_cos.present() ? "rotary_sin" : "rotary_cos") +
                 ": rotary_cos and rotary_sin come together; give both or neither");
  }
  if (!o.rotary_cos.present()) return Status::Ok();
  if (!o.k.present()) {
    return error("rotary_cos: rotary embedding applies with new k and v only (as FlashAttention)");
  }
  const TensorView& cos = o.rotary_cos;
  const TensorView& sin = o.rotary_sin;
  FLASHCTE_RETURN_IF_ERROR(
      check_tensor("rotary_cos", cos, 2, "(seqlen_ro, rotary_dim / 2)", &e->cos));
  FLASHCTE_RETURN_IF_ERROR(
      check_tensor("rotary_sin", sin, 2, "(seqlen_ro, rotary_dim / 2)", &e->sin));
  if (cos.dtype != p.dtype && cos.dtype != DType::kFloat32) {
    return Status::DtypeError(std::string("rotary_cos: dtype must be q's (") + dtype_name(p.dtype) +
                              ") or float32, got " + dtype_name(cos.dtype));
  }
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("rotary_sin", sin.dtype, cos.dtype, "rotary_cos"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("rotary_sin", sin, 0, cos.shape[0], "rotary_cos's rows"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_axis("rotary_sin", sin, 1, cos.shape[1], "rotary_cos's rotary_dim / 2"));
  const int64_t rotary_dim = 2 * cos.shape[1];
  if (rotary_dim < 2 || rotary_dim > p.head_dim) {
    return error("rotary_cos: rotary_dim = 2 x " + to_string(cos.shape[1]) +
                 " must be in [2, d = " + to_string(p.head_dim) + "]");
  }
  a->rotary_dim = rotary_dim;
  a->cos = cos;
  a->sin = sin;
  a->interleaved = o.rotary_interleaved;
  a->q_per_token = o.causal || o.window_left >= 0 || o.window_right >= 0;
  return Status::Ok();
}

// alibi_slopes (heads,) or (batch, heads) float32, finite.
Status check_alibi(const TensorView& t, DecodeProblem* p, Extent* extent) {
  FLASHCTE_RETURN_IF_ERROR(check_view("alibi_slopes", t, false, extent));
  FLASHCTE_RETURN_IF_ERROR(expect_float32("alibi_slopes", t.dtype));
  const bool per_batch = t.rank == 2;
  if (!((t.rank == 1 && t.shape[0] == p->q_heads) ||
        (per_batch && t.shape[0] == p->batch && t.shape[1] == p->q_heads))) {
    return error("alibi_slopes: shape " + shape_str(t.shape.data(), t.rank) +
                 " must be (heads,) = (" + to_string(p->q_heads) + ",) or (batch, heads) = (" +
                 to_string(p->batch) + ", " + to_string(p->q_heads) + ")");
  }
  p->alibi = static_cast<const float*>(t.data);
  p->alibi_strides = {per_batch ? t.strides[0] : 0, per_batch ? t.strides[1] : t.strides[0]};
  return check_alibi_values(t);
}

// What the call writes (out, lse; the caches when appending) touches nothing it reads besides
// the caches themselves, nor each other.
Status check_aliasing(const Extents& e, bool appending) {
  const DecodeExtents& d = e.shared;
  struct Named {
    const char* name;
    Extent extent;
  };
  const Named read_only[] = {{"q", d.q},
                             {"k", e.k},
                             {"v", e.v},
                             {"rotary_cos", e.cos},
                             {"rotary_sin", e.sin},
                             {"cache_seqlens", e.seqlens},
                             {"cache_batch_idx", e.batch_idx},
                             {"cache_leftpad", e.leftpad},
                             {"block_table", e.table},
                             {"alibi_slopes", e.alibi},
                             {"sinks", d.sink}};
  std::vector<Named> inputs(std::begin(read_only), std::end(read_only));
  std::vector<Named> written = {{"out", d.out}, {"lse", d.lse}};
  if (appending) {
    written.push_back({"k_cache", d.k_cache});
    written.push_back({"v_cache", d.v_cache});
  }
  for (const auto& [scale, is_written] :
       {std::pair{Named{"k_scale", d.k_scale}, e.k_scale_written},
        std::pair{Named{"v_scale", d.v_scale}, e.v_scale_written}}) {
    (is_written ? written : inputs).push_back(scale);
  }
  FLASHCTE_RETURN_IF_ERROR(check_scales_apart(d, e.k_scale_written && e.v_scale_written));
  for (const Named& w : written) {
    for (const Named& in : inputs) {
      if (overlaps(w.extent, in.extent)) {
        return error(std::string(w.name) + ": overlaps the input " + in.name +
                     ", which the call reads while it writes " + w.name);
      }
    }
  }
  for (const Named& cache : {Named{"k_cache", d.k_cache}, Named{"v_cache", d.v_cache},
                             Named{"k_scale", d.k_scale}, Named{"v_scale", d.v_scale}}) {
    for (const Named& output : {Named{"out", d.out}, Named{"lse", d.lse}}) {
      if (overlaps(output.extent, cache.extent)) {
        return error(std::string(output.name) + ": overlaps " + cache.name +
                     "; outputs must not alias the cache");
      }
    }
  }
  if (overlaps(d.out, d.lse)) return error("lse: overlaps the output out");
  return Status::Ok();
}

}  // namespace

Status check_scales_apart(const DecodeExtents& d, bool both_written) {
  for (const auto& [scale, scale_extent] :
       {std::pair{"k_scale", d.k_scale}, std::pair{"v_scale", d.v_scale}}) {
    for (const auto& [cache, cache_extent] :
         {std::pair{"k_cache", d.k_cache}, std::pair{"v_cache", d.v_cache}}) {
      if (overlaps(scale_extent, cache_extent)) {
        return error(std::string(scale) + ": overlaps " + cache +
                     "; a cache's scales are memory of their own");
      }
    }
  }
  if (both_written && overlaps(d.k_scale, d.v_scale)) {
    return error("v_scale: overlaps k_scale; the append writes both (one scale per token each)");
  }
  return Status::Ok();
}

template <class Options>
Status read_call_options(const Options& o, Extent* alibi, DecodeExtents* e,
                         KvCacheRequest* request) {
  DecodeProblem* p = &request->decode;
  if (o.window_left < -1 || o.window_right < -1) {
    return error("window_size: entries must be >= -1 (-1: unbounded), got (" +
                 to_string(o.window_left) + ", " + to_string(o.window_right) + ")");
  }
  const float scale = o.softmax_scale.value_or(
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(p->head_dim))));
  FLASHCTE_RETURN_IF_ERROR(read_scalars("softmax_scale", scale, o.softcap, o.num_threads, p));
  if (o.alibi_slopes.present()) FLASHCTE_RETURN_IF_ERROR(check_alibi(o.alibi_slopes, p, alibi));
  if (o.sinks.present()) {
    FLASHCTE_RETURN_IF_ERROR(read_sinks(kFlashAttentionLayout, "sinks", o.sinks, p, e));
  }
  request->window_left = o.window_left;
  request->window_right = o.causal ? 0 : o.window_right;
  return Status::Ok();
}
template Status read_call_options(const KvCacheOptions&, Extent*, DecodeExtents*, KvCacheRequest*);
template Status read_call_options(const VarlenKvCacheOptions&, Extent*, DecodeExtents*,
                                  KvCacheRequest*);

Status place_rows(const char* table_name, const TensorView& table, int64_t cache_rows,
                  int64_t row_slots, int64_t pages_per_sequence,
                  const std::vector<int64_t>& seqlens, const std::vector<int64_t>& leftpad,
                  KvCacheRequest* request) {
  DecodeProblem* p = &request->decode;
  const int64_t left = request->window_left, right = request->window_right;
  const int64_t new_tokens = request->append.tokens;
  const auto rows = static_cast<size_t>(request->row_index(p->batch, 0));
  p->slots.resize(rows);
  p->diagonal.resize(rows);
  std::vector<SlotRange> read(static_cast<size_t>(p->batch)), written(read.size());
  for (int64_t b = 0; b < p->batch; ++b) {
    const int64_t seqlen_k = seqlens[b] + new_tokens, tokens = request->rows(b);
    SlotRange& r = read[b];
    r = {seqlen_k, 0};
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t diagonal = seqlen_k - tokens + i;
      const int64_t hi = right < 0 ? seqlen_k : std::min(seqlen_k, diagonal + right + 1);
      const int64_t lo = left < 0 ? leftpad[b] : std::max(leftpad[b], diagonal - left);
      const int64_t row = request->row_index(b, i);
      p->slots[row] = lo < hi ? SlotRange{lo, hi} : SlotRange{0, 0};
      p->diagonal[row] = diagonal;
      if (lo < hi) r = {std::min(r.lo, lo), std::max(r.hi, hi)};
    }
    written[b] = {seqlens[b], seqlen_k};
    if (tokens > kDecodeMaxQueries && seqlen_k > 0) r = {0, seqlen_k};  // whole tiles
  }
  if (table_name == nullptr) return Status::Ok();
  return read_pages(table_name, table, request->paged, cache_rows, row_slots, pages_per_sequence,
                    read, written, p);
}

Status validate_kvcache(const TensorView& q, const MutableTensorView& k_cache,
                        const MutableTensorView& v_cache, const MutableTensorView& out,
                        const MutableTensorView& lse, const KvCacheOptions& o,
                        KvCacheRequest* request) {
  *request = KvCacheRequest{};
  DecodeProblem* p = &request->decode;
  KvAppend* a = &request->append;
  const DecodeLayout& layout = kFlashAttentionLayout;
  Shape s;
  Extents e;
  const bool paged = o.block_table.present();
  request->paged = paged;
  FLASHCTE_RETURN_IF_ERROR(
      read_q_and_caches(layout, q, as_input(k_cache), as_input(v_cache), paged, p, &e.shared));
  s.paged = paged;
  s.cache_rows = k_cache.shape[0];
  s.row_slots = k_cache.shape[1];
  FLASHCTE_RETURN_IF_ERROR(check_new_kv(o, *p, a, &e));
  FLASHCTE_RETURN_IF_ERROR(check_rotary(o, *p, a, &e));
  bool k_per_token = false, v_per_token = false;
  FLASHCTE_RETURN_IF_ERROR(read_cache_scales(layout, as_input(o.k_scale), as_input(o.v_scale),
                                             as_input(k_cache), as_input(v_cache), p, &k_per_token,
                                             &v_per_token, &e.shared));
  e.k_scale_written = k_per_token && a->tokens > 0;
  e.v_scale_written = v_per_token && a->tokens > 0;
  if (e.k_scale_written) FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("k_scale", o.k_scale));
  if (e.v_scale_written) FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("v_scale", o.v_scale));

  // Where sequence b's cache is: its pages, or its cache row.
  if (paged) {
    if (o.cache_batch_idx.present()) {
      return error(
          "cache_batch_idx: a paged cache picks each sequence's pages by block_table; "
          "cache_batch_idx applies to dense caches only");
    }
    const TensorView& t = o.block_table;
    FLASHCTE_RETURN_IF_ERROR(
        check_block_table(t, p->batch, "q's batch", s.row_slots, &s.capacity, &e.table));
    s.pages_per_sequence = t.shape[1];
  } else {
    s.capacity = s.row_slots;
    if (o.cache_batch_idx.present()) {
      std::vector<int64_t> ignored;
      FLASHCTE_RETURN_IF_ERROR(read_int32_vector("cache_batch_idx", o.cache_batch_idx, "(batch,)",
                                                 p->batch, "q's batch", &ignored, &e.batch_idx));
    } else if (s.cache_rows != p->batch) {
      return error("k_cache: batch_cache = " + to_string(s.cache_rows) +
                   " must be q's batch = " + to_string(p->batch) + " without cache_batch_idx");
    }
  }
  p->max_len = s.capacity;

  // The lengths: cached tokens, left padding, the new tokens' slots.
  std::vector<int64_t> seqlens(static_cast<size_t>(p->batch), s.capacity), leftpad(seqlens.size());
  if (o.cache_seqlens.present()) {
    FLASHCTE_RETURN_IF_ERROR(read_int32_vector("cache_seqlens", o.cache_seqlens, "(batch,)",
                                               p->batch, "q's batch", &seqlens, &e.seqlens));
  } else if (a->tokens > 0) {
    return error(
        "cache_seqlens: is required to append k and v (where each sequence's new tokens "
        "go)");
  }
  if (o.cache_leftpad.present()) {
    FLASHCTE_RETURN_IF_ERROR(read_int32_vector("cache_leftpad", o.cache_leftpad, "(batch,)",
                                               p->batch, "q's batch", &leftpad, &e.leftpad));
  }
  for (int64_t b = 0; b < p->batch; ++b) {
    if (seqlens[b] < 0 || seqlens[b] + a->tokens > s.capacity) {
      return error("cache_seqlens: [" + to_string(b) + "] = " + to_string(seqlens[b]) +
                   (a->tokens > 0 ? " plus seqlen_new = " + to_string(a->tokens) : "") +
                   " must be in [0, " + to_string(s.capacity) + "], the slots of a sequence's " +
                   (s.paged ? "pages: block_table's row (max_blocks_per_seq x page_block_size)"
                            : "cache row"));
    }
    if (leftpad[b] < 0 || leftpad[b] > seqlens[b]) {
      return error("cache_leftpad: [" + to_string(b) + "] = " + to_string(leftpad[b]) +
                   " must be in [0, cache_seqlens[" + to_string(b) +
                   "] = " + to_string(seqlens[b]) + "]");
    }
  }
  a->start = seqlens;
  if (a->rotary_dim > 0) {
    const int64_t rows = a->cos.shape[0];
    for (int64_t b = 0; b < p->batch; ++b) {
      const int64_t last = seqlens[b] + std::max(a->tokens, a->q_per_token ? p->tokens : 1) - 1;
      if (last >= rows) {
        return error("rotary_cos: has " + to_string(rows) + " positions; sequence " + to_string(b) +
                     " needs position " + to_string(last));
      }
    }
  }

  FLASHCTE_RETURN_IF_ERROR(read_call_options(o, &e.alibi, &e.shared, request));
  if (o.cache_leftpad.present()) request->leftpad = leftpad;
  // Dense caches without cache_batch_idx: sequence b's row is b, no table to read.
  const char* table = paged                         ? "block_table"
                      : o.cache_batch_idx.present() ? "cache_batch_idx"
                                                    : nullptr;
  FLASHCTE_RETURN_IF_ERROR(place_rows(table, paged ? o.block_table : o.cache_batch_idx,
                                      s.cache_rows, s.row_slots, s.pages_per_sequence, seqlens,
                                      leftpad, request));

  // After the pages: a per-token scale reads (and the append writes) the cache's pages.
  attach_token_scales(layout, k_per_token, as_input(o.k_scale), v_per_token, as_input(o.v_scale),
                      p);
  FLASHCTE_RETURN_IF_ERROR(read_outputs(layout, out, lse, p, &e.shared));
  return check_aliasing(e, a->tokens > 0);
}

}  // namespace flashcte::internal
