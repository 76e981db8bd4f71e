// The vector building blocks of the kernel, one table per instruction set. The kernel layer
// fetches the table once per call (ops()) and calls through it per tile: each call does at least
// a few thousand FLOPs, so the indirect call costs nothing measurable, and tests can switch the
// Highway target between calls (hwy::SetSupportedTargetsForTest) to cover every target.
//
// All buffers are float32 and packed by the kernel layer:
//   Q block  [rows][ldq]      row-major, one query row per row
//   K tile   [d][ldk]         transposed, key j of the tile in column j (the Neuron k_sb (d, 512))
//   S / P    [rows][lds]      scores, then probabilities in place
//   V tile   [n][ldv]         row-major, key j in row j (the Neuron v_sb (128, d))
//   O        [rows][ldo]      float32 accumulators of one head
// Leading dimensions are multiples of kPadFloats plus kPadFloats of margin, so that a kernel may
// read and write whole vectors past the last valid column (see each function).
#ifndef FLASHCTE_SRC_SIMD_OPS_H_
#define FLASHCTE_SRC_SIMD_OPS_H_

#include <cstdint>

#include "flashcte/flashcte.h"

namespace flashcte::simd {

// Column padding unit: 16 floats = one 64-byte cache line = two AVX2 or one AVX-512 vector, so
// every target's whole vectors fit inside the padding.
inline constexpr int64_t kPadFloats = 16;

inline int64_t padded(int64_t n) { return (n + kPadFloats - 1) / kPadFloats * kPadFloats; }
// Row stride of at least n floats (n a multiple of kPadFloats) that is an odd number of cache
// lines. The micro-kernels read a column panel down the rows of a packed buffer; with a stride of
// an even number of lines those rows map to a fraction of L1's 64 sets (V at dv = 128, 8 lines:
// 8 sets x 8 ways = 64 lines, so a 256-row panel never stays in L1).
inline int64_t odd_lines(int64_t n) { return (n / kPadFloats) % 2 == 1 ? n : n + kPadFloats; }
// Leading dimension for n columns that kernels may overrun by up to one vector.
inline int64_t leading_dim(int64_t n) { return odd_lines(padded(n) + kPadFloats); }

struct Ops {
  const char* target;

  // MM1: S[r][c] = sum_k Q[r][k] * K[k][c] for r < rows, c < cols (Q pre-scaled). May also
  // write columns up to the next vector multiple of cols (callers use only [0, cols)) and reads
  // K the same way. With row_max non-null, also row_max[r] = max(row_max[r], max_c S[r][c]):
  // the row max fused into MM1's epilogue.
  void (*qk)(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t ldk, int64_t cols,
             int64_t d, float* s, int64_t lds, float* row_max);

  // max_c s[c] for c < n (n >= 1); -inf when every entry is -inf.
  float (*row_max)(const float* s, int64_t n);

  // The fused exp-and-sum (the Neuron activation_reduce): s[c] = exp(s[c] + bias) in place for
  // c < n, returning the sum of the results. A NaN score stays NaN (so do the sum and the row's
  // output): Highway's Exp alone would turn it into 0. bias is the negated running max, so the
  // shift is the FMA's addend. With round_bf16, the stored values are rounded to bfloat16 (as the
  // Neuron engine's P feeding MM2) while the sum keeps float32 values. Writes exactly n entries.
  float (*exp_sum)(float* s, int64_t n, float bias, bool round_bf16);

  // Score modifiers, applied to one row of a tile after MM1 (Options order):
  //   s[c] = cap * tanh(s[c] / cap);  s[c] -= slope * |d0 + c|;  s[c] += bias[c].
  void (*softcap)(float* s, int64_t n, float cap);
  void (*alibi)(float* s, int64_t n, float slope, float d0);
  void (*add)(float* s, const float* bias, int64_t n);

  // True when no x[i], i < n, is NaN or Inf (the kernel's rare exact path for such values).
  bool (*all_finite)(const float* x, int64_t n);

  // dst[i] = float(src[i]) for i < n, src contiguous of dtype float32, bfloat16 or float16
  // (F16C on x86). Used by the packers, which run once per tile.
  void (*to_float)(const void* src, DType dtype, int64_t n, float* dst);

  // MM2 with the rescale folded in: O[r][:] = alpha[r] * O[r][:] + sum_{j<n} P[r][j] * V[j][:]
  // for r < rows, over dv_pad columns (a multiple of kPadFloats). alpha may be null (= 1).
  void (*pv)(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv,
             int64_t dv_pad, const float* alpha, float* o, int64_t ldo);
};

// The table for the best target Highway supports on this CPU (respecting
// hwy::SetSupportedTargetsForTest).
const Ops& ops();

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_OPS_H_
