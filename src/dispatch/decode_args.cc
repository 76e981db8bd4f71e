// The decode entry points' shared readers (decode_args.h).
#include "src/dispatch/decode_args.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <utility>

namespace flashcte::internal {
namespace {

using std::to_string;

Status error(const std::string& message) { return Status::Error(message); }

// A view's four strides in the kernel's (batch, head, token or slot, channel) order.
std::array<int64_t, 4> kernel_order(const DecodeLayout& layout, const int64_t* strides) {
  return {strides[0], strides[layout.heads_axis], strides[layout.tokens_axis()], strides[3]};
}

Status expect_head_dim(const char* what, int64_t dim) {
  if (dim >= 1 && dim <= kMaxHeadDim) return Status::Ok();
  return error(std::string(what) + " = " + to_string(dim) + " must be in [1, " +
               to_string(kMaxHeadDim) + "]");
}

}  // namespace

Status read_q_and_caches(const DecodeLayout& layout, const TensorView& q, const TensorView& k,
                         const TensorView& v, bool paged, DecodeProblem* p, DecodeExtents* e) {
  if (!q.present()) return error("q: is required");
  if (!k.present()) return error("k_cache: is required");
  if (!v.present()) return error("v_cache: is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor("q", q, 4, layout.q, &e->q));
  FLASHCTE_RETURN_IF_ERROR(
      check_tensor("k_cache", k, 4, paged ? layout.k_paged : layout.k_dense, &e->k_cache));
  FLASHCTE_RETURN_IF_ERROR(
      check_tensor("v_cache", v, 4, paged ? layout.v_paged : layout.v_dense, &e->v_cache));
  FLASHCTE_RETURN_IF_ERROR(expect_attention_dtype("q", q.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("k_cache", k.dtype, q.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("v_cache", v.dtype, q.dtype));
  const int heads = layout.heads_axis, slots = layout.tokens_axis();
  p->dtype = q.dtype;
  p->batch = q.shape[0];
  p->q_heads = q.shape[heads];
  p->tokens = q.shape[slots];
  p->head_dim = q.shape[3];
  p->kv_heads = k.shape[heads];
  p->max_len = k.shape[slots];
  p->value_dim = v.shape[3];
  FLASHCTE_RETURN_IF_ERROR(expect_head_dim("q: head dim d", p->head_dim));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("k_cache", k, 3, p->head_dim, "q's head dim d"));
  if (!paged && layout.cache_rows_are_batch) {
    FLASHCTE_RETURN_IF_ERROR(expect_axis("k_cache", k, 0, p->batch, "q's batch"));
  }
  FLASHCTE_RETURN_IF_ERROR(
      expect_axis("v_cache", v, 0, k.shape[0], paged ? "k_cache's num_blocks" : layout.k_rows));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, slots, p->max_len,
                                       paged ? layout.k_slots_paged : layout.k_slots_dense));
  if (paged && p->max_len < 1) {
    return error(std::string("k_cache: ") + layout.page_slots + " (axis " + to_string(slots) +
                 " of a paged cache) is 0; a page holds >= 1 slot");
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, heads, p->kv_heads, "k_cache's kv_heads"));
  FLASHCTE_RETURN_IF_ERROR(expect_head_dim("v_cache: value head dim dv", p->value_dim));
  if (p->kv_heads == 0 ? p->q_heads != 0 : p->q_heads % p->kv_heads != 0) {
    return error(std::string("q: ") + layout.heads + " = " + to_string(p->q_heads) +
                 " must be a multiple of k_cache's kv_heads = " + to_string(p->kv_heads) +
                 " (grouped-query attention)");
  }
  p->group = p->kv_heads > 0 ? p->q_heads / p->kv_heads : 1;
  p->q = q.data;
  p->q_strides = kernel_order(layout, q.strides.data());
  for (auto [src, view] : {std::pair{&p->k, &k}, std::pair{&p->v, &v}}) {
    src->data = view->data;
    src->dtype = view->dtype;
    src->strides = kernel_order(layout, view->strides.data());
  }
  return Status::Ok();
}

Status read_cache_scales(const DecodeLayout& layout, const TensorView& k_scale,
                         const TensorView& v_scale, const TensorView& k_cache,
                         const TensorView& v_cache, DecodeProblem* p, bool* k_per_token,
                         bool* v_per_token, DecodeExtents* e) {
  FLASHCTE_RETURN_IF_ERROR(check_cache_scale("k_scale", k_scale, "k_cache", k_cache,
                                             layout.heads_axis, &p->k_scale, k_per_token,
                                             &e->k_scale));
  return check_cache_scale("v_scale", v_scale, "v_cache", v_cache, layout.heads_axis, &p->v_scale,
                           v_per_token, &e->v_scale);
}

