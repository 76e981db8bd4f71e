// decode_attention's argument validation (decode_validate.h). The messages follow validate.cc:
// "<argument>: <rule it broke>", naming the expected shape's axes.
#include "src/dispatch/decode_validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

using std::to_string;

Status error(const std::string& message) { return Status::Error(message); }

struct Extents {
  Extent q, k, v, positions, block_table, sink, k_scale, v_scale, out, lse;
};

// q and the caches: ranks, dtypes, the shared sizes, GQA. A paged cache (`paged`: a block table
// was given) is (num_blocks, kv_heads, block_size, d) and its slot count is set by the table.
Status check_inputs(const TensorView& q, const TensorView& k, const TensorView& v, bool paged,
                    DecodeProblem* p, Extents* e) {
  if (!q.present()) return error("q: is required");
  if (!k.present()) return error("k_cache: is required");
  if (!v.present()) return error("v_cache: is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor("q", q, 4, "(batch, q_heads, T, d)", &e->q));
  FLASHCTE_RETURN_IF_ERROR(check_tensor(
      "k_cache", k, 4,
      paged ? "(num_blocks, kv_heads, block_size, d)" : "(batch, kv_heads, max_len, d)", &e->k));
  FLASHCTE_RETURN_IF_ERROR(check_tensor(
      "v_cache", v, 4,
      paged ? "(num_blocks, kv_heads, block_size, dv)" : "(batch, kv_heads, max_len, dv)", &e->v));
  FLASHCTE_RETURN_IF_ERROR(expect_attention_dtype("q", q.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("k_cache", k.dtype, q.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("v_cache", v.dtype, q.dtype));
  p->dtype = q.dtype;
  p->batch = q.shape[0];
  p->q_heads = q.shape[1];
  p->tokens = q.shape[2];
  p->head_dim = q.shape[3];
  p->kv_heads = k.shape[1];
  p->max_len = k.shape[2];
  p->value_dim = v.shape[3];
  if (p->head_dim < 1 || p->head_dim > kMaxHeadDim) {
    return error("q: head dim d = " + to_string(p->head_dim) + " must be in [1, " +
                 to_string(kMaxHeadDim) + "]");
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("k_cache", k, 3, p->head_dim, "q's head dim d"));
  if (paged) {
    FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, 0, k.shape[0], "k_cache's num_blocks"));
    FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, 2, k.shape[2], "k_cache's block_size"));
    if (k.shape[2] < 1) {
      return error("k_cache: block_size (axis 2 of a paged cache) is 0; a page holds >= 1 slot");
    }
  } else {
    FLASHCTE_RETURN_IF_ERROR(expect_axis("k_cache", k, 0, p->batch, "q's batch"));
    FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, 0, p->batch, "q's batch"));
    FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, 2, p->max_len, "k_cache's max_len"));
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("v_cache", v, 1, p->kv_heads, "k_cache's kv_heads"));
  if (p->value_dim < 1 || p->value_dim > kMaxHeadDim) {
    return error("v_cache: value head dim dv = " + to_string(p->value_dim) + " must be in [1, " +
                 to_string(kMaxHeadDim) + "]");
  }
  if (p->kv_heads == 0 ? p->q_heads != 0 : p->q_heads % p->kv_heads != 0) {
    return error("q: q_heads = " + to_string(p->q_heads) +
                 " must be a multiple of k_cache's kv_heads = " + to_string(p->kv_heads) +
                 " (grouped-query attention)");
  }
  p->group = p->kv_heads > 0 ? p->q_heads / p->kv_heads : 1;
  p->q = q.data;
  std::copy_n(q.strides.begin(), 4, p->q_strides.begin());
  for (auto [src, view] : {std::pair{&p->k, &k}, std::pair{&p->v, &v}}) {
    src->data = view->data;
    src->dtype = view->dtype;
    src->strides = view->strides;
  }
  return Status::Ok();
}

// block_table (batch, pages_per_sequence) int32: sets the paged caches' slot count, which the
// positions are then checked against.
Status check_block_table_shape(const TensorView& t, int64_t block_size, DecodeProblem* p,
                               Extent* extent) {
  FLASHCTE_RETURN_IF_ERROR(
      check_block_table(t, p->batch, "q's batch", block_size, &p->max_len, extent));
  for (KvSource* src : {&p->k, &p->v}) {
    src->block_size = block_size;
    src->pages_per_sequence = t.shape[1];
  }
  return Status::Ok();
}

