// The vector building blocks of the kernel, one table per instruction set. The kernel layer
// fetches the table once per call (ops()) and calls through it per tile: each call does at least
// a few thousand FLOPs, so the indirect call costs nothing measurable, and tests can switch the
// Highway target between calls (hwy::SetSupportedTargetsForTest) to cover every target.
//
// The bodies live one kernel family per file, each compiled once per Highway target:
//   mm1-inl.h          MM1, S = Q.K (qk)
//   mm2-inl.h          MM2, O = alpha O + P.V (pv)
//   softmax-inl.h      row max, the fused exp-and-sum
//   elementwise-inl.h  softcap, ALiBi, key bias, the finiteness check
//   convert-inl.h      bfloat16 / float16 to float32, float32 to the native bf16 layouts
//   native_ops.cc        the native bfloat16 MM1 and MM2 (AVX512_BF16 intrinsics), and when to
//                      use them
//   ops.cc             the per-target table and the run-time dispatch
//
// All buffers are float32 and packed by the kernel layer (float32 V that has the V tile's layout
// already is read in place):
//   Q block  [rows][ldq]      row-major, one query row per row
//   K tile   [d][ldk]         transposed, key j of the tile in column j (the Neuron k_sb (d, 512))
//   S / P    [rows][lds]      scores, then probabilities in place
//   V tile   [n][ldv]         row-major, key j in row j (the Neuron v_sb (128, d))
//   O        [rows][ldo]      float32 accumulators of one head
//
// ---- Width contracts (the only place they are stated; each target's code static_asserts the
// ---- ones that depend on its lane count N, so a target that breaks one does not compile)
//
//   W1  kPadFloats is a multiple of every compiled target's N (floats per vector) and at least
//       one 64-byte cache line. padded(n) rounds n up to it.
//   W2  qk reads K and writes S in whole vectors: columns [0, round_up(cols, N)) of each row,
//       i.e. at most N - 1 <= kPadFloats - 1 floats past `cols`. Callers give K and S a leading
//       dimension of at least (column offset + cols) + kPadFloats: leading_dim() does.
//       Q is read at [0, d) of each row only.
//   W3  pv reads V rows [0, n) and reads and writes O over columns [0, dv_pad), dv_pad a
//       multiple of kPadFloats (hence of N, W1) and at most the leading dimension; it touches
//       nothing past dv_pad. Columns [dv, dv_pad) of V must be finite (the kernel zeroes them).
//       P is read at [0, n) of each row.
//   W4  row_max, exp_sum, softcap, alibi, add, classify, to_float, from_float,
//       narrow_bf16, interleave_bf16 and pair_bf16 touch exactly [0, n): their tails run one
//       lane at a time.
//   W5  qk's register block is `rows` (Ops::mm_rows) rows; any row count is allowed.
// tests/simd/ checks each op against these extents with NaN canaries on every target the CPU
// runs.
#ifndef FLASHCTE_SRC_SIMD_OPS_H_
#define FLASHCTE_SRC_SIMD_OPS_H_

#include <cstdint>

#include "flashcte/flashcte.h"
#include "hwy/detect_targets.h"
#include "src/simd/decode_rows.h"

