// flash_attn_varlen_kvcache (include/flashcte/kvcache.h): a mixed batch of variable-length query
// chunks over each sequence's cache. The whole call is checked into one request
// (varlen_validate.cc), whose sequences the router (step.h) sends to the kernel each one's length
// calls for: the decode kernel for a few queries, attention_cte for a longer chunk. Every
// kernel's work runs in one parallel region (src/schedule/region.h), split by estimated cost.
// plan_varlen_kvcache (varlen_plan_api.cc) keeps those problems, the step.
#include <utility>

#include "flashcte/kvcache.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/kvcache.h"
#include "src/dispatch/varlen.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {

Status plan_step(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                 const MutableTensorView& out, const MutableTensorView& lse,
                 const VarlenKvCacheOptions& options, Step* step) {
  KvCacheRequest request;
  FLASHCTE_RETURN_IF_ERROR(
      validate_varlen_kvcache(q, k_cache, v_cache, out, lse, options, &request));
  route(std::move(request), step);
  return Status::Ok();
}

}  // namespace flashcte::internal

namespace flashcte {

Status flash_attn_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                                 const TensorView& v_cache, const MutableTensorView& out,
                                 const MutableTensorView& lse,
                                 const VarlenKvCacheOptions& options) {
  return internal::guarded("the call's scratch", [&]() -> Status {
    internal::Step step;
    FLASHCTE_RETURN_IF_ERROR(internal::plan_step(q, k_cache, v_cache, out, lse, options, &step));
    internal::run_step(step, options.num_threads, options.profile);
    return Status::Ok();
  });
}

}  // namespace flashcte