// The pages the call reads, each sequence's from the first slot any of its tokens attends to the
// last: each must be a page of the caches, [0, num_blocks). Entries past them are never read and
// may hold anything (-1 as padding, say). The table is copied, so what was checked is what is read.
Status check_block_table_entries(const TensorView& t, int64_t num_blocks, DecodeProblem* p) {
  std::vector<int32_t> table(static_cast<size_t>(p->batch * p->k.pages_per_sequence), -1);
  const auto* data = static_cast<const int32_t*>(t.data);
  for (int64_t b = 0; b < p->batch; ++b) {
    int64_t lo = p->max_len, hi = 0;
    for (int64_t i = 0; i < p->tokens; ++i) {
      const SlotRange r = p->row_slots(b, i);
      if (r.lo >= r.hi) continue;
      lo = std::min(lo, r.lo);
      hi = std::max(hi, r.hi);
    }
    for (int64_t page = lo < hi ? lo / p->k.block_size : 0;
         lo < hi && page <= (hi - 1) / p->k.block_size; ++page) {
      const int32_t block = data[b * t.strides[0] + page * t.strides[1]];
      if (block < 0 || block >= num_blocks) {
        return error(
            "block_table: [" + to_string(b) + ", " + to_string(page) + "] = " + to_string(block) +
            " must be a page of the caches, in [0, num_blocks = " + to_string(num_blocks) + ")");
      }
      table[static_cast<size_t>(b * p->k.pages_per_sequence + page)] = block;
    }
  }
  p->k.table = table;
  p->v.table = std::move(table);
  return Status::Ok();
}

// positions (batch, T) int64, each a cache slot: token t of sequence b attends the slots up to
// its own, and with a sliding window only the `window` most recent of them.
Status check_positions(const TensorView& t, int64_t window, DecodeProblem* p, Extent* extent) {
  if (!t.present()) return error("positions: is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor("positions", t, 2, "(batch, T)", extent));
  if (t.dtype != DType::kInt64) {
    return Status::DtypeError(std::string("positions: dtype must be int64, got ") +
                              dtype_name(t.dtype));
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("positions", t, 0, p->batch, "q's batch"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("positions", t, 1, p->tokens, "q's new tokens T"));
  p->slots.resize(static_cast<size_t>(p->batch * p->tokens));
  const auto* data = static_cast<const int64_t*>(t.data);
  for (int64_t b = 0; b < p->batch; ++b) {
    for (int64_t i = 0; i < p->tokens; ++i) {
      const int64_t pos = data[b * t.strides[0] + i * t.strides[1]];
      if (pos < 0 || pos >= p->max_len) {
        return error("positions: [" + to_string(b) + ", " + to_string(i) + "] = " + to_string(pos) +
                     " must be a cache slot in [0, max_len = " + to_string(p->max_len) + ")");
      }
      p->slots[b * p->tokens + i] = {window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0,
                                     pos + 1};
    }
  }
  return Status::Ok();
}

// sink and the scalar options.
Status check_options(const DecodeOptions& o, DecodeProblem* p, Extent* sink_extent) {
  if (o.sink.present()) {
    BatchVector sink;
    FLASHCTE_RETURN_IF_ERROR(read_batch_vector(
        "sink", o.sink, p->q_heads, "(q_heads,) or (q_heads, 1)", "q_heads", &sink, sink_extent));
    p->sink = sink.data;
    p->sink_stride = sink.stride;
    FLASHCTE_RETURN_IF_ERROR(check_sink_values("sink", sink.data, sink.stride, p->q_heads));
  }

  if (!std::isfinite(o.scale)) return error("scale: must be finite, got " + to_string(o.scale));
  if (!(o.softcap >= 0.0f) || std::isinf(o.softcap)) {
    return error("softcap: must be finite and >= 0 (0 disables it), got " + to_string(o.softcap));
  }
  if (o.sliding_window < 0) {
    return error("sliding_window: must be >= 0 (0 disables it), got " +
                 to_string(o.sliding_window));
  }
  if (o.num_threads < 0) {
    return error("num_threads: must be >= 0 (0 = OpenMP default), got " + to_string(o.num_threads));
  }
  p->scale = o.scale;
  p->softcap = o.softcap;
  p->threads = o.num_threads;
  return Status::Ok();
}

// out (batch, q_heads, T, dv) in q's dtype, lse (batch, q_heads, T) float32.
Status check_outputs(const DecodeOutputs& outputs, DecodeProblem* p, Extents* e) {
  const MutableTensorView& out = outputs.out;
  if (!out.present()) return error("out: is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor("out", out, 4, "(batch, q_heads, T, dv)", &e->out));
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("out", out.dtype, p->dtype, "q"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 0, p->batch, "batch"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 1, p->q_heads, "q_heads"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 2, p->tokens, "T"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("out", out, 3, p->value_dim, "v_cache's dv"));
  FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("out", out));
  p->out = out.data;
  std::copy_n(out.strides.begin(), 4, p->out_strides.begin());
  const MutableTensorView& lse = outputs.lse;
  if (!lse.present()) return Status::Ok();
  FLASHCTE_RETURN_IF_ERROR(check_tensor("lse", lse, 3, "(batch, q_heads, T)", &e->lse));
  if (lse.dtype != DType::kFloat32) {
    return Status::DtypeError(std::string("lse: dtype must be float32, got ") +
                              dtype_name(lse.dtype));
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 0, p->batch, "batch"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 1, p->q_heads, "q_heads"));
  FLASHCTE_RETURN_IF_ERROR(expect_axis("lse", lse, 2, p->tokens, "T"));
  FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("lse", lse));
  p->lse = static_cast<float*>(lse.data);
  std::copy_n(lse.strides.begin(), 3, p->lse_strides.begin());
  return Status::Ok();
}

