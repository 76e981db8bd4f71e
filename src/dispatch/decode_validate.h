// Argument validation of decode_attention (include/flashcte/decode.h): every rule checked once,
// each failure reported as "<argument>: <rule>", and the DecodeProblem the kernel reads filled in.
#ifndef FLASHCTE_SRC_DISPATCH_DECODE_VALIDATE_H_
#define FLASHCTE_SRC_DISPATCH_DECODE_VALIDATE_H_

#include "flashcte/decode.h"
#include "src/kernel/decode.h"

namespace flashcte::internal {

Status validate_decode(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                       const TensorView& positions, const DecodeOutputs& outputs,
                       const DecodeOptions& options, DecodeProblem* problem);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_DECODE_VALIDATE_H_
