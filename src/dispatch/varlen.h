// flash_attn_varlen_kvcache's checked step (varlen_kvcache_api.cc), which its plan keeps and runs
// in every layer (varlen_plan_api.cc).
#ifndef FLASHCTE_SRC_DISPATCH_VARLEN_H_
#define FLASHCTE_SRC_DISPATCH_VARLEN_H_

#include <vector>

#include "flashcte/kvcache.h"
#include "src/core/problem.h"
#include "src/kernel/decode.h"

namespace flashcte::internal {

// Each sequence with query rows as its kernel's problem: a validated mixed batch.
struct VarlenStep {
  std::vector<DecodeProblem> decodes;
  std::vector<Problem> prefills;
};

// Checks the whole call (every rule of flash_attn_varlen_kvcache) and fills the step.
Status plan_step(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                 const MutableTensorView& out, const MutableTensorView& lse,
                 const VarlenKvCacheOptions& options, VarlenStep* step);

// Runs every kernel of the step in one parallel region.
void run_step(const VarlenStep& step, int threads, ThreadProfile* profile);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_VARLEN_H_
