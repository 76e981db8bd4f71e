// The kernels' way out: a finished float32 row (SoftmaxState::finish) into the caller's output
// tensor, shared by the prefill (attention.cc) and decode (decode.cc) kernels.
#ifndef FLASHCTE_SRC_KERNEL_OUTPUT_H_
#define FLASHCTE_SRC_KERNEL_OUTPUT_H_

#include <cstdint>

#include "flashcte/flashcte.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// n float32 values as a row of the output, element c at base[offset + c * stride] in dtype,
// bit for bit as store_row_from_float (src/core/convert.h). A contiguous bfloat16 row goes
// through the vector rounding (Ops::round_bf16) instead of that function's SSE2 loop. Zen 4
// EPYC, AVX3, bf16 causal, d=128: perf, 1 thread, S=4096, AttentionKernel::run's own cycles
// 1.25% -> 0.57% plus 0.22% in RoundBf16; 2 threads, 8 interleaved process pairs, S=4096 8
// heads 1.003-1.004, S=512 32 heads 1.016-1.026 (the per-row work weighs more on short rows).
void store_output_row(const simd::Ops& ops, void* base, int64_t offset, int64_t stride, DType dtype,
                      const float* src, int64_t n);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_OUTPUT_H_
