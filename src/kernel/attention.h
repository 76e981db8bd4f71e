// The attention_cte recurrence for one work item: one query block of every query head that
// shares KV batch kv_b (the GQA group), streamed against that batch's KV tiles.
#ifndef FLASHCTE_SRC_KERNEL_ATTENTION_H_
#define FLASHCTE_SRC_KERNEL_ATTENTION_H_

#include <cstdint>

#include "src/dispatch/problem.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// One unit of work: query block q_block of every query batch in KV batch kv_b's group, against
// the keys [kv_begin, kv_end) of the concatenated axis (all of them unless the KV axis is split).
struct ItemRange {
  int64_t kv_batch = 0;
  int64_t q_block = 0;
  int64_t kv_begin = 0;
  int64_t kv_end = INT64_MAX;
};

// The unnormalized state of one KV split of one item, merged by merge_splits: per head and
// row, o (value_dim floats), then neg_max and sum.
inline int64_t partial_floats(const Problem& p) {
  return p.group * p.tiles.q_block * (p.value_dim + 2);
}

// Computes the item and writes its rows (output and statistics), or, with `partial`, stores its
// unnormalized state there (a KV split). Uses this thread's reusable scratch.
void run_work_item(const Problem& p, const simd::Ops& ops, const ItemRange& item, float* partial);

// What run_work_item computes for (kv_b, q_block) over the whole KV axis, counted as its
// sub-blocks plan it: (sub-block, tile) pairs per head and the query-key pairs computed.
struct ItemCounts {
  int64_t tiles_full = 0, tiles_masked = 0, tiles_skipped = 0;
  int64_t pairs_computed = 0;  // rows x computed columns, summed over sub-blocks
  int64_t pairs_useful = 0;    // unmasked (query, key) pairs
};
ItemCounts count_work_item(const Problem& p, int64_t kv_b, int64_t q_block);

// Merges the `splits` partial states of (kv_b, q_block), stored consecutively, in a fixed order
// (so the result does not depend on which thread ran which split) and writes the rows.
void merge_splits(const Problem& p, int64_t kv_b, int64_t q_block, const float* partials,
                  int64_t splits);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_ATTENTION_H_
