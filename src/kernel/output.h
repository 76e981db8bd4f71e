// The kernels' way out: a finished float32 row (SoftmaxState::finish) into the caller's output
// tensor, shared by the prefill (attention.cc) and decode (decode.cc) kernels.
#ifndef FLASHCTE_SRC_KERNEL_OUTPUT_H_
#define FLASHCTE_SRC_KERNEL_OUTPUT_H_

#include <cstdint>

#include "flashcte/flashcte.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// n float32 values as a row of the output, element c at base[offset + c * stride] in dtype,
// bit for bit as store_row_from_float (src/core/convert.h). A contiguous row goes through
// Ops::from_float, whose bfloat16 and float16 roundings are vectors where that function loops
// over scalars. Zen 4 EPYC, AVX3, d=128, 2 threads, 8 interleaved process pairs each (the per-row
// work weighs more on short rows):
//   bf16 causal: S=4096 8 heads 1.003-1.004, S=512 32 heads 1.016-1.026 (perf, 1 thread,
//     S=4096: AttentionKernel::run's own cycles 1.25% -> 0.57% plus 0.22% in RoundBf16);
//   fp16: S=512 32 heads causal 1.11-1.12 (twice), S=4096 8 heads causal 1.007-1.019,
//     non-causal 1.00-1.02 (store_output_row was 0.8% of a non-causal run).
void store_output_row(const simd::Ops& ops, void* base, int64_t offset, int64_t stride, DType dtype,
                      const float* src, int64_t n);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_OUTPUT_H_
