// decode_attention (include/flashcte/decode.h): validate once, then hand the problem to the
// decode schedule.
#include <algorithm>
#include <exception>
#include <new>
#include <string>

#include "flashcte/decode.h"
#include "src/dispatch/decode_validate.h"
#include "src/dispatch/guarded.h"
#include "src/kernel/decode.h"
#include "src/schedule/decode_schedule.h"

namespace flashcte {

Status decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                        const TensorView& positions, const DecodeOutputs& outputs,
                        const DecodeOptions& options) {
  return internal::guarded("decode scratch or partial states", [&]() -> Status {
    internal::DecodeProblem problem;
    Status s =
        internal::validate_decode(q, k_cache, v_cache, positions, outputs, options, &problem);
    if (!s.ok) return s;
    internal::run_decode(internal::DecodeKernel(problem));
    return Status::Ok();
  });
}

}  // namespace flashcte
