// The attention_cte kernel as the schedule sees it: a problem cut into work items, each one
// query block of every query head that shares KV batch kv_b (the GQA group), streamed against
// that batch's KV tiles. The kernel owns every tile size (src/kernel/plan.h); the schedule sees
// only items, their KV axis, where that axis may be split, and what each range costs.
#ifndef FLASHCTE_SRC_KERNEL_ATTENTION_H_
#define FLASHCTE_SRC_KERNEL_ATTENTION_H_

#include <cstdint>

#include "flashcte/flashcte.h"
#include "src/core/problem.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

class AttentionKernel {
 public:
  // Resolves the tile sizes for this machine (the problem must outlive the kernel).
  explicit AttentionKernel(const Problem& problem);

  const Problem& problem() const { return problem_; }

  // Items are numbered [0, num_items()): item i is query block i % q_blocks of KV batch
  // i / q_blocks.
  int64_t num_items() const;
  // The longest concatenated KV axis of any item: a KV range is a part of [0, kv_length()).
  int64_t kv_length() const { return problem_.max_kv_total(); }
  // KV ranges must start on multiples of this (whole softmax sections, so that a split item
  // computes exactly the sections it would unsplit).
  int64_t split_granule() const;
  // The relative cost of computing keys [kv_begin, kv_end) of `item`: the query-key pairs it
  // really computes plus a fixed cost per row.
  double cost(int64_t item, int64_t kv_begin, int64_t kv_end) const;

  // Computes keys [kv_begin, kv_end) of `item` (INT64_MAX: to the end) and writes its rows, or,
  // with `partial` (partial_floats() floats), parks its unnormalized state there for merge().
  // Uses this thread's reusable scratch.
  void run(int64_t item, int64_t kv_begin, int64_t kv_end, float* partial) const;
  int64_t partial_floats() const;
  // Sizes this thread's scratch for every item and merge of the kernel, so that run() and merge()
  // allocate nothing: called by each thread of a call before any of them writes a row.
  void reserve_scratch() const;
  // Merges the `splits` partial states of `item`, stored consecutively, in a fixed order (so the
  // result does not depend on which thread ran which split) and writes the rows.
  void merge(int64_t item, const float* partials, int64_t splits) const;

  // The kernel's part of plan_attention: tiles, blocks, sections, tile counts and FLOPs.
  void describe(PlanSummary* summary) const;

 private:
  // Rows of one query head in an item's partial state: the query block, or all of Sq when that is
  // shorter (a decode-shaped call: the state of 1 row, not of a 192..768-row block, in memory the
  // call touches; B = 8 one-query problems as one rank-4 call faulted in ~36 MB of them).
  int64_t partial_rows() const;
  // The native bfloat16 kernels the items run on (bfloat16 inputs, where the policy says so), or
  // null.
  const simd::NativeOps* native_ops() const;

  const Problem& problem_;
  TileConfig tiles_;  // resolved: every field set
  const simd::Ops& ops_;
};

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_ATTENTION_H_