Status read_pages(const char* name, const TensorView& t, bool paged, int64_t cache_rows,
                  int64_t page_slots, int64_t pages_per_sequence,
                  const std::vector<SlotRange>& read, const std::vector<SlotRange>& written,
                  DecodeProblem* p) {
  const auto batch = static_cast<int64_t>(read.size());
  std::vector<int32_t> table(static_cast<size_t>(batch * pages_per_sequence), -1);
  // page -> entries that name it, counted only when the call writes (for the check below): a
  // decode step's table of 8 x 256 pages went through the map in every layer's call otherwise.
  const bool writes =
      std::any_of(written.begin(), written.end(), [](const SlotRange& w) { return w.lo < w.hi; });
  std::map<int32_t, int64_t> references;
  for (int64_t b = 0; b < batch; ++b) {
    const SlotRange spans[] = {read[b], written[b]};
    for (int64_t i = 0; i < pages_per_sequence; ++i) {
      const int64_t first = i * page_slots, last = first + page_slots;
      bool used = false;
      for (const SlotRange& s : spans) used |= s.lo < s.hi && s.lo < last && first < s.hi;
      if (!used) continue;
      const int32_t page = static_cast<const int32_t*>(
          t.data)[paged ? b * t.strides[0] + i * t.strides[1] : b * t.strides[0]];
      if (page < 0 || page >= cache_rows) {
        return error(std::string(name) + ": [" + to_string(b) + (paged ? ", " + to_string(i) : "") +
                     "] = " + to_string(page) + " must be in [0, " +
                     (paged ? "num_blocks" : "batch_cache") + " = " + to_string(cache_rows) + ")");
      }
      table[static_cast<size_t>(b * pages_per_sequence + i)] = page;
      if (writes) ++references[page];
    }
  }
  for (int64_t b = 0; b < batch; ++b) {
    const SlotRange& w = written[b];
    if (w.lo >= w.hi) continue;
    for (int64_t i = w.lo / page_slots; i <= (w.hi - 1) / page_slots; ++i) {
      const int32_t page = table[static_cast<size_t>(b * pages_per_sequence + i)];
      if (references[page] > 1) {
        return error(std::string(name) + ": " + (paged ? "page " : "cache row ") + to_string(page) +
                     " receives sequence " + to_string(b) +
                     "'s new k and v and is also named by another entry the call uses; a page "
                     "written by the call must belong to one sequence");
      }
    }
  }
  for (KvSource* src : {&p->k, &p->v}) {
    src->block_size = page_slots;
    src->pages_per_sequence = pages_per_sequence;
    src->table = table;
  }
  return Status::Ok();
}

void attach_token_scales(const DecodeLayout& layout, bool k_per_token, const TensorView& k_scale,
                         bool v_per_token, const TensorView& v_scale, DecodeProblem* p) {
  // (batch or page, kv_heads, slot) or (batch or page, slot, kv_heads), as the cache.
  for (auto [per_token, t, source, cache] :
       {std::tuple{k_per_token, &k_scale, &p->k_token_scale, &p->k},
        std::tuple{v_per_token, &v_scale, &p->v_token_scale, &p->v}}) {
    if (per_token) {
      *source = token_scale_source(*cache, t->data, t->strides[0], t->strides[layout.heads_axis],
                                   t->strides[layout.tokens_axis()]);
    }
  }
}

Status read_sinks(const DecodeLayout& layout, const char* name, const TensorView& t,
                  DecodeProblem* p, DecodeExtents* e) {
  if (layout.sink_column) {
    BatchVector sink;
    FLASHCTE_RETURN_IF_ERROR(
        read_batch_vector(name, t, p->q_heads, layout.sink, layout.heads, &sink, &e->sink));
    p->sink = sink.data;
    p->sink_stride = sink.stride;
  } else {
    FLASHCTE_RETURN_IF_ERROR(check_tensor(name, t, 1, layout.sink, &e->sink));
    FLASHCTE_RETURN_IF_ERROR(expect_float32(name, t.dtype));
    FLASHCTE_RETURN_IF_ERROR(expect_axis(name, t, 0, p->q_heads, layout.q_heads));
    p->sink = static_cast<const float*>(t.data);
    p->sink_stride = t.strides[0];
  }
  return check_sink_values(name, p->sink, p->sink_stride, p->q_heads);
}

Status read_scalars(const char* scale_name, float scale, float softcap, int num_threads,
                    DecodeProblem* p) {
  if (!std::isfinite(scale)) {
    return error(std::string(scale_name) + ": must be finite, got " + to_string(scale));
  }
  if (!(softcap >= 0.0f) || std::isinf(softcap)) {
    return error("softcap: must be finite and >= 0 (0 disables it), got " + to_string(softcap));
  }
  if (num_threads < 0) {
    return error("num_threads: must be >= 0 (0 = OpenMP default), got " + to_string(num_threads));
  }
  p->scale = scale;
  p->softcap = softcap;
  p->threads = num_threads;
  return Status::Ok();
}

Status read_outputs(const DecodeLayout& layout, const MutableTensorView& out,
                    const MutableTensorView& lse, DecodeProblem* p, DecodeExtents* e) {
  if (!out.present()) return error("out: is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor("out", out, 4, layout.out, &e->out));
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("out", out.dtype, p->dtype, "q"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 0, p->batch, "q's batch"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, layout.heads_axis, p->q_heads, layout.q_heads));
  FLASHCTE_RETURN_IF_ERROR(
      expect_axis("out", out, layout.tokens_axis(), p->tokens, layout.q_tokens));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 3, p->value_dim, "v_cache's dv"));
  FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("out", out));
  p->out = out.data;
  p->out_strides = kernel_order(layout, out.strides.data());
  if (!lse.present()) return Status::Ok();
  FLASHCTE_RETURN_IF_ERROR(check_tensor("lse", lse, 3, layout.lse, &e->lse));
  FLASHCTE_RETURN_IF_ERROR(expect_float32("lse", lse.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 0, p->batch, "q's batch"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 1, p->q_heads, layout.q_heads));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 2, p->tokens, layout.q_tokens));
  FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("lse", lse));
  p->lse = static_cast<float*>(lse.data);
  p->lse_strides = {lse.strides[0], lse.strides[1], lse.strides[2]};
  return Status::Ok();
}

}  // namespace flashcte::internal
