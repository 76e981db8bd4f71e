// flash_attn_varlen_kvcache's validation (kvcache.h): its own arguments (the offsets of the
// query rows, the lengths, q's and the outputs' shapes), then its whole batch read as one request
// by the readers flash_attn_with_kvcache's validator uses (kvcache_args.h), sequence b's query
// rows being rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q. Messages: "<argument>: <rule>".
#include <string>
#include <tuple>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/dispatch/decode_args.h"
#include "src/dispatch/kvcache.h"
#include "src/dispatch/kvcache_args.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

using std::to_string;

Status error(const std::string& message) { return Status::Error(message); }

// The call's sizes and the per-sequence offsets and lengths it was given.
struct Varlen {
  int64_t batch = 0, total_q = 0, heads = 0;
  std::vector<int64_t> starts;   // cu_seqlens_q
  std::vector<int64_t> seqused;  // seqused_k
  int64_t capacity = 0;          // slots per sequence
  int64_t pages_per_sequence = 1;
};

// What is the varlen call's own: q's and the outputs' shapes, the offsets and lengths, the
// table's shape, and that the outputs touch nothing read.
Status check_call(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                  const MutableTensorView& out, const MutableTensorView& lse,
                  const VarlenKvCacheOptions& o, Varlen* c) {
  if (!q.present()) return error("q: is required");
  Extent eq, ek, ev, eout, e_lse, ecu, eused, etable, ealibi, esinks, ekscale, evscale;
  FLASHCTE_RETURN_IF_ERROR(check_tensor("q", q, 3, "(total_q, heads, d)", &eq));
  c->total_q = q.shape[0];
  c->heads = q.shape[1];
  FLASHCTE_RETURN_IF_ERROR(
      read_int32_vector("cu_seqlens_q", o.cu_seqlens_q, "(batch + 1,)", -1, "", &c->starts, &ecu));
  if (c->starts.empty()) return error("cu_seqlens_q: must have batch + 1 >= 1 entries, got 0");
  c->batch = static_cast<int64_t>(c->starts.size()) - 1;
  if (c->starts[0] != 0) {
    return error("cu_seqlens_q: [0] = " + to_string(c->starts[0]) + " must be 0");
  }
  for (int64_t b = 0; b < c->batch; ++b) {
    if (c->starts[b + 1] < c->starts[b]) {
      return error("cu_seqlens_q: must be non-decreasing; [" + to_string(b + 1) +
                   "] = " + to_string(c->starts[b + 1]) + " < [" + to_string(b) +
                   "] = " + to_string(c->starts[b]));
    }
  }
  if (c->starts.back() != c->total_q) {
    return error("cu_seqlens_q: last entry " + to_string(c->starts.back()) +
                 " must be q's total_q = " + to_string(c->total_q));
  }
  FLASHCTE_RETURN_IF_ERROR(read_int32_vector("seqused_k", o.seqused_k, "(batch,)", c->batch,
                                             "the batch", &c->seqused, &eused));
  if (!k_cache.present()) return error("k_cache: is required");
  if (!v_cache.present()) return error("v_cache: is required");
  const bool paged = o.block_table.present();
  FLASHCTE_RETURN_IF_ERROR(check_tensor(
      "k_cache", k_cache, 4,
      paged ? "(num_blocks, page_block_size, kv_heads, d)" : "(batch, seqlen_cache, kv_heads, d)",
      &ek));
  FLASHCTE_RETURN_IF_ERROR(check_tensor(
      "v_cache", v_cache, 4,
      paged ? "(num_blocks, page_block_size, kv_heads, dv)" : "(batch, seqlen_cache, kv_heads, dv)",
      &ev));
  const int64_t page_slots = k_cache.shape[1];
  if (paged && page_slots < 1) {
    return error("k_cache: page_block_size (axis 1 of a paged cache) is 0; a page holds >= 1 slot");
  }
  int64_t& capacity = c->capacity;
  capacity = page_slots;
  if (paged) {
    FLASHCTE_RETURN_IF_ERROR(
        check_block_table(o.block_table, c->batch, "the batch", page_slots, &capacity, &etable));
    c->pages_per_sequence = o.block_table.shape[1];
  } else {
    FLASHCTE_RETURN_IF_ERROR(expect_axis("k_cache", k_cache, 0, c->batch, "the batch"));
  }
  for (int64_t b = 0; b < c->batch; ++b) {
    const int64_t used = c->seqused[b];
    if (used < 0 || used > capacity) {
      return error("seqused_k: [" + to_string(b) + "] = " + to_string(used) + " must be in [0, " +
                   to_string(capacity) + "], the slots of a sequence's " +
                   (paged ? "pages: block_table's row (max_blocks_per_seq x page_block_size)"
                          : "cache row"));
    }
  }
  if (o.sinks.present()) {
    FLASHCTE_RETURN_IF_ERROR(check_view("sinks", o.sinks, false, &esinks));
  }
  if (o.alibi_slopes.present()) {
    FLASHCTE_RETURN_IF_ERROR(check_view("alibi_slopes", o.alibi_slopes, false, &ealibi));
  }
  if (!out.present()) return error("out: is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor("out", out, 3, "(total_q, heads, dv)", &eout));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 0, c->total_q, "q's total_q"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 1, c->heads, "q's heads"));
  if (lse.present()) {
    FLASHCTE_RETURN_IF_ERROR(check_tensor("lse", lse, 2, "(heads, total_q)", &e_lse));
    FLASHCTE_RETURN_IF_ERROR(expect_float32("lse", lse.dtype));
    FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 0, c->heads, "q's heads"));
    FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 1, c->total_q, "q's total_q"));
  }
  for (const auto& [name, view, extent] :
       {std::tuple<const char*, const TensorView&, Extent*>{"k_scale", o.k_scale, &ekscale},
        {"v_scale", o.v_scale, &evscale}}) {
    if (view.present()) FLASHCTE_RETURN_IF_ERROR(check_view(name, view, false, extent));
  }
  return check_disjoint({{"out", eout}, {"lse", e_lse}}, {{"q", eq},
                                                          {"k_cache", ek},
                                                          {"v_cache", ev},
                                                          {"cu_seqlens_q", ecu},
                                                          {"seqused_k", eused},
                                                          {"block_table", etable},
                                                          {"alibi_slopes", ealibi},
                                                          {"sinks", esinks},
                                                          {"k_scale", ekscale},
                                                          {"v_scale", evscale}});
}

