// The row softmax of the `materialized` benchmark peer, kept in its own file because it is
// compiled with -ffast-math: that is what lets GCC call glibc's vector expf (libmvec), as
// the softmax a framework runs would be vectorized too. A scalar-exp baseline would flatter us.
#ifndef FLASHCTE_TOOLS_BENCH_SOFTMAX_H_
#define FLASHCTE_TOOLS_BENCH_SOFTMAX_H_

#include <cstdint>

namespace flashcte::tools {

// In place over a rows x cols row-major matrix (leading dimension ld): row i becomes the softmax
// of its first valid(i) entries and zero after them, where valid(i) = min(i + 1, cols) when
// causal (query i sees keys 0..i) and cols otherwise. Rows are split over `threads` threads.
void MaskedSoftmaxRows(float* s, int64_t rows, int64_t cols, int64_t ld, bool causal, int threads);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_BENCH_SOFTMAX_H_
