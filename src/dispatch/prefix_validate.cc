// The prefix of an attention_cte call (prefix caching, prefix_validate.h): k_prior and v_prior,
// dense or paged, prior_used_len, and an 8-bit prior's scales.
#include "src/dispatch/prefix_validate.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "src/core/kv8.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

// prior_used_len: empty (all of S_prior is valid), one length for the whole batch, or one per KV
// batch; each in [0, S_prior].
Status read_prior_used(const std::vector<int64_t>& used, Problem* problem) {
  if (!used.empty() && used.size() != 1 && static_cast<int64_t>(used.size()) != problem->kv_batch) {
    return Status::Error(
        "prior_used_len: must hold 1 value or bs_kv = " + std::to_string(problem->kv_batch) +
        " values, got " + std::to_string(used.size()));
  }
  for (int64_t b = 0; b < problem->kv_batch; ++b) {
    int64_t length = problem->seqlen_prior;  // empty: all of S_prior
    if (!used.empty()) length = used.size() == 1 ? used[0] : used[b];
    if (length < 0 || length > problem->seqlen_prior) {
      return Status::Error("prior_used_len: " + std::to_string(length) +
                           " must be in [0, S_prior = " + std::to_string(problem->seqlen_prior) +
                           "]");
    }
    problem->prior_used[b] = length;
  }
  return Status::Ok();
}

