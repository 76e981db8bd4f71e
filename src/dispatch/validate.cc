// Argument validation: every rule of SEMANTICS.md and of the API, checked once, each failure
// reported as "<argument>: <rule>". Nothing below this layer re-validates user input.
// validate() checks one argument group after another; within a group the checks run in a fixed
// order, so when several arguments are wrong the first one in that order is the one reported.
#include "src/dispatch/validate.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/core/kv8.h"
#include "src/dispatch/prefix_validate.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

// Tile parameters above these would need scratch beyond any cache and are surely a typo.
constexpr int64_t kMaxQBlock = 4096;
constexpr int64_t kMaxKvTile = 65536;
constexpr int64_t kMaxSection = 1 << 20;
// Positions stay below 2^60 in magnitude so that interval arithmetic never overflows.
constexpr int64_t kMaxPosition = int64_t{1} << 60;

// The bytes every view addresses (empty when it is absent), for the aliasing check.
struct ViewExtents {
  Extent q, k, v, sink, alibi_slopes, key_bias;  // inputs
  PrefixExtents prefix;                          // inputs: k_prior, v_prior and their scales
  Extent out, neg_max, sum_recip, lse;           // outputs
};

// q, k, v: presence, rank, dtype. Sets the compute dtype, q's.
Status check_qkv(const TensorView& q, const TensorView& k, const TensorView& v,
                 const Options& options, bool shapes_only, Problem* problem, ViewExtents* extents) {
  if (!q.present()) return Status::Error("q: is required");
  if (!k.present()) return Status::Error("k: is required");
  if (!v.present()) return Status::Error("v: is required");
  FLASHCTE_RETURN_IF_ERROR(check_view("q", q, shapes_only, &extents->q));
  FLASHCTE_RETURN_IF_ERROR(check_view("k", k, shapes_only, &extents->k));
  FLASHCTE_RETURN_IF_ERROR(check_view("v", v, shapes_only, &extents->v));
  FLASHCTE_RETURN_IF_ERROR(
      expect_rank("q", q.rank, 3, options.tp_q ? "(bs, Sq, d) with tp_q" : "(bs, d, Sq)"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_rank("k", k.rank, 3, options.tp_k ? "(bs_kv, Skv, d) with tp_k" : "(bs_kv, d, Skv)"));
  FLASHCTE_RETURN_IF_ERROR(expect_rank("v", v.rank, 3, "(bs_kv, Skv, dv)"));
  FLASHCTE_RETURN_IF_ERROR(expect_attention_dtype("q", q.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("k", k.dtype, q.dtype, "q"));
  FLASHCTE_RETURN_IF_ERROR(expect_same_dtype("v", v.dtype, q.dtype, "q"));
  problem->dtype = q.dtype;
  return Status::Ok();
}

// Shapes, with the transposes folded into strides: bs, Sq and d from q, bs_kv and Skv from k, dv
// from v; the grouped-query group size.
Status read_shapes(const TensorView& q, const TensorView& k, const TensorView& v,
                   const Options& options, Problem* problem) {
  const int q_seq = seq_axis(options.tp_q), q_channel = channel_axis(options.tp_q);
  problem->batch = q.shape[0];
  problem->seqlen_q = q.shape[q_seq];
  problem->head_dim = q.shape[q_channel];
  problem->q = {q.data, q.strides[0], q.strides[q_seq], q.strides[q_channel]};
  const int k_seq = seq_axis(options.tp_k), k_channel = channel_axis(options.tp_k);
  problem->kv_batch = k.shape[0];
  problem->seqlen_kv = k.shape[k_seq];
  problem->k = {k.data, k.strides[0], k.strides[k_seq], k.strides[k_channel]};
  problem->value_dim = v.shape[2];
  problem->v = {v.data, v.strides[0], v.strides[1], v.strides[2]};

  if (problem->head_dim < 1 || problem->head_dim > kMaxHeadDim) {
    return Status::Error("q: head dim d = " + std::to_string(problem->head_dim) +
                         " must be in [1, " + std::to_string(kMaxHeadDim) + "]");
  }
  if (k.shape[k_channel] != problem->head_dim) {
    return Status::Error(
        "k: head dim " + std::to_string(k.shape[k_channel]) + " differs from q's d = " +
        std::to_string(problem->head_dim) + " (shape " + shape_str(k.shape.data(), 3) +
        (options.tp_k ? " read as (bs_kv, Skv, d))" : " read as (bs_kv, d, Skv))"));
  }
  if (problem->value_dim < 1 || problem->value_dim > kMaxHeadDim) {
    return Status::Error("v: value head dim dv = " + std::to_string(problem->value_dim) +
                         " must be in [1, " + std::to_string(kMaxHeadDim) + "]");
  }
  if (v.shape[0] != problem->kv_batch || v.shape[1] != problem->seqlen_kv) {
    return Status::Error(
        "v: shape " + shape_str(v.shape.data(), 3) +
        " must be (bs_kv, Skv, dv) with bs_kv = " + std::to_string(problem->kv_batch) +
        " and Skv = " + std::to_string(problem->seqlen_kv) + " from k");
  }
  if (problem->kv_batch == 0 && problem->batch != 0) {
    return Status::Error("k: bs_kv is 0 but q has bs = " + std::to_string(problem->batch));
  }
  if (problem->kv_batch > 0 && problem->batch % problem->kv_batch != 0) {
    return Status::Error("q: bs = " + std::to_string(problem->batch) +
                         " must be a multiple of k's bs_kv = " + std::to_string(problem->kv_batch) +
                         " (grouped-query attention)");
  }
  problem->group = problem->kv_batch > 0 ? problem->batch / problem->kv_batch : 1;
  return Status::Ok();
}

// sink: one logit per query batch, finite or -inf (no sink).
Status read_sink(const Options& options, Problem* problem, ViewExtents* extents) {
  if (!options.sink.present()) return Status::Ok();
  BatchVector sink;
  FLASHCTE_RETURN_IF_ERROR(read_batch_vector("sink", options.sink, problem->batch, "(bs, 1)", "bs",
                                             &sink, &extents->sink));
  problem->sink = sink.data;
  problem->sink_stride = sink.stride;
  return check_sink_values("sink", sink.data, sink.stride, problem->batch);
}

// scale, and the windows: causal_mask, sliding_window and window_left/window_right all become
// one allowed range of diff = kv_pos - q_pos (SEMANTICS.md step 3).
Status read_scalars_and_windows(const Options& options, Problem* problem) {
  if (!std::isfinite(options.scale)) {
    return Status::Error("scale: must be finite, got " + std::to_string(options.scale));
  }
  problem->scale = options.scale;
  if (options.sliding_window < 0) {
    return Status::Error("sliding_window: must be >= 0 (0 disables it), got " +
                         std::to_string(options.sliding_window));
  }
  if (options.window_left < -1) {
    return Status::Error("window_left: must be >= 0, or -1 for unbounded, got " +
                         std::to_string(options.window_left));
  }
  if (options.window_right < -1) {
    return Status::Error("window_right: must be >= 0, or -1 for unbounded, got " +
                         std::to_string(options.window_right));
  }
  const int64_t kNoLimit = Problem::kNoLimit;
  problem->window_left =
      options.window_left >= 0 ? std::min(options.window_left, kNoLimit) : kNoLimit;
  problem->window_right =
      options.window_right >= 0 ? std::min(options.window_right, kNoLimit) : kNoLimit;
  if (options.causal_mask) problem->window_right = std::min<int64_t>(problem->window_right, 0);
  if (options.sliding_window > 0) {
    problem->window_left =
        std::min(problem->window_left, std::min(options.sliding_window, kNoLimit) - 1);
  }
  return Status::Ok();
}

// Context parallelism and the query positions: row i sits at cp_offset + i * global_cp_deg with
// strided slicing (cp_offset + i without), shifted by Skv - Sq with bottom_right.
Status read_query_positions(const Options& options, Problem* problem) {
  const std::optional<int64_t>& cp_degree = options.global_cp_deg;
  const std::optional<int64_t>& cp_offset = options.cp_offset;
  if (cp_degree && *cp_degree < 1) {
    return Status::Error("global_cp_deg: must be >= 1, got " + std::to_string(*cp_degree));
  }
  if (cp_offset && *cp_offset < 0) {
    return Status::Error("cp_offset: must be >= 0, got " + std::to_string(*cp_offset));
  }
  if (options.cp_strided_q_slicing && (!cp_offset || !cp_degree)) {
    return Status::Error(std::string(cp_offset ? "global_cp_deg" : "cp_offset") +
                         ": is required with cp_strided_q_slicing");
  }
  if (cp_degree && !cp_offset) {
    return Status::Error("cp_offset: is required when global_cp_deg is given");
  }
  problem->cp_stride = options.cp_strided_q_slicing ? *cp_degree : 1;
  if (cp_offset && *cp_offset > kMaxPosition) {
    return Status::Error("cp_offset: " + std::to_string(*cp_offset) + " exceeds 2^60");
  }
  problem->q_pos_offset =
      cp_offset.value_or(0) + (options.bottom_right ? problem->seqlen_kv - problem->seqlen_q : 0);
  int64_t last_position = 0;
  if (__builtin_mul_overflow(std::max<int64_t>(problem->seqlen_q - 1, 0), problem->cp_stride,
                             &last_position) ||
      __builtin_add_overflow(last_position, problem->q_pos_offset, &last_position) ||
      last_position > kMaxPosition) {
    return Status::Error("global_cp_deg: query positions cp_offset + i*global_cp_deg exceed 2^60");
  }
  return Status::Ok();
}

// alibi_slopes: one finite slope per query batch.
Status read_alibi_slopes(const Options& options, Problem* problem, ViewExtents* extents) {
  if (!options.alibi_slopes.present()) return Status::Ok();
  BatchVector slopes;
  FLASHCTE_RETURN_IF_ERROR(read_batch_vector("alibi_slopes", options.alibi_slopes, problem->batch,
                                             "(bs,) or (bs, 1)", "bs", &slopes,
                                             &extents->alibi_slopes));
  problem->alibi_slopes = slopes.data;
  problem->alibi_stride = slopes.stride;
  for (int64_t b = 0; b < problem->batch; ++b) {
    if (!std::isfinite(slopes.data[b * slopes.stride])) {
      return Status::Error("alibi_slopes: entry " + std::to_string(b) + " is not finite");
    }
  }
  return Status::Ok();
}

// key_bias: (bs, L) float32 over the concatenated KV axis, L = the longest prior_used_len + Skv.
Status read_key_bias(const Options& options, Problem* problem, ViewExtents* extents) {
  const TensorView& bias = options.key_bias;
  if (!bias.present()) return Status::Ok();
  FLASHCTE_RETURN_IF_ERROR(check_view("key_bias", bias, false, &extents->key_bias));
  FLASHCTE_RETURN_IF_ERROR(expect_float32("key_bias", bias.dtype));
  const int64_t total = problem->max_kv_total();
  if (bias.rank != 2 || bias.shape[0] != problem->batch || bias.shape[1] != total) {
    return Status::Error("key_bias: shape " + shape_str(bias.shape.data(), bias.rank) +
                         " must be (bs, prior_used_len + Skv) = (" +
                         std::to_string(problem->batch) + ", " + std::to_string(total) + ")");
  }
  problem->key_bias = static_cast<const float*>(bias.data);
  problem->key_bias_batch_stride = bias.strides[0];
  problem->key_bias_key_stride = bias.strides[1];
  return Status::Ok();
}

// Score modifiers: softcap, alibi_slopes, key_bias.
Status read_score_modifiers(const Options& options, Problem* problem, ViewExtents* extents) {
  if (!(options.softcap >= 0.0f) || std::isinf(options.softcap)) {
    return Status::Error("softcap: must be finite and >= 0 (0 disables it), got " +
                         std::to_string(options.softcap));
  }
  problem->softcap = options.softcap;
  FLASHCTE_RETURN_IF_ERROR(read_alibi_slopes(options, problem, extents));
  return read_key_bias(options, problem, extents);
}

// Packing: bound_min and bound_max together, per query row a range [min, max) of the
// concatenated KV axis.
Status read_packing(const Options& options, Problem* problem) {
  if (options.bound_min.present() != options.bound_max.present()) {
    return Status::Error(options.bound_min.present()
                             ? "bound_max: is required when bound_min is given"
                             : "bound_min: is required when bound_max is given");
  }
  if (!options.bound_min.present()) return Status::Ok();
  FLASHCTE_RETURN_IF_ERROR(
      read_bounds("bound_min", options.bound_min, problem->seqlen_q, &problem->bound_lo));
  FLASHCTE_RETURN_IF_ERROR(
      read_bounds("bound_max", options.bound_max, problem->seqlen_q, &problem->bound_hi));
  const int64_t total = problem->max_kv_total();
  for (int64_t i = 0; i < problem->seqlen_q; ++i) {
    const int64_t lo = problem->bound_lo[i], hi = problem->bound_hi[i];
    if (lo < 0 || lo > total) {
      return Status::Error("bound_min: row " + std::to_string(i) + " holds " + std::to_string(lo) +
                           ", outside [0, " + std::to_string(total) +
                           "] (the concatenated KV length)");
    }
    if (hi < lo || hi > total) {
      return Status::Error("bound_max: row " + std::to_string(i) + " holds " + std::to_string(hi) +
                           ", outside [bound_min = " + std::to_string(lo) + ", " +
                           std::to_string(total) +
                           "] (bounds are [min, max) over the concatenated KV axis)");
    }
  }
  return Status::Ok();
}

// out: (bs, Sq, dv), or (bs, dv, Sq) with tp_out, in q's dtype, no two elements at one address.
Status read_out(const MutableTensorView& out, const Options& options, bool shapes_only,
                Problem* problem, ViewExtents* extents) {
  if (!out.present()) return Status::Error("out: is required");
  FLASHCTE_RETURN_IF_ERROR(check_view("out", out, shapes_only, &extents->out));
  FLASHCTE_RETURN_IF_ERROR(expect_rank(
      "out", out.rank, 3, options.tp_out ? "(bs, dv, Sq) with tp_out" : "(bs, Sq, dv)"));
  if (out.dtype != problem->dtype) {
    return Status::DtypeError(std::string("out: dtype ") + dtype_name(out.dtype) +
                              " must be q's dtype " + dtype_name(problem->dtype));
  }
  const int out_seq = options.tp_out ? 2 : 1, out_channel = options.tp_out ? 1 : 2;
  const int64_t* shape = out.shape.data();
  FLASHCTE_RETURN_IF_ERROR(expect_dim("out", shape, 3, 0, problem->batch, "bs"));
  FLASHCTE_RETURN_IF_ERROR(expect_dim("out", shape, 3, out_seq, problem->seqlen_q, "Sq"));
  FLASHCTE_RETURN_IF_ERROR(expect_dim("out", shape, 3, out_channel, problem->value_dim, "dv"));
  problem->out = {out.data, out.strides[0], out.strides[out_seq], out.strides[out_channel]};
  return check_no_self_overlap("out", out);
}

// A statistic output: float32 (bs, Sq) row-major, or (bs, 128, Sq/128) in the Neuron layout when
// `allow_neuron`.
Status read_stat(const char* name, const MutableTensorView& view, int64_t batch, int64_t seqlen_q,
                 bool allow_neuron, StatView* stat, Extent* extent) {
  FLASHCTE_RETURN_IF_ERROR(check_view(name, view, false, extent));
  FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap(name, view));
  FLASHCTE_RETURN_IF_ERROR(expect_float32(name, view.dtype));
  stat->data = static_cast<float*>(view.data);
  stat->batch_stride = view.strides[0];
  if (view.rank == 2) {
    if (view.shape[0] != batch || view.shape[1] != seqlen_q) {
      return Status::Error(std::string(name) + ": shape " + shape_str(view.shape.data(), 2) +
                           " must be (bs, Sq) = (" + std::to_string(batch) + ", " +
                           std::to_string(seqlen_q) + ")");
    }
    stat->row_stride = view.strides[1];
    return Status::Ok();
  }
  if (allow_neuron && view.rank == 3) {
    if (seqlen_q % 128 != 0) {
      return Status::Error(std::string(name) + ": the Neuron layout (bs, 128, Sq/128) needs Sq " +
                           "to be a multiple of 128, got Sq = " + std::to_string(seqlen_q) +
                           "; use the row-major (bs, Sq) layout");
    }
    if (view.shape[0] != batch || view.shape[1] != 128 || view.shape[2] != seqlen_q / 128) {
      return Status::Error(std::string(name) + ": shape " + shape_str(view.shape.data(), 3) +
                           " must be (bs, 128, Sq/128) = (" + std::to_string(batch) + ", 128, " +
                           std::to_string(seqlen_q / 128) + ")");
    }
    stat->neuron_layout = true;
    stat->row_stride = view.strides[1];
    stat->group_stride = view.strides[2];
    return Status::Ok();
  }
  return Status::Error(std::string(name) +
                       (allow_neuron ? ": must have rank 2 (bs, Sq) or rank 3"
                                       " (bs, 128, Sq/128), got rank "
                                     : ": must have rank 2 (bs, Sq), got rank ") +
                       std::to_string(view.rank));
}

// The statistics: neg_max and sum_recip exactly with cache_softmax, lse whenever given.
Status read_statistics(const Outputs& outputs, const Options& options, Problem* problem,
                       ViewExtents* extents) {
  const int64_t batch = problem->batch, seqlen_q = problem->seqlen_q;
  if (options.cache_softmax) {
    if (!outputs.neg_max.present()) return Status::Error("neg_max: is required with cache_softmax");
    if (!outputs.sum_recip.present()) {
      return Status::Error("sum_recip: is required with cache_softmax");
    }
    FLASHCTE_RETURN_IF_ERROR(read_stat("neg_max", outputs.neg_max, batch, seqlen_q, true,
                                       &problem->neg_max, &extents->neg_max));
    FLASHCTE_RETURN_IF_ERROR(read_stat("sum_recip", outputs.sum_recip, batch, seqlen_q, true,
                                       &problem->sum_recip, &extents->sum_recip));
  } else if (outputs.neg_max.present() || outputs.sum_recip.present()) {
    return Status::Error(std::string(outputs.neg_max.present() ? "neg_max" : "sum_recip") +
                         ": given without cache_softmax = true");
  }
  if (!outputs.lse.present()) return Status::Ok();
  return read_stat("lse", outputs.lse, batch, seqlen_q, false, &problem->lse, &extents->lse);
}

// Aliasing: no output may overlap an input or another output.
Status check_aliasing(const ViewExtents& extents) {
  return check_disjoint({{"out", extents.out},
                         {"neg_max", extents.neg_max},
                         {"sum_recip", extents.sum_recip},
                         {"lse", extents.lse}},
                        {{"q", extents.q},
                         {"k", extents.k},
                         {"v", extents.v},
                         {"k_prior", extents.prefix.k_prior},
                         {"v_prior", extents.prefix.v_prior},
                         {"k_prior_scale", extents.prefix.k_prior_scale},
                         {"v_prior_scale", extents.prefix.v_prior_scale},
                         {"sink", extents.sink},
                         {"alibi_slopes", extents.alibi_slopes},
                         {"key_bias", extents.key_bias}});
}

// Execution settings: num_threads and the tile sizes.
Status read_execution_settings(const Options& options, Problem* problem) {
  if (options.num_threads < 0) {
    return Status::Error("num_threads: must be >= 0 (0 = OpenMP default), got " +
                         std::to_string(options.num_threads));
  }
  const TileConfig& tiles = options.tiles;
  if (tiles.q_block < 0 || tiles.q_block > kMaxQBlock) {
    return Status::Error("tiles.q_block: must be in [0, " + std::to_string(kMaxQBlock) +
                         "] (0 = automatic), got " + std::to_string(tiles.q_block));
  }
  if (tiles.kv_tile < 0 || tiles.kv_tile > kMaxKvTile) {
    return Status::Error("tiles.kv_tile: must be in [0, " + std::to_string(kMaxKvTile) +
                         "] (0 = automatic), got " + std::to_string(tiles.kv_tile));
  }
  if (tiles.section < 0 || tiles.section > kMaxSection) {
    return Status::Error("tiles.section: must be in [0, " + std::to_string(kMaxSection) +
                         "] (0 = one tile), got " + std::to_string(tiles.section));
  }
  if (tiles.section_threshold < 0) {
    return Status::Error("tiles.section_threshold: must be >= 0, got " +
                         std::to_string(tiles.section_threshold));
  }
  if (tiles.section > 0 && tiles.kv_tile > 0 && tiles.section % tiles.kv_tile != 0) {
    return Status::Error("tiles.section: " + std::to_string(tiles.section) +
                         " must be a multiple of tiles.kv_tile = " + std::to_string(tiles.kv_tile));
  }
  problem->tile_request = tiles;
  problem->threads = options.num_threads;
  return Status::Ok();
}

}  // namespace

