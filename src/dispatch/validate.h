// Argument validation: the one place that reads the caller's tensors and options. Everything
// below dispatch reads the Problem it fills and never re-validates.
#ifndef FLASHCTE_SRC_DISPATCH_VALIDATE_H_
#define FLASHCTE_SRC_DISPATCH_VALIDATE_H_

#include "flashcte/flashcte.h"
#include "src/core/problem.h"

namespace flashcte::internal {

// Checks every argument against the rules of SEMANTICS.md and the API; fills `problem`.
// With `shapes_only`, q/k/v/out data may be null (for plan_attention).
Status validate(const TensorView& q, const TensorView& k, const TensorView& v,
                const Outputs& outputs, const Options& options, bool shapes_only, Problem* problem);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_VALIDATE_H_