// A paged prefix: k_prior / v_prior pages (num_blocks, kv_heads, block_size, d / dv), KV batch
// kv_b = sequence * kv_heads + head, prior_block_table (bs_kv / kv_heads, max_blocks) int32; the
// pages of every prior slot a KV batch uses are checked in range and copied.
Status read_paged_prefix(const Options& options, bool shapes_only, Problem* problem) {
  const TensorView& k = options.k_prior;
  const TensorView& v = options.v_prior;
  const TensorView& t = options.prior_block_table;
  FLASHCTE_RETURN_IF_ERROR(
      expect_rank("k_prior", k.rank, 4, "(num_blocks, kv_heads, block_size, d) with pages"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_rank("v_prior", v.rank, 4, "(num_blocks, kv_heads, block_size, dv) with pages"));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("k_prior", k.dtype, problem->dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("v_prior", v.dtype, problem->dtype));
  FLASHCTE_RETURN_IF_ERROR(check_view("prior_block_table", t, shapes_only, nullptr));
  FLASHCTE_RETURN_IF_ERROR(
      expect_rank("prior_block_table", t.rank, 2, "(bs_kv / kv_heads, max_blocks)"));
  if (t.dtype != DType::kInt32) {
    return Status::DtypeError(std::string("prior_block_table: dtype must be int32, got ") +
                              dtype_name(t.dtype));
  }
  const int64_t heads = k.shape[1], block = k.shape[2], num_blocks = k.shape[0];
  FLASHCTE_RETURN_IF_ERROR(expect_dim("k_prior", k.shape.data(), 4, 3, problem->head_dim, "d"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_dim("v_prior", v.shape.data(), 4, 0, num_blocks, "k_prior's num_blocks"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_dim("v_prior", v.shape.data(), 4, 1, heads, "k_prior's kv_heads"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_dim("v_prior", v.shape.data(), 4, 2, block, "k_prior's block_size"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_dim("v_prior", v.shape.data(), 4, 3, problem->value_dim, "dv of v"));
  if (block < 1) return Status::Error("k_prior: block_size (axis 2) is 0; a page holds >= 1 slot");
  if (heads < 1 || problem->kv_batch % heads != 0 || t.shape[0] != problem->kv_batch / heads) {
    return Status::Error("prior_block_table: shape " + shape_str(t.shape.data(), 2) +
                         " must have bs_kv / kv_heads = " + std::to_string(problem->kv_batch) +
                         " / " + std::to_string(heads) + " rows (one per sequence)");
  }
  if (__builtin_mul_overflow(t.shape[1], block, &problem->seqlen_prior)) {
    return Status::Error("prior_block_table: " + std::to_string(t.shape[1]) + " pages of " +
                         std::to_string(block) + " slots are more than fit in 64 bits");
  }
  problem->prior_heads = heads;
  for (auto [src, view] : {std::pair{&problem->k_prior, &k}, std::pair{&problem->v_prior, &v}}) {
    src->data = view->data;
    src->dtype = view->dtype;
    src->strides = view->strides;
    src->block_size = block;
    src->pages_per_sequence = t.shape[1];
  }
  FLASHCTE_RETURN_IF_ERROR(read_prior_used(options.prior_used_len, problem));
  if (shapes_only && t.data == nullptr) return Status::Ok();
  std::vector<int32_t> table(static_cast<size_t>(t.shape[0] * t.shape[1]), -1);
  for (int64_t s = 0; s < t.shape[0]; ++s) {
    int64_t used = 0;  // the longest prior of the sequence's heads
    for (int64_t h = 0; h < heads; ++h) used = std::max(used, problem->prior_used[s * heads + h]);
    for (int64_t i = 0; i * block < used; ++i) {
      const int32_t page = static_cast<const int32_t*>(t.data)[s * t.strides[0] + i * t.strides[1]];
      if (page < 0 || page >= num_blocks) {
        return Status::Error(
            "prior_block_table: [" + std::to_string(s) + ", " + std::to_string(i) +
            "] = " + std::to_string(page) +
            " must be a page of k_prior, in [0, num_blocks = " + std::to_string(num_blocks) + ")");
      }
      table[static_cast<size_t>(s * t.shape[1] + i)] = page;
    }
  }
  problem->k_prior.table = table;
  problem->v_prior.table = std::move(table);
  return Status::Ok();
}

// k_prior and v_prior, laid out like k and v, and prior_used_len.
Status read_prior(const Options& options, bool shapes_only, Problem* problem,
                  PrefixExtents* extents) {
  const TensorView& k_prior = options.k_prior;
  const TensorView& v_prior = options.v_prior;
  if (k_prior.present() != v_prior.present()) {
    return Status::Error(k_prior.present() ? "v_prior: is required when k_prior is given"
                                           : "k_prior: is required when v_prior is given");
  }
  problem->prior_used.assign(problem->kv_batch, 0);
  if (!k_prior.present()) {
    if (!options.prior_used_len.empty()) {
      return Status::Error("prior_used_len: given without k_prior and v_prior");
    }
    if (options.prior_block_table.present()) {
      return Status::Error("prior_block_table: given without k_prior and v_prior");
    }
    return Status::Ok();
  }
  FLASHCTE_RETURN_IF_ERROR(check_view("k_prior", k_prior, shapes_only, &extents->k_prior));
  FLASHCTE_RETURN_IF_ERROR(check_view("v_prior", v_prior, shapes_only, &extents->v_prior));
  if (options.prior_block_table.present()) return read_paged_prefix(options, shapes_only, problem);
  FLASHCTE_RETURN_IF_ERROR(expect_rank("k_prior", k_prior.rank, 3, "laid out like k"));
  FLASHCTE_RETURN_IF_ERROR(expect_rank("v_prior", v_prior.rank, 3, "(bs_kv, S_prior, dv)"));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("k_prior", k_prior.dtype, problem->dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_cache_dtype("v_prior", v_prior.dtype, problem->dtype));
  const int k_seq = seq_axis(options.tp_k), k_channel = channel_axis(options.tp_k);
  problem->seqlen_prior = k_prior.shape[k_seq];
  // Each KV batch its own sequence of one head.
  problem->k_prior.data = k_prior.data;
  problem->k_prior.strides = {k_prior.strides[0], 0, k_prior.strides[k_seq],
                              k_prior.strides[k_channel]};
  problem->v_prior.data = v_prior.data;
  problem->v_prior.strides = {v_prior.strides[0], 0, v_prior.strides[1], v_prior.strides[2]};
  problem->k_prior.dtype = k_prior.dtype;
  problem->v_prior.dtype = v_prior.dtype;
  const int64_t* k_shape = k_prior.shape.data();
  const int64_t* v_shape = v_prior.shape.data();
  FLASHCTE_RETURN_IF_ERROR(expect_dim("k_prior", k_shape, 3, 0, problem->kv_batch, "bs_kv"));
  FLASHCTE_RETURN_IF_ERROR(expect_dim("k_prior", k_shape, 3, k_channel, problem->head_dim, "d"));
  FLASHCTE_RETURN_IF_ERROR(expect_dim("v_prior", v_shape, 3, 0, problem->kv_batch, "bs_kv"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_dim("v_prior", v_shape, 3, 1, problem->seqlen_prior, "S_prior of k_prior"));
  FLASHCTE_RETURN_IF_ERROR(expect_dim("v_prior", v_shape, 3, 2, problem->value_dim, "dv of v"));
  return read_prior_used(options.prior_used_len, problem);
}

// k_prior_scale / v_prior_scale (Options): required with an 8-bit prior and refused otherwise;
// (1,), one per KV batch (dense) or KV head (paged), each read and checked, or one per slot (the
// prior's shape without its channel axis, `seqlen` slots when dense), a source beside the prior's
// rows.
Status read_prior_scale(const char* name, const TensorView& t, const char* prior_name,
                        const TensorView& prior, const KvSource& rows, int64_t kv_batch,
                        int64_t seqlen, bool shapes_only, std::vector<float>* scales,
                        KvSource* token_scale, Extent* extent) {
  if (!prior.present() || !kv8::is_8bit(prior.dtype)) {
    if (!t.present()) return Status::Ok();
    return Status::Error(std::string(name) + ": is for an 8-bit " + prior_name + "; " +
                         (prior.present()
                              ? std::string(prior_name) + " is " + dtype_name(prior.dtype)
                              : std::string("there is no ") + prior_name));
  }
  if (!t.present()) {
    return Status::Error(std::string(name) + ": is required with the " + dtype_name(prior.dtype) +
                         " " + prior_name + " (its dequantization scale)");
  }
  const bool paged = rows.paged();
  const char* layout = paged ? "(1,), (kv_heads,) or (num_blocks, kv_heads, block_size)"
                             : "(1,), (bs_kv,) or (bs_kv, S_prior)";
  FLASHCTE_RETURN_IF_ERROR(check_view(name, t, shapes_only, extent));
  FLASHCTE_RETURN_IF_ERROR(expect_float32(name, t.dtype));
  const int per_slot_rank = paged ? 3 : 2;
  if (t.rank == per_slot_rank) {
    // The prior's shape without its channel axis: paged (num_blocks, kv_heads, block_size),
    // dense (bs_kv, S_prior) of (bs_kv, d, S_prior) or (bs_kv, S_prior, d).
    const std::array<int64_t, 3> want =
        paged ? std::array<int64_t, 3>{prior.shape[0], prior.shape[1], prior.shape[2]}
              : std::array<int64_t, 3>{prior.shape[0], seqlen, 0};
    for (int axis = 0; axis < per_slot_rank; ++axis) {
      if (t.shape[axis] != want[axis]) {
        return Status::Error(std::string(name) + ": shape " + shape_str(t.shape.data(), t.rank) +
                             " must be " + layout + "; one per slot is " + prior_name +
                             "'s shape without its channel axis, " +
                             shape_str(want.data(), per_slot_rank));
      }
    }
    // Dense: (KV batch, slot); paged: (page, head, row).
    *token_scale = paged
                       ? token_scale_source(rows, t.data, t.strides[0], t.strides[1], t.strides[2])
                       : token_scale_source(rows, t.data, t.strides[0], 0, t.strides[1]);
    return Status::Ok();
  }
  const int64_t heads = paged ? prior.shape[1] : kv_batch;
  if (t.rank != 1 || (t.shape[0] != 1 && t.shape[0] != heads)) {
    return Status::Error(std::string(name) + ": shape " + shape_str(t.shape.data(), t.rank) +
                         " must be " + layout + " for " + prior_name + " of shape " +
                         shape_str(prior.shape.data(), prior.rank));
  }
  if (shapes_only && t.data == nullptr) return Status::Ok();
  std::vector<float> entries;
  FLASHCTE_RETURN_IF_ERROR(read_scale_entries(name, t, heads, &entries));
  // One per KV batch: KV batch kv_b is head kv_b % heads of a paged prior (Problem::prior_row).
  scales->resize(static_cast<size_t>(kv_batch));
  for (int64_t b = 0; b < kv_batch; ++b) (*scales)[b] = entries[static_cast<size_t>(b % heads)];
  return Status::Ok();
}

Status read_prior_scales(const Options& options, bool shapes_only, Problem* problem,
                         PrefixExtents* extents) {
  FLASHCTE_RETURN_IF_ERROR(read_prior_scale(
      "k_prior_scale", options.k_prior_scale, "k_prior", options.k_prior, problem->k_prior,
      problem->kv_batch, problem->seqlen_prior, shapes_only, &problem->k_prior_scale,
      &problem->k_prior_token_scale, &extents->k_prior_scale));
  return read_prior_scale("v_prior_scale", options.v_prior_scale, "v_prior", options.v_prior,
                          problem->v_prior, problem->kv_batch, problem->seqlen_prior, shapes_only,
                          &problem->v_prior_scale, &problem->v_prior_token_scale,
                          &extents->v_prior_scale);
}

}  // namespace

Status read_prefix(const Options& options, bool shapes_only, Problem* problem,
                   PrefixExtents* extents) {
  FLASHCTE_RETURN_IF_ERROR(read_prior(options, shapes_only, problem, extents));
  return read_prior_scales(options, shapes_only, problem, extents);
}

}  // namespace flashcte::internal
