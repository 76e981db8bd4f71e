// The native kernels, one table (NativeOps) for the inputs the portable kernels would widen:
//   bfloat16  prefill's MM1 and MM2, and decode, on AVX512_BF16's vdpbf16ps, which multiplies
//             pairs of bfloat16 and adds both products to a float32 lane (64 FLOPs per zmm
//             instruction);
//   fp8       decode over float8_e4m3fn / float8_e5m2 caches on the same instruction, each code
//             converted exactly to bfloat16 in registers (decode_native_loads-inl.h);
//   int8      decode over int8 caches on AVX512_VNNI's vpdpwssd, the codes as int16.
// Highway 1.0.3 has no such ops on x86, so these are intrinsics of their own
// (shared/design/ARCHITECTURE.md), compiled for AVX-512 on every x86 build and used only where
// the CPU has AVX512_BF16 and AVX512_VNNI (src/core/cpu.h) and they pay (the policy in
// native_ops.cc).
//
// Layouts (bfloat16 pairs along the contraction, one uint32_t per pair, low half = even index):
//   Q2  [rows][ldq] uint16_t     query rows, unscaled; d2 = round_up(d, 2) entries, zero past d
//   K2  [d2 / 2][ldk] uint32_t   K2[x][c] = (K[2x][c], K[2x + 1][c]): the k_sb layout in pairs
//   P2  [rows][ldp] uint16_t     probabilities; pairs (P[2j], P[2j + 1]) adjacent
//   V2  [n2 / 2][ldv] uint32_t   V2[j][c] = (V[2j][c], V[2j + 1][c])
// The numbers: each product of two bfloat16 is exact in float32; vdpbf16ps adds the two of a
// pair to the accumulator with round-to-nearest and flushes denormals (inputs and result) to
// zero, where the widening path keeps them: a difference below 2^-126 in any score.
//
// Width contracts, as W2/W3 of ops.h with N = 16: qk reads K2 and writes S at columns
// [0, round_up(cols, 16)); pv reads V2 and reads and writes O over [0, dv_pad), dv_pad a
// multiple of 16.
#ifndef FLASHCTE_SRC_SIMD_NATIVE_OPS_H_
#define FLASHCTE_SRC_SIMD_NATIVE_OPS_H_

#include <cstdint>

#include "flashcte/flashcte.h"
#include "src/simd/decode_rows.h"

namespace flashcte::simd {

struct NativeOps {
  int64_t lanes;  // float32 lanes per vector: 16
  // The register tiles (native_ops.cc): rows per block and columns per panel of qk and of pv.
  int64_t qk_rows, qk_cols, pv_rows, pv_cols;

  // S[r][c] = scale * sum_{x < d2} Q2[r][x] K[x][c] for r < rows, c < cols, with the row max fused
  // as in Ops::qk (row_max may be null). d2 is even.
  void (*qk)(const uint16_t* q, int64_t ldq, int64_t rows, const uint32_t* k, int64_t ldk,
             int64_t cols, int64_t d2, float scale, float* s, int64_t lds, float* row_max);

  // O[r][:] = alpha[r] * O[r][:] + sum_{j < n2} P2[r][j] * V[j][:] over dv_pad columns; n2 is
  // even, alpha may be null (= 1).
  void (*pv)(const uint16_t* p, int64_t ldp, int64_t rows, int64_t n2, const uint32_t* v,
             int64_t ldv, int64_t dv_pad, const float* alpha, float* o, int64_t ldo);

  // Ops::exp_sum with round_bf16, P written as bfloat16 to p2 (s is only read), rounded by
  // vcvtneps2bf16: the same P bits and the same sum. Touches exactly [0, n) of s and p2.
  float (*exp_sum)(const float* s, int64_t n, float bias, uint16_t* p2);

  // Decode's Ops::decode_qk and decode_pv natively (decode_native-inl.h), for bfloat16 and 8-bit
  // caches (dtype), with Q as bfloat16 rows [rows][ldq], ldq >= round_up(d, 32), zero past d.
  // P is rounded to bfloat16 (exact when it holds bfloat16 values), or quantized to int16
  // against an int8 V.
  void (*decode_qk)(const uint16_t* q, int64_t ldq, int64_t rows, DecodeRows k, DType dtype,
                    int64_t n, int64_t d, float scale, float* s, int64_t lds);
  void (*decode_pv)(const float* p, int64_t ldp, int64_t rows, int64_t n, DecodeRows v, DType dtype,
                    int64_t dv, const float* alpha, float* o, int64_t ldo);
};

struct Ops;

// Whether bfloat16 inputs run on the native kernels or are widened to float32 for the Ops
// table's FMA kernels.
enum class Bf16Dot {
  kAuto,    // native where vdpbf16ps beats float32 FMA (native_ops.cc), widen elsewhere
  kNative,  // native wherever the CPU runs it
  kWiden,   // always widen
};

// The native kernels to pair with `ops` for bfloat16 inputs, or null to widen: null unless `ops`
// is an AVX-512 target's table and this CPU runs vdpbf16ps (AVX-512 F/BW/VL and AVX512_BF16,
// with the OS saving zmm state); then the policy decides. The environment variable
// FLASHCTE_BF16_DOT=native|widen|auto sets the policy when the process first asks.
const NativeOps* native_ops_for(const Ops& ops);

// Tests run both paths on one machine (not thread-safe: set it between calls).
void set_bf16_dot_policy_for_test(Bf16Dot policy);

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_NATIVE_OPS_H_