// A (total, ...) view as a batch of one, (1, total, ...): the readers' form of q, out and lse,
// whose rows the request then partitions into sequences.
template <class View>
View one_batch(const View& v) {
  View r = v;
  r.rank = v.rank + 1;
  r.shape[0] = 1;
  r.strides[0] = 0;
  for (int i = 0; i < v.rank; ++i) {
    r.shape[i + 1] = v.shape[i];
    r.strides[i + 1] = v.strides[i];
  }
  return r;
}

}  // namespace

Status validate_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                               const TensorView& v_cache, const MutableTensorView& out,
                               const MutableTensorView& lse, const VarlenKvCacheOptions& o,
                               KvCacheRequest* request) {
  *request = KvCacheRequest{};
  Varlen c;
  FLASHCTE_RETURN_IF_ERROR(check_call(q, k_cache, v_cache, out, lse, o, &c));
  DecodeProblem* p = &request->decode;
  const DecodeLayout& layout = kFlashAttentionLayout;
  const bool paged = o.block_table.present();
  request->paged = paged;
  DecodeExtents e;
  Extent alibi;
  FLASHCTE_RETURN_IF_ERROR(read_q_and_caches(layout, one_batch(q), k_cache, v_cache, paged, p, &e));
  FLASHCTE_RETURN_IF_ERROR(read_outputs(
      layout, one_batch(out), lse.present() ? one_batch(lse) : MutableTensorView{}, p, &e));
  // The rows as the sequences' (row_start), one after another on the token axis.
  p->batch = c.batch;
  p->tokens = 0;
  p->q_strides[0] = p->out_strides[0] = p->lse_strides[0] = 0;
  request->row_start = c.starts;
  bool k_per_token = false, v_per_token = false;
  FLASHCTE_RETURN_IF_ERROR(read_cache_scales(layout, o.k_scale, o.v_scale, k_cache, v_cache, p,
                                             &k_per_token, &v_per_token, &e));
  p->max_len = c.capacity;
  request->append.start = c.seqused;
  FLASHCTE_RETURN_IF_ERROR(read_call_options(o, &alibi, &e, request));
  const std::vector<int64_t> leftpad(c.seqused.size(), 0);
  FLASHCTE_RETURN_IF_ERROR(place_rows(paged ? "block_table" : nullptr, o.block_table,
                                      k_cache.shape[0], k_cache.shape[1], c.pages_per_sequence,
                                      c.seqused, leftpad, request));
  attach_token_scales(layout, k_per_token, o.k_scale, v_per_token, o.v_scale, p);
  return check_scales_apart(e, false);
}

}  // namespace flashcte::internal
