// The prefix of an attention_cte call (Options' prefix caching): part of validate() (validate.h),
// in a file of its own.
#ifndef FLASHCTE_SRC_DISPATCH_PREFIX_VALIDATE_H_
#define FLASHCTE_SRC_DISPATCH_PREFIX_VALIDATE_H_

#include "flashcte/flashcte.h"
#include "src/core/problem.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {

// The bytes the prefix's views address, for validate()'s aliasing check.
struct PrefixExtents {
  Extent k_prior, v_prior, k_prior_scale, v_prior_scale;
};

// k_prior and v_prior (laid out like k and v, or in pages with prior_block_table, whose pages of
// every used slot are checked in range and copied), prior_used_len, and k_prior_scale /
// v_prior_scale (required with an 8-bit prior, refused otherwise). Needs the Problem's shapes
// (validate.cc's read_shapes) first.
Status read_prefix(const Options& options, bool shapes_only, Problem* problem,
                   PrefixExtents* extents);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_PREFIX_VALIDATE_H_
