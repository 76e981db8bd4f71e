// attention_cte on rank-4 q, k, v and out: a batch of independent attention_cte problems along
// axis 0, each entry b the rank-3 call on entry b of every argument, all run in one parallel
// region (src/schedule/region.h). FlashAttention's (batch, seqlen, heads, d) is such a batch
// through strides ((batch, heads, seqlen, d) transposed), which the heads axis cannot fold into
// the rank-3 call's bs axis: without this, callers looped over the batch in Python.
//
// Every tensor argument then carries the batch axis first, entry b being what the rank-3 call of
// problem b takes (a stride of 0 shares one across the batch): k_prior / v_prior and their
// scales (dense), prior_block_table, sink, bound_min, bound_max, alibi_slopes, key_bias and the
// statistics. The paged prior's pools and their scales are shared (the block tables choose the
// pages), as is prior_used_len.
#ifndef FLASHCTE_SRC_DISPATCH_BATCH_H_
#define FLASHCTE_SRC_DISPATCH_BATCH_H_

#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/problem.h"

namespace flashcte::internal {

// Checks the whole call (the batch axis of every argument, outputs that overlap an input or
// another entry's output), then validates each entry as the rank-3 call; problems[b] is entry
// b's. Errors of an entry end in " (batch entry b)".
Status validate_batch(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Outputs& outputs, const Options& options,
                      std::vector<Problem>* problems);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_BATCH_H_
