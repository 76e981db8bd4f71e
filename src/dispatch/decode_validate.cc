// decode_attention's argument validation (decode_validate.h). The messages follow validate.cc:
// "<argument>: <rule it broke>", naming the expected shape's axes.
#include "src/dispatch/decode_validate.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "src/dispatch/decode_args.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

using std::to_string;

Status error(const std::string& message) { return Status::Error(message); }

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

// The slots each sequence reads: the union of its rows' ranges (a paged cache's pages to check).
std::vector<SlotRange> read_spans(const DecodeProblem& p) {
  std::vector<SlotRange> spans(static_cast<size_t>(p.batch));
  for (int64_t b = 0; b < p.batch; ++b) {
    SlotRange& s = spans[b];
    s = {p.max_len, 0};
    for (int64_t i = 0; i < p.tokens; ++i) {
      const SlotRange r = p.row_slots(b, i);
      if (r.lo < r.hi) s = {std::min(s.lo, r.lo), std::max(s.hi, r.hi)};
    }
  }
  return spans;
}

}  // namespace

Status validate_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                       const TensorView& positions, const DecodeOutputs& outputs,
                       const DecodeOptions& o, DecodeProblem* p) {
  *p = DecodeProblem{};
  const DecodeLayout& layout = kDecodeAttentionLayout;
  DecodeExtents e;
  Extent positions_extent, table_extent;
  const bool paged = o.block_table.present();
  FLASHCTE_RETURN_IF_ERROR(read_q_and_caches(layout, q, k_cache, v_cache, paged, p, &e));
  if (paged) {  // sets the slot count, which the positions are checked against
    FLASHCTE_RETURN_IF_ERROR(check_block_table(o.block_table, p->batch, "q's batch",
                                               k_cache.shape[2], &p->max_len, &table_extent));
  }
  if (o.sink.present()) FLASHCTE_RETURN_IF_ERROR(read_sinks(layout, "sink", o.sink, p, &e));
  FLASHCTE_RETURN_IF_ERROR(read_scalars("scale", o.scale, o.softcap, o.num_threads, p));
  if (o.sliding_window < 0) {
    return error("sliding_window: must be >= 0 (0 disables it), got " +
                 to_string(o.sliding_window));
  }
  bool k_per_token = false, v_per_token = false;
  FLASHCTE_RETURN_IF_ERROR(read_cache_scales(layout, o.k_scale, o.v_scale, k_cache, v_cache, p,
                                             &k_per_token, &v_per_token, &e));
  FLASHCTE_RETURN_IF_ERROR(check_positions(positions, o.sliding_window, p, &positions_extent));
  if (paged) {
    FLASHCTE_RETURN_IF_ERROR(read_pages("block_table", o.block_table, true, k_cache.shape[0],
                                        k_cache.shape[2], o.block_table.shape[1], read_spans(*p),
                                        std::vector<SlotRange>(p->batch), p));
  }
  attach_token_scales(layout, k_per_token, o.k_scale, v_per_token, o.v_scale, p);
  FLASHCTE_RETURN_IF_ERROR(read_outputs(layout, outputs.out, outputs.lse, p, &e));
  // No output overlaps an input or the other output.
  return check_disjoint({{"out", e.out}, {"lse", e.lse}}, {{"q", e.q},
                                                           {"k_cache", e.k_cache},
                                                           {"v_cache", e.v_cache},
                                                           {"positions", positions_extent},
                                                           {"block_table", table_extent},
                                                           {"sink", e.sink},
                                                           {"k_scale", e.k_scale},
                                                           {"v_scale", e.v_scale}});
}

}  // namespace flashcte::internal