namespace flashcte::simd {

// The longest vector the kernels use, in bytes (shared-inl.h's DF). SVE (and RVV) allow vectors
// of up to 256 bytes, which would make the column padding unit below 64 floats; no SVE CPU goes
// past 64 bytes (A64FX 512 bits; Neoverse V1 and Graviton 3 256; Neoverse N2/V2 and Graviton 4
// 128), so the kernels cap their vectors there and keep x86's padding of 16 floats. What the wider
// unit would cost, measured with it forced on x86 (FLASHCTE_TEST_PAD_FLOATS=64, Intel Xeon,
// AVX3, fp32 prefill, 1 thread): 1.23x the time at d = 80, which it pads to 128 instead of 80;
// d = 128 unchanged (docs/benchmarks/README.md, "aarch64").
inline constexpr int64_t kMaxVectorBytes = 64;

// Bytes of the widest vector the kernels use on any target compiled into this build (HWY_TARGETS
// is the set foreach_target compiles). Every x86 build compiles AVX3 (AVX-512), so this is 64
// there even on a CPU without AVX-512; so it is on aarch64, whose builds compile SVE.
inline constexpr int64_t kWidestVectorBytes =
    (HWY_TARGETS & (HWY_AVX3 | HWY_AVX3_DL | HWY_SVE | HWY_SVE2 | HWY_RVV)) ? kMaxVectorBytes
    : (HWY_TARGETS & (HWY_AVX2 | HWY_SVE_256 | HWY_WASM_EMU256))            ? 32
                                                                            : 16;
inline constexpr int64_t kCacheLineBytes = 64;

// Column padding unit (W1): the widest vector or one cache line, whichever is larger. 16 floats
// on x86: one AVX-512 vector, two AVX2 vectors.
// FLASHCTE_TEST_PAD_FLOATS exists for one test only (tests/simd: a unit narrower than a target's
// vector must fail that target's static_assert, so the contract is seen to be checked).
#ifdef FLASHCTE_TEST_PAD_FLOATS
inline constexpr int64_t kPadFloats = FLASHCTE_TEST_PAD_FLOATS;
#else
inline constexpr int64_t kPadFloats =
    (kWidestVectorBytes > kCacheLineBytes ? kWidestVectorBytes : kCacheLineBytes) /
    static_cast<int64_t>(sizeof(float));
#endif

inline constexpr int64_t padded(int64_t n) {
  return (n + kPadFloats - 1) / kPadFloats * kPadFloats;
}
// Row stride of at least n floats (n a multiple of kPadFloats) that is an odd number of cache
// lines. The micro-kernels read a column panel down the rows of a packed buffer; with a stride of
// an even number of lines those rows map to a fraction of L1's 64 sets (V at dv = 128, 8 lines:
// 8 sets x 8 ways = 64 lines, so a 256-row panel never stays in L1; Zen 3, MM2 alone 80-85 -> 88
// GFLOP/s). On AVX-512 (Zen 4 EPYC, same L1 geometry) the whole kernel did not notice it either
// way: plain strides against odd ones, S=4096 d=128 MHA, 2 threads, 8 interleaved process pairs,
// fp32 1.002 and bf16 1.000; it stays for the CPUs where it pays.
inline constexpr int64_t odd_cache_lines(int64_t n) {
  constexpr int64_t kLineFloats = kCacheLineBytes / static_cast<int64_t>(sizeof(float));
  return (n / kLineFloats) % 2 == 1 ? n : n + kLineFloats;
}
// Leading dimension of a K or S buffer of n columns: room for qk's whole-vector overrun (W2).
inline constexpr int64_t leading_dim(int64_t n) { return odd_cache_lines(padded(n) + kPadFloats); }

// Ops::classify's findings.
inline constexpr unsigned kNonFinite = 1, kSubnormal = 2;

struct Ops {
  const char* target;
  int64_t target_bits;  // the Highway target (HWY_AVX3, ...)
  int64_t lanes;        // N: floats per vector of this target
  int64_t mm_rows;      // rows of the MM1 / MM2 register block

  // MM1: S[r][c] = sum_k Q[r][k] * K[k][c] for r < rows, c < cols (Q pre-scaled); see W2 for
  // what it may touch past cols. With row_max non-null, also
  // row_max[r] = max(row_max[r], max_{c < cols} S[r][c]): the row max fused into the epilogue.
  void (*qk)(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t ldk, int64_t cols,
             int64_t d, float* s, int64_t lds, float* row_max);

  // max_c s[c] for c < n (n >= 1); -inf when every entry is -inf.
  float (*row_max)(const float* s, int64_t n);

  // The fused exp-and-sum (the Neuron activation_reduce): s[c] = exp(s[c] + bias) in place for
  // c < n, returning the sum of the results. A NaN score stays NaN (so do the sum and the row's
  // output). bias is the negated running max, so the shift is the FMA's addend. With
  // round_bf16, the stored values are rounded to bfloat16 (as the Neuron engine's P feeding MM2)
  // while the sum keeps float32 values.
  float (*exp_sum)(float* s, int64_t n, float bias, bool round_bf16);

  // Score modifiers, applied to one row of a tile after MM1 (Options order):
  //   s[c] = cap * tanh(s[c] / cap);  s[c] -= slope * |dist0 + c|;  s[c] += bias[c].
  void (*softcap)(float* s, int64_t n, float cap);
  void (*alibi)(float* s, int64_t n, float slope, float dist0);
  void (*add)(float* s, const float* bias, int64_t n);
  // s[c] *= scale[c]: an 8-bit cache's per-key scales on scores or probabilities.
  void (*mul)(float* s, const float* scale, int64_t n);