Status validate(const TensorView& q, const TensorView& k, const TensorView& v,
                const Outputs& outputs, const Options& options, bool shapes_only,
                Problem* problem) {
  *problem = Problem{};
  ViewExtents extents;
  FLASHCTE_RETURN_IF_ERROR(check_qkv(q, k, v, options, shapes_only, problem, &extents));
  FLASHCTE_RETURN_IF_ERROR(read_shapes(q, k, v, options, problem));
  FLASHCTE_RETURN_IF_ERROR(read_prefix(options, shapes_only, problem, &extents.prefix));
  FLASHCTE_RETURN_IF_ERROR(read_sink(options, problem, &extents));
  FLASHCTE_RETURN_IF_ERROR(read_scalars_and_windows(options, problem));
  FLASHCTE_RETURN_IF_ERROR(read_query_positions(options, problem));
  FLASHCTE_RETURN_IF_ERROR(read_score_modifiers(options, problem, &extents));
  FLASHCTE_RETURN_IF_ERROR(read_packing(options, problem));
  FLASHCTE_RETURN_IF_ERROR(read_out(outputs.out, options, shapes_only, problem, &extents));
  FLASHCTE_RETURN_IF_ERROR(read_statistics(outputs, options, problem, &extents));
  FLASHCTE_RETURN_IF_ERROR(check_aliasing(extents));
  FLASHCTE_RETURN_IF_ERROR(read_execution_settings(options, problem));
  // No query batch (FlashAttention's 0 query heads over any number of KV heads): nothing to
  // compute or write. The kernel plans one item per KV batch for its group = bs / bs_kv query
  // batches; without KV batches it plans none instead of a group of 0 (a division by zero).
  if (problem->batch == 0) {
    problem->kv_batch = 0;
    problem->group = 1;
  }
  return Status::Ok();
}

}  // namespace flashcte::internal
