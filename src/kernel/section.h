// One softmax section of the recurrence for one head's rows (shared/spec/attention_cte_kernel.txt,
// the loop body; attention.cc has the loops around it):
//   MM1   S = (scale * Q).K^T per tile, masked element-wise only on tiles that straddle a row's
//         interval (plan.h); on the native bfloat16 kernels S = scale * (Q.K^T);
//         softcap, ALiBi and key_bias applied to S before the masks;
//   max   the running max and alpha (SoftmaxState::rescale);
//   exp   P = exp(S + neg_max), summed as it goes: the bias is the shift, no subtract pass;
//   MM2   O = alpha * O + P.V, the rescale folded into MM2's first tile.
// Register tiles and bytes per FLOP are those of the micro-kernels (src/simd/mm1-inl.h,
// mm2-inl.h, native_ops.cc); this file adds O(rows) work per tile.
#ifndef FLASHCTE_SRC_KERNEL_SECTION_H_
#define FLASHCTE_SRC_KERNEL_SECTION_H_

#include <cstdint>

#include "src/core/problem.h"
#include "src/kernel/plan.h"
#include "src/kernel/softmax_state.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// One section of K and V as pack_section left it (pack.h), shared by every head of the group.
struct PackedSection {
  int64_t begin = 0;  // the section's first concatenated-KV column
  // float32 blocks: K [d][ldk] transposed, V [keys][ldv] (packed, or the caller's tensor).
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ldk = 0, ldv = 0;
  bool v_nonfinite = false;  // V holds a NaN or Inf: masked tiles contract row by row
  // Non-null: the section runs on the native bfloat16 kernels over K2 and V2 (bfloat16 pairs).
  const simd::NativeOps* dot = nullptr;
  const uint32_t* k2 = nullptr;
  const uint32_t* v2 = nullptr;
  // An 8-bit prior on the native path: K2 and V2 hold its codes (bfloat16 values), and column j
  // of the section (key begin + j) takes these scales, 1 past the prior: k_scale on the scores,
  // v_scale on P before it is rounded to bfloat16. Null: no scale (the float32 path's packed
  // values are dequantized already). vdpbf16ps flushes a P x v_scale below 2^-126 as it flushes a
  // P that small: with V scales of 2^-102 or more, only terms below 2^-24 of the largest go.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

// One head's rows of a work item (a sub-block).
struct HeadBlock {
  int64_t batch = 0;                       // query batch
  int64_t first_row = 0;                   // global index of row 0 (positions, key_bias)
  int64_t prior = 0;                       // prior_used_len of the KV batch
  const float* q = nullptr;                // [rows][d], scaled
  const uint16_t* q_pairs = nullptr;       // [rows][pair_dim(d)], unscaled (native path only)
  const RowInterval* intervals = nullptr;  // [rows]
};

// The scores of one head's rows: float32 [rows][lds] and, on the native path, their bfloat16 P.
struct ScoreBuffer {
  float* s = nullptr;
  uint16_t* p2 = nullptr;
  int64_t lds = 0;
};

// Runs `tiles` (this sub-block's computed tiles of the section) through the recurrence,
// updating `state` (head.rows() rows).
void attend_section(const Problem& problem, const simd::Ops& ops, const PackedSection& section,
                    const TileWork* tiles, int64_t num_tiles, const HeadBlock& head,
                    const ScoreBuffer& scores, SoftmaxState& state);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_SECTION_H_