  // Which of kNonFinite (NaN, Inf) and kSubnormal occur among x[i], i < n: the first takes the
  // kernel's rare exact path for such values, both keep the native bf16 kernels (which flush
  // subnormals) off the data.
  unsigned (*classify)(const float* x, int64_t n);

  // dst[i] = float(src[i]) for i < n, src contiguous of dtype float32, bfloat16 or float16
  // (F16C on x86), or an 8-bit cache format (the codes' values, unscaled). Used by the packers,
  // which run once per tile.
  void (*to_float)(const void* src, DType dtype, int64_t n, float* dst);
  // The way back, for the output rows: dst[i] = src[i] as dtype for i < n, dst contiguous;
  // bfloat16 and float16 rounded to nearest even with half::float_to_bf16's and
  // half::float_to_f16's bits (NaNs quieted).
  void (*from_float)(const float* src, DType dtype, int64_t n, void* dst);

  // For the native bfloat16 kernels (native_ops.h), from float32 that holds bfloat16 values
  // (packed from bfloat16 inputs, or P rounded by exp_sum; then both are exact):
  //   narrow_bf16      dst[i] = bf16(src[i]) for i < n
  //   interleave_bf16  dst[i] = the pair (bf16(lo[i]), bf16(hi[i])), low half first, for i < n;
  //                    a null lo or hi reads as zeros
  void (*narrow_bf16)(const float* src, int64_t n, uint16_t* dst);
  void (*interleave_bf16)(const float* lo, const float* hi, int64_t n, uint32_t* dst);
  // The same pairs from rows of bfloat16 bits: dst[i] = lo[i] | hi[i] << 16 for i < n (a null
  // row reads as zeros); returns whether any value read is non-finite or subnormal.
  bool (*pair_bf16)(const uint16_t* lo, const uint16_t* hi, int64_t n, uint32_t* dst);

  // MM2 with the rescale folded in: O[r][:] = alpha[r] * O[r][:] + sum_{j<n} P[r][j] * V[j][:]
  // for r < rows, over dv_pad columns (W3). alpha may be null (= 1).
  void (*pv)(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv,
             int64_t dv_pad, const float* alpha, float* o, int64_t ldo);

  // Decode (decode_qk-inl.h, decode_pv-inl.h): a few query rows against K / V rows read in place
  // from a KV cache of `dtype` (float32, bfloat16 or float16), unit stride along the head dim, each
  // row where its DecodeRows entry says (a dense cache and a paged one differ only in that table);
  // nothing packed, nothing widened outside registers.
  //   decode_qk  S[r][j] = scale * sum_{x < d} Q[r][x] K[j][x] for r < rows, j < n. Reads K at
  //              columns [0, d) of rows [0, n) only; Q [rows][ldq] float32 over
  //              [0, round_up(d, N)), which must be finite past d; writes S at rows [0, rows) x
  //              columns [0, n) exactly.
  //   decode_pv  O[r][:] = alpha[r] O[r][:] + sum_{j < n} P[r][j] V[j][:] for r < rows. Reads V
  //              at columns [0, dv) of rows [0, n) only, P at [0, n) of each row; reads and
  //              writes O over [0, round_up(dv, N)), touching nothing past it. alpha may be null
  //              (= 1).
  // Each score and each O element is computed the same way wherever its rows are, so a result
  // over a paged cache is bitwise the one over the same rows in a dense cache.
  void (*decode_qk)(const float* q, int64_t ldq, int64_t rows, DecodeRows k, DType dtype, int64_t n,
                    int64_t d, float scale, float* s, int64_t lds);
  void (*decode_pv)(const float* p, int64_t ldp, int64_t rows, int64_t n, DecodeRows v, DType dtype,
                    int64_t dv, const float* alpha, float* o, int64_t ldo);
  // The native bfloat16 kernels of prefill and decode are not here: native_ops_for(*this)
  // (native_ops.h) gives them where the CPU runs them and the policy wants them.
};

// The table for the best target Highway supports on this CPU (respecting
// hwy::SetSupportedTargetsForTest).
const Ops& ops();

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_OPS_H_
