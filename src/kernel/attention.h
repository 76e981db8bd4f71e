// The attention_cte recurrence for one work item: one query block of every query head that
// shares KV batch kv_b (the GQA group), streamed against that batch's KV tiles.
#ifndef FLASHCTE_SRC_KERNEL_ATTENTION_H_
#define FLASHCTE_SRC_KERNEL_ATTENTION_H_

#include <cstdint>

#include "src/dispatch/problem.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// Computes rows [q_block * tiles.q_block, ...) of every query batch in KV batch kv_b's group and
// writes them (output and statistics). Uses this thread's reusable scratch.
void run_work_item(const Problem& p, const simd::Ops& ops, int64_t kv_b, int64_t q_block);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_ATTENTION_H_
