// flash_attn_varlen_kvcache's checked step (varlen_kvcache_api.cc), which its plan keeps and runs
// in every layer (varlen_plan_api.cc).
#ifndef FLASHCTE_SRC_DISPATCH_VARLEN_H_
#define FLASHCTE_SRC_DISPATCH_VARLEN_H_

#include "flashcte/kvcache.h"
#include "src/dispatch/step.h"

namespace flashcte::internal {

// Checks the whole call (every rule of flash_attn_varlen_kvcache) and fills the step.
Status plan_step(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                 const MutableTensorView& out, const MutableTensorView& lse,
                 const VarlenKvCacheOptions& options, Step* step);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_VARLEN_H_
