// The oracle: a plain float64 implementation of shared/spec/SEMANTICS.md, written for clarity
// and nothing else. It shares no code with the kernel (not even argument parsing), reads inputs
// of any dtype exactly, and materializes each score row. Every test compares against it.
#ifndef FLASHCTE_SRC_REFERENCE_REFERENCE_H_
#define FLASHCTE_SRC_REFERENCE_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte::reference {

struct Result {
  int64_t batch = 0, seqlen_q = 0, value_dim = 0;
  std::vector<double> out;        // (bs, Sq, dv) row-major, whatever tp_out says
  std::vector<double> neg_max;    // (bs, Sq): -max_j S[i, j] (sink included); +inf if empty
  std::vector<double> sum_recip;  // (bs, Sq): 1 / sum_j exp(S - max); +inf if empty
  std::vector<double> lse;        // (bs, Sq): max + log(sum); -inf if empty
  double out_at(int64_t b, int64_t i, int64_t c) const {
    return out[(b * seqlen_q + i) * value_dim + c];
  }
};

// The function of SEMANTICS.md in float64. Options are read as attention_cte reads them
// (tiles and num_threads are ignored). Returns an error only for inputs it cannot interpret.
Status attention(const TensorView& q, const TensorView& k, const TensorView& v,
                 const Options& options, Result* result);

// A plain same-precision implementation (what a framework does without a flash kernel in
// bf16/fp16): S = q.k^T accumulated in float32 and rounded to the dtype, softmax in float32
// rounded to the dtype, P.V accumulated in float32 and rounded to the dtype. Its error against
// `attention` is the yardstick for the low-precision tolerance (FlashAttention's rule: ours may
// be at most twice as far off). For float32 inputs it is a plain float32 implementation.
Status attention_plain(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Options& options, Result* result);

// The same two functions restricted to the query rows `rows` (each in [0, Sq), any order), for
// every batch: the Result has seqlen_q = rows.size() and its row r is query row rows[r]. The
// oracle costs O(Sq * Skv * d); big test shapes check a sample of rows instead of all of them.
Status attention_rows(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Options& options, const std::vector<int64_t>& rows, Result* result);
Status attention_plain_rows(const TensorView& q, const TensorView& k, const TensorView& v,
                            const Options& options, const std::vector<int64_t>& rows,
                            Result* result);

// Element `offset` (in elements) of `data`, read as the exact value its dtype encodes.
double load_element(const void* data, DType dtype, int64_t offset);

// `x` rounded to the nearest value representable in `dtype` (float32, bfloat16 or float16):
// ties to even, subnormals kept, overflow to +-inf, NaN passes through.
double round_to_dtype(double x, DType dtype);

}  // namespace flashcte::reference

#endif  // FLASHCTE_SRC_REFERENCE_REFERENCE_H_
