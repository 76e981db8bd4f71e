// decode_attention (include/flashcte/decode.h): validate once into a step of one decode
// problem, then run it.
#include "flashcte/decode.h"
#include "src/dispatch/decode_validate.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/step.h"

namespace flashcte {

Status decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                        const TensorView& positions, const DecodeOutputs& outputs,
                        const DecodeOptions& options) {
  return internal::guarded("decode scratch or partial states", [&]() -> Status {
    internal::Step step;
    step.decodes.resize(1);
    Status s = internal::validate_decode(q, k_cache, v_cache, positions, outputs, options,
                                         &step.decodes[0]);
    if (!s.ok) return s;
    internal::run_step(step, options.num_threads);
    return Status::Ok();
  });
}

}  // namespace flashcte