// No output overlaps an input or the other output.
Status check_aliasing(const Extents& e) {
  return check_disjoint({{"out", e.out}, {"lse", e.lse}}, {{"q", e.q},
                                                           {"k_cache", e.k},
                                                           {"v_cache", e.v},
                                                           {"positions", e.positions},
                                                           {"block_table", e.block_table},
                                                           {"sink", e.sink},
                                                           {"k_scale", e.k_scale},
                                                           {"v_scale", e.v_scale}});
}

}  // namespace

Status validate_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                       const TensorView& positions, const DecodeOutputs& outputs,
                       const DecodeOptions& options, DecodeProblem* problem) {
  *problem = DecodeProblem{};
  Extents e;
  const bool paged = options.block_table.present();
  FLASHCTE_RETURN_IF_ERROR(check_inputs(q, k_cache, v_cache, paged, problem, &e));
  if (paged) {
    FLASHCTE_RETURN_IF_ERROR(
        check_block_table_shape(options.block_table, k_cache.shape[2], problem, &e.block_table));
  }
  FLASHCTE_RETURN_IF_ERROR(check_options(options, problem, &e.sink));
  bool k_per_token = false, v_per_token = false;
  FLASHCTE_RETURN_IF_ERROR(check_cache_scale("k_scale", options.k_scale, "k_cache", k_cache, 1,
                                             &problem->k_scale, &k_per_token, &e.k_scale));
  FLASHCTE_RETURN_IF_ERROR(check_cache_scale("v_scale", options.v_scale, "v_cache", v_cache, 1,
                                             &problem->v_scale, &v_per_token, &e.v_scale));
  FLASHCTE_RETURN_IF_ERROR(
      check_positions(positions, options.sliding_window, problem, &e.positions));
  if (paged) {
    FLASHCTE_RETURN_IF_ERROR(
        check_block_table_entries(options.block_table, k_cache.shape[0], problem));
  }
  // After the block table: a per-token scale reads the cache's pages.
  // (batch or page, kv_heads, slot), as the cache.
  for (auto [per_token, t, source, cache] :
       {std::tuple{k_per_token, &options.k_scale, &problem->k_token_scale, &problem->k},
        std::tuple{v_per_token, &options.v_scale, &problem->v_token_scale, &problem->v}}) {
    if (per_token) {
      *source = token_scale_source(*cache, t->data, t->strides[0], t->strides[1], t->strides[2]);
    }
  }
  FLASHCTE_RETURN_IF_ERROR(check_outputs(outputs, problem, &e));
  return check_aliasing(e);
}

}  // namespace flashcte::internal
