// flash_attn_varlen_kvcache (include/flashcte/kvcache.h): a mixed batch of variable-length query
// chunks over each sequence's cache. The call is checked as a whole (the varlen offsets, the
// lengths against the cache, the table's shape, the outputs against everything read), and by
// flash_attn_with_kvcache's validator as the whole batch's call of no query row (so that its
// rules bind sequences without rows too); then each sequence with rows becomes the
// flash_attn_with_kvcache call of batch 1 it is, validated by that validator, and its problem goes
// to the kernel its length calls for: the decode kernel for a few queries, attention_cte for a
// longer chunk. Every kernel's work runs in one parallel region (src/schedule/region.h), split by
// estimated cost. plan_varlen_kvcache (varlen_plan_api.cc) keeps those problems, the step.
#include <algorithm>
#include <cmath>
#include <exception>
#include <new>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/kvcache.h"
#include "src/dispatch/varlen.h"
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
};

// Checks what no per-sequence call can see: q's and the outputs' shapes, the offsets and lengths,
// the table's shape (each sequence's call checks the pages its rows see), the sinks, and that the
// outputs touch nothing read.
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
  int64_t capacity = page_slots;
  if (paged) {
    FLASHCTE_RETURN_IF_ERROR(
        check_block_table(o.block_table, c->batch, "the batch", page_slots, &capacity, &etable));
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
    // (batch, heads) is read row by row; the rest of the shape rule is each sequence's call's.
    if (o.alibi_slopes.rank == 2) {
      FLASHCTE_RETURN_IF_ERROR(
          expect_axis("alibi_slopes", o.alibi_slopes, 0, c->batch, "the batch"));
    }
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
  // The per-sequence calls check their own rows; across sequences only this sees the whole.
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

// Rows [first, first + rows) of a (total, ...) view as a view of batch 1 with one more axis,
// (1, rows, ...); a stride-`axis` view keeps that axis' stride.
template <class View>
View rows_of(const View& v, int axis, int64_t first, int64_t rows) {
  View r = v;
  r.rank = v.rank + 1;
  auto* base =
      static_cast<const unsigned char*>(v.data) + first * v.strides[axis] * dtype_size(v.dtype);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): MutableTensorView's data is writable
  r.data = const_cast<unsigned char*>(base);
  r.shape[0] = 1;
  r.strides[0] = 0;
  for (int i = 0; i < v.rank; ++i) {
    r.shape[i + 1] = i == axis ? rows : v.shape[i];
    r.strides[i + 1] = v.strides[i];
  }
  return r;
}

// A (total, ...) view as a batch of `batch` entries of no row, (batch, 0, ...): what a call of
// no query row reads and writes.
template <class View>
View no_rows(const View& v, int axis, int64_t batch) {
  View r = rows_of(v, axis, 0, 0);
  r.shape[0] = batch;
  return r;
}

// Entry b of a batch-leading view, as a view of batch 1 (same rank).
template <class View>
View entry(const View& v, int64_t b) {
  View r = v;
  auto* base = static_cast<const unsigned char*>(v.data) + b * v.strides[0] * dtype_size(v.dtype);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): MutableTensorView's data is writable
  r.data = const_cast<unsigned char*>(base);
  r.shape[0] = 1;
  return r;
}

MutableTensorView writable(const TensorView& v) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the call appends nothing, so the
  // cache is only read through it
  return {const_cast<void*>(v.data), v.dtype, v.rank, v.shape, v.strides};
}

}  // namespace

// Checks the whole call and fills the step.
Status plan_step(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                 const MutableTensorView& out, const MutableTensorView& lse,
                 const VarlenKvCacheOptions& options, Step* step) {
  Varlen c;
  FLASHCTE_RETURN_IF_ERROR(check_call(q, k_cache, v_cache, out, lse, options, &c));
  const bool paged = options.block_table.present();
  KvCacheOptions o;
  o.softmax_scale = options.softmax_scale;
  o.causal = options.causal;
  o.window_left = options.window_left;
  o.window_right = options.window_right;
  o.softcap = options.softcap;
  o.num_threads = options.num_threads;
  // The rules of every sequence's call (dtypes, heads, head dims, the scale, softcap, sinks,
  // ALiBi, the 8-bit scales, out's dtype and dv) bind a sequence without query rows, and a
  // batch of none, too: then they are checked once as the whole batch's call of no row. When
  // every sequence has rows, their own calls check them all (and the mixed call's overhead
  // stays what it was: the extra pass cost ~2 us of ~97 for 4 sequences, AMD EPYC Zen 4).
  const bool row_less =
      c.batch == 0 || std::adjacent_find(c.starts.begin(), c.starts.end()) != c.starts.end();
  if (row_less) {
    KvCacheOptions whole = o;
    whole.cache_seqlens = options.seqused_k;
    whole.block_table = options.block_table;
    whole.k_scale = writable(options.k_scale);
    whole.v_scale = writable(options.v_scale);
    whole.alibi_slopes = options.alibi_slopes;
    whole.sinks = options.sinks;
    KvCacheRequest request;
    FLASHCTE_RETURN_IF_ERROR(validate_kvcache(
        no_rows(q, 0, c.batch), writable(k_cache), writable(v_cache), no_rows(out, 0, c.batch),
        lse.present() ? no_rows(lse, 1, c.batch) : MutableTensorView{}, whole, &request));
  }
  step->decodes.reserve(static_cast<size_t>(c.batch));
  step->prefills.reserve(static_cast<size_t>(c.batch));
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t first = c.starts[b], rows = c.starts[b + 1] - first;
    if (rows == 0) continue;
    const MutableTensorView k_b = writable(paged ? k_cache : entry(k_cache, b));
    const MutableTensorView v_b = writable(paged ? v_cache : entry(v_cache, b));
    o.cache_seqlens = entry(options.seqused_k, b);
    if (paged) o.block_table = entry(options.block_table, b);
    // An 8-bit cache's scales: one per cache or KV head as they are, one per token as the
    // cache (row b when dense).
    for (auto [scale, given] :
         {std::pair{&o.k_scale, &options.k_scale}, std::pair{&o.v_scale, &options.v_scale}}) {
      *scale = writable(given->rank == 3 && !paged ? entry(*given, b) : *given);
    }
    o.sinks = options.sinks;
    o.alibi_slopes = options.alibi_slopes;
    if (o.alibi_slopes.present() && o.alibi_slopes.rank == 2) {
      o.alibi_slopes = entry(options.alibi_slopes, b);  // (batch, heads): row b
    }
    MutableTensorView lse_b;
    if (lse.present()) lse_b = rows_of(lse, 1, first, rows);
    KvCacheRequest request;
    Status s = validate_kvcache(rows_of(q, 0, first, rows), k_b, v_b, rows_of(out, 0, first, rows),
                                lse_b, o, &request);
    if (!s.ok) return s.with_suffix(" (sequence " + std::to_string(b) + ")");
    route(std::move(request), step);
  }
  return Status::Ok();
}

}  // namespace flashcte::internal

namespace flashcte {

Status flash_attn_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                                 const TensorView& v_cache, const MutableTensorView& out,
                                 const MutableTensorView& lse,
                                 const VarlenKvCacheOptions& options) {
  return internal::guarded("the call's scratch", [&]() -> Status {
    internal::Step step;
    FLASHCTE_RETURN_IF_ERROR(internal::plan_step(q, k_cache, v_cache, out, lse, options, &step));
    internal::run_step(step, options.num_threads, options.profile);
    return Status::Ok();
  });
}

}  // namespace flashcte
