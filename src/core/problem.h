// The validated, layout-normalized form of one attention_cte call. Everything below the dispatch
// layer reads this and never the user's arguments: transposes are folded into strides, defaults
// are resolved, bounds are converted to int64. It sits in src/core, below every layer that reads
// it (dispatch fills it, schedule and kernel read it), so no layer includes one above it.
#ifndef FLASHCTE_SRC_CORE_PROBLEM_H_
#define FLASHCTE_SRC_CORE_PROBLEM_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/kv_source.h"

namespace flashcte::internal {

// A rank-3 tensor read as logical (batch, row, column): for q/out (b, query, channel), for k/v
// (b, key, channel). Strides in elements, transposes already applied.
template <class Pointer>
struct StridedView3 {
  Pointer data = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};
using View3 = StridedView3<const void*>;  // inputs
using MutView3 = StridedView3<void*>;     // the output

// A per-(batch, query row) float32 statistic, in either the row-major or the Neuron layout.
struct StatView {
  float* data = nullptr;  // null: not requested
  bool neuron_layout = false;
  int64_t batch_stride = 0;
  // Row-major: element (b, i) at b*batch_stride + i*row_stride.
  // Neuron (bs, 128, Sq/128): row i = g*128 + p at b*batch_stride + p*row_stride + g*group_stride.
  int64_t row_stride = 0;
  int64_t group_stride = 0;

  float* at(int64_t b, int64_t i) const {
    if (neuron_layout)
      return data + b * batch_stride + (i % 128) * row_stride + (i / 128) * group_stride;
    return data + b * batch_stride + i * row_stride;
  }
};

struct Problem {
  DType dtype = DType::kFloat32;  // compute mode: the dtype of q, k, v (and priors, out)
  int64_t batch = 0;              // bs: query (batch*head) count
  int64_t kv_batch = 0;           // bs_kv
  int64_t group = 1;              // bs / bs_kv: query heads sharing one KV batch
  int64_t seqlen_q = 0;
  int64_t seqlen_kv = 0;     // length of k/v (without prior)
  int64_t seqlen_prior = 0;  // S_prior (allocated length of k_prior/v_prior), 0 without prefix
  int64_t head_dim = 0;      // d of q and k
  int64_t value_dim = 0;     // d of v and out

  View3 q, k, v;
  // The prefix, dense or paged: KV batch kv_b is head kv_b % prior_heads of sequence
  // kv_b / prior_heads (attention_cte's dense prior: each KV batch its own sequence, prior_heads
  // 1; a KV-cache call's: the heads of one sequence). Rows: prior_row().
  KvSource k_prior, v_prior;
  int64_t prior_heads = 1;
  std::vector<int64_t> prior_used;  // per KV batch (size kv_batch); all zero without prefix
  // An 8-bit prior's scales (its element c stands for c x scale): one per KV batch, or, when the
  // token source's data is set, one per slot read beside the prior's rows (KvSource of float32,
  // channel stride 0). Empty and null for a prior of q's dtype.
  std::vector<float> k_prior_scale, v_prior_scale;
  KvSource k_prior_token_scale, v_prior_token_scale;

  const float* sink = nullptr;  // one logit per query batch, or null
  int64_t sink_stride = 0;

  float scale = 1.0f;
  // The allowed diff = kv_pos - q_pos is [-window_left, window_right]; kNoLimit is unbounded.
  // Causal, sliding_window and FlashAttention's window_size all land here.
  static constexpr int64_t kNoLimit = INT64_MAX / 4;
  int64_t window_left = kNoLimit;
  int64_t window_right = kNoLimit;
  // Position of local query row i: q_pos_offset + i * cp_stride (cp_offset, plus Skv - Sq with
  // bottom_right).
  int64_t q_pos_offset = 0;
  int64_t cp_stride = 1;

  // Score modifiers (Options): applied to S after scale, before the masks.
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;  // per query batch
  int64_t alibi_stride = 0;
  const float* key_bias = nullptr;  // (bs, L): key_bias[b * key_bias_batch_stride + j * ..]
  int64_t key_bias_batch_stride = 0;
  int64_t key_bias_key_stride = 0;
  bool has_modifiers() const { return softcap > 0.0f || alibi_slopes || key_bias; }
  // Packing bounds per query row (concatenated-KV indices), empty without packing.
  std::vector<int64_t> bound_lo, bound_hi;

  MutView3 out;
  StatView neg_max, sum_recip, lse;

  // Options::tiles as the caller gave them (validated; a zero field is the kernel's choice). Only
  // the kernel resolves and reads tile sizes (resolve_tiles, src/kernel/plan.h).
  TileConfig tile_request;
  int threads = 0;  // Options::num_threads: 0 = OpenMP's default (the schedule resolves it)

  bool has_prior() const { return k_prior.data != nullptr; }
  // Whether K or V of the prior is an 8-bit format (read with its scales).
  bool prior_is_kv8() const {
    return has_prior() && (k_prior.dtype != dtype || v_prior.dtype != dtype);
  }
  // The first element of prior row j of KV batch kv_b in `src` (k_prior or v_prior).
  const unsigned char* prior_row(const KvSource& src, int64_t kv_b, int64_t j) const {
    return src.row(kv_b / prior_heads, kv_b % prior_heads, j);
  }
  int64_t kv_total(int64_t kv_b) const { return prior_used[kv_b] + seqlen_kv; }
  int64_t max_kv_total() const {
    int64_t longest = seqlen_kv;
    for (int64_t used : prior_used) longest = std::max(longest, used + seqlen_kv);
    return longest;
  }
};

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_CORE_PROBLEM_H_
