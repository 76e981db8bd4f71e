// flashcte merge: two attention results over disjoint sets of keys combined into the result over
// their union, the primitive of every split of the KV axis (ring attention, context parallelism,
// a prefix cache attended separately, a long KV axis cut into chunks).
//
// Each input is a finished (normalized) state, as attention_cte and flash_attn_func return it:
// per query row, `out` is the softmax-weighted sum of the values of its keys and `lse` the
// log-sum-exp of their scores (a sink counts as a key of the side it was given to). A row that
// saw no key has out 0 and lse -inf. The merged row is
//   lse = log(exp(lse_a) + exp(lse_b))
//   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b
// computed with the library's own KV-split merge (SoftmaxState, src/kernel/softmax_state.h):
// each side is the state (neg_max = -lse, sum = 1, O = out), the two are merged and finished. In
// float32 that is, per row with M = max(lse_a, lse_b): the larger side weighs exactly 1, the
// other exp(min - M) (one exp), sum = 1 + that weight, out = O * (1 / sum) and
// lse = M + log(sum): a few float32 roundings per element, so |out - exact| stays within a few
// ulp of max(|out_a|, |out_b|) and |lse - exact| within a few ulp of max(|lse|, 1)
// (tests/merge_test.cc measures both against float64). Empty rows need no special casing by the
// caller: with lse_a = -inf the result is (out_b, lse_b) value for value, likewise for b, and
// with both empty it is (0, -inf). A NaN in either side's lse or out gives NaN; so does lse = +inf
// (FlashAttention's CUDA kernels store +inf for empty rows: map it to -inf first).
#ifndef FLASHCTE_MERGE_H_
#define FLASHCTE_MERGE_H_

#include "flashcte/flashcte.h"

namespace flashcte {

// Merges (out_a, lse_a) and (out_b, lse_b) into (out, lse). Shapes, all sides alike:
//   out_a, out_b, out   (rows, dv), (batch, rows, dv) or (batch, heads, rows, dv)
//   lse_a, lse_b, lse   (rows,),    (batch, rows)     or (batch, heads, rows)
// (attention_cte's (bs, Sq, dv) and lse (bs, Sq), and their rank-4 batch). Any strides
// (elements), so FlashAttention's (batch, seqlen, heads, dv) output is one call on its
// (batch, heads, seqlen, dv) view with its (batch, heads, seqlen) lse.
// dtypes: out_a, out_b and out each float32, bfloat16 or float16 (16-bit inputs are widened,
// a 16-bit out is rounded once, to nearest even); lse_a, lse_b and lse float32. lse is optional
// (an absent view). out may be exactly out_a or exactly out_b (same data, dtype, shape and
// strides: accumulation in place), lse exactly lse_a or lse_b; any other overlap of an output with
// an input or with the other output is an error.
// Cost: one pass over the rows on the calling thread, reading 2 dv + 2 and writing dv + 1 values
// per row, O(dv) arithmetic and one exp and one log: memory-bound, and negligible next to the
// attention calls that produced the two sides (2 (d + dv) FLOP per row and key).
Status merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                         const TensorView& lse_b, const MutableTensorView& out,
                         const MutableTensorView& lse);

}  // namespace flashcte

#endif  // FLASHCTE_MERGE_H_
