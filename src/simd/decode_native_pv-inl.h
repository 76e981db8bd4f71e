// The native PV decode kernel (Pv), on the shared pieces and QK of decode_native-inl.h, whose
// top comment has the numbers and the fp8 and int8 rules.
//
// PV (Pv): O[r] = alpha[r] O[r] + sum_j P[r][j] V[j]. vdpbf16ps wants pairs along the
// contraction (keys): V rows j and j+1 are interleaved in registers (vpermt2w: 32 columns of
// both rows -> two vectors of 16 (V[j][c], V[j+1][c]) pairs) and P[r][j], P[r][j+1] go as one
// broadcast pair. P is already rounded to bfloat16 for bfloat16 inputs (Ops::exp_sum), so the
// pair is exact. Register tile R rows x G groups of 32 columns (2 accumulators each), R * 2G <= 16.
#ifndef FLASHCTE_SRC_SIMD_DECODE_NATIVE_PV_INL_H_
#define FLASHCTE_SRC_SIMD_DECODE_NATIVE_PV_INL_H_

#include <algorithm>
#include <cstdint>

#include "flashcte/flashcte.h"
#include "src/simd/decode_native-inl.h"
#include "src/simd/decode_rows.h"

#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#include <immintrin.h>

namespace flashcte::simd::decode_native {

// Keys per pass of pv_tile: the P pairs of its rows for this many keys are packed first.
constexpr int64_t kPvKeys = 64;

// P rows [R][n <= kPvKeys] (float32) as pairs (P[j], P[j + 1]) of
// bfloat16 bits in one 32-bit lane, pairs[r][j / 2], the second of an odd n zero: vcvtneps2bf16
// of 16 floats is exactly 8 such pairs. For a bfloat16 V the values are bfloat16 already and
// nothing rounds; for an fp8 V this is where P (times its per-token scale) rounds to nearest even.
template <int64_t R>
FLASHCTE_DECODE_NATIVE inline void pack_p_pairs(const float* p, int64_t ldp, int64_t n,
                                                uint32_t (*pairs)[kPvKeys / 2]) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 m = static_cast<__mmask16>(n - j >= kLanes ? 0xFFFF : (1u << (n - j)) - 1);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + r * ldp + j));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pairs[r][j / 2]), (__m256i)h);
    }
  }
}

// P rows [R][n <= kPvKeys] as int16 pairs (q[j], q[j + 1]) in one 32-bit lane, pairs[r][j / 2],
// the second of an odd n zero, for the integer kernels: q = round(P * 32767 / largest) with
// `largest` the row's largest |P|, and step[r] = largest / 32767 (an int32 lane of PV then sums
// 64 products of at most 32767 * 128: below 2^28). A row whose largest P is 0, or so small that
// 32767 / largest overflows (below 2^-113), gets step 0 and zero pairs: what it drops is under
// 64 * 2^-113 of the largest |V| (the bfloat16 kernels flush P below 2^-126 likewise). A row
// holding NaN or an infinity gets step NaN, so that its O becomes NaN, as it would.
template <int64_t R>
FLASHCTE_DECODE_NATIVE inline void pack_p_int16(const float* p, int64_t ldp, int64_t n,
                                                uint32_t (*pairs)[kPvKeys / 2], float* step) {
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    const float* row = p + r * ldp;
    // The largest |P| as bits: non-negative floats order as their bits, NaN above infinity.
    __m512i bits = _mm512_setzero_si512();
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 m = static_cast<__mmask16>(n - j >= kLanes ? 0xFFFF : (1u << (n - j)) - 1);
      bits = _mm512_maskz_max_epu32(
          kAll, bits, _mm512_castps_si512(_mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + j))));
    }
    const uint32_t top_bits = max_lane(bits);
    float largest = 0.0f;
    std::memcpy(&largest, &top_bits, sizeof largest);
    const float inverse = 32767.0f / largest;
    const bool usable = top_bits < 0x7F800000u && inverse <= std::numeric_limits<float>::max();
    step[r] = top_bits >= 0x7F800000u ? std::numeric_limits<float>::quiet_NaN()
              : usable                ? largest / 32767.0f
                                      : 0.0f;
    const __m512 scale = _mm512_set1_ps(usable ? inverse : 0.0f);
    for (int64_t j = 0; j < n; j += kLanes) {
      const __mmask16 m = static_cast<__mmask16>(n - j >= kLanes ? 0xFFFF : (1u << (n - j)) - 1);
      // Rounded to nearest even (MXCSR); |P| * 32767 / largest rounds to at most 32767.
      const __m512i q =
          _mm512_maskz_cvtps_epi32(kAll, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j), scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pairs[r][j / 2]),
                          _mm512_maskz_cvtsepi32_epi16(kAll, q));
    }
  }
}

// R rows x G groups of 32 columns (the last one holding `last_cols` <= 32 columns; with kHalf its
// upper 16 are past round_up(dv, 16) and are neither computed nor stored). Per pair of keys, V
// rows j and j + 1 are interleaved into pairs with in-lane vpunpcklwd / vpunpckhwd, which leave
// the columns of a 32-column group permuted within it: the accumulators hold O in that order
// (`lo` the 4-column pieces 0, 2, 4, 6 of the group, `hi` 1, 3, 5, 7), put there from O's order
// with one vpermt2ps each on entry and back on exit, 4 per row and group and call instead of 2
// cross-lane vpermt2w per pair of keys. A kHalf group (16 columns, no `hi`) interleaves with
// vpermt2w into O's order. P's pair is broadcast from packed pairs (a load, not a general
// register). Zen 4, one thread, 4 rows, d = 128, V in L1 (bench/micro_kernels decode_pv_bf16/4):
// 6.5 ns per key with vpermt2w and pairs built in scalar code, 5.8 ns so (medians of 5; the
// packed pairs alone gave 6.5). A key past n (odd n) has P = 0 and V = 0, never its row.
template <int64_t R, int64_t G, bool kHalf, class Load, class Rows>
FLASHCTE_DECODE_NATIVE inline void pv_tile(const float* p, int64_t ldp, int64_t n, const Rows& v,
                                           const Load& load, int64_t col, int64_t last_cols,
                                           const float* alpha, float* o, int64_t ldo,
                                           int64_t prefetch_bytes, int64_t ahead) {
  constexpr int64_t C = 2 * G - (kHalf ? 1 : 0);    // accumulators per row
  constexpr int64_t kUnpacked = kHalf ? G - 1 : G;  // groups interleaved in-lane
  // O's order -> the accumulators' (lanes of O's 16-column halves x, y; >= 16 selects y) and back.
  const __m512i to_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i to_hi =
      _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i from_x = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i from_y =
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  constexpr bool kInt = Load::kInt;
  __m512 acc[R][2 * G];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    if constexpr (kInt) {  // int32 sums per block of keys, added to O by `flush`
#pragma GCC unroll 16
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    } else {
      const __m512 al = _mm512_set1_ps(alpha ? alpha[r] : 1.0f);
#pragma GCC unroll 16
      for (int64_t c = 0; c < C; ++c) {
        acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + c * kLanes), al);
      }
#pragma GCC unroll 16
      for (int64_t g = 0; g < kUnpacked; ++g) {
        const __m512 x = acc[r][2 * g], y = acc[r][2 * g + 1];
        acc[r][2 * g] = _mm512_permutex2var_ps(x, to_lo, y);
        acc[r][2 * g + 1] = _mm512_permutex2var_ps(x, to_hi, y);
      }
    }
  }
  const __m512i lo_idx =
      _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __mmask32 last = static_cast<__mmask32>((uint64_t{1} << last_cols) - 1);
  alignas(64) uint32_t pairs[R][kPvKeys / 2];
  // One pair of keys j, j + 1: V rows a and b (b absent: zero) against P pairs[r][i].
  const auto step = [&](int64_t j, const unsigned char* a, const unsigned char* b,
                        int64_t i) FLASHCTE_DECODE_NATIVE {
    if (prefetch_bytes) {
      prefetch_lines<2>(v.prefetch_address(j + ahead), prefetch_bytes);
      prefetch_lines<2>(v.prefetch_address(j + ahead + 1), prefetch_bytes);
      prefetch_lines<3>(v.prefetch_address(j + kL1PrefetchRows), prefetch_bytes);
      prefetch_lines<3>(v.prefetch_address(j + kL1PrefetchRows + 1), prefetch_bytes);
    }
    __m512i vp[2 * G];
#pragma GCC unroll 16
    for (int64_t g = 0; g < G; ++g) {
      const __mmask32 m = g == G - 1 ? last : ~__mmask32{0};
      const __m512i va = load(a, 32 * g, m);
      const __m512i vb = b ? load(b, 32 * g, m) : _mm512_setzero_si512();
      if (g < kUnpacked) {
        vp[2 * g] = _mm512_unpacklo_epi16(va, vb);
        vp[2 * g + 1] = _mm512_unpackhi_epi16(va, vb);
      } else {
        vp[2 * g] = _mm512_permutex2var_epi16(va, lo_idx, vb);
      }
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const __m512i pr = _mm512_set1_epi32(static_cast<int>(pairs[r][i]));
#pragma GCC unroll 16
      for (int64_t c = 0; c < C; ++c) acc[r][c] = dot_pairs<kInt>(acc[r][c], pr, vp[c]);
    }
  };
  // The accumulators back in O's order (in place).
  const auto to_o_order = [&](int64_t r) FLASHCTE_DECODE_NATIVE {
#pragma GCC unroll 16
    for (int64_t g = 0; g < kUnpacked; ++g) {
      const __m512 lo = acc[r][2 * g], hi = acc[r][2 * g + 1];
      acc[r][2 * g] = _mm512_permutex2var_ps(lo, from_x, hi);
      acc[r][2 * g + 1] = _mm512_permutex2var_ps(lo, from_y, hi);
    }
  };
  // kInt: O[r] = a[r] O[r] + step[r] * sums (a = 1 without alpha), the sums zeroed.
  float step_of[R];
  const auto flush = [&](const float* a) FLASHCTE_DECODE_NATIVE {
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      to_o_order(r);
      const __m512 al = _mm512_set1_ps(a ? a[r] : 1.0f), st = _mm512_set1_ps(step_of[r]);
#pragma GCC unroll 16
      for (int64_t c = 0; c < C; ++c) {
        float* out = o + r * ldo + c * kLanes;
        const __m512 sums = _mm512_maskz_cvtepi32_ps(kAll, _mm512_castps_si512(acc[r][c]));
        _mm512_storeu_ps(out, _mm512_fmadd_ps(sums, st, _mm512_mul_ps(_mm512_loadu_ps(out), al)));
        acc[r][c] = _mm512_setzero_ps();
      }
    }
  };
  // kInt flushes every block of keys (its P steps are per block), and at least once (n = 0:
  // O = alpha O).
  for (int64_t j0 = 0; j0 < n || (kInt && j0 == 0); j0 += kPvKeys) {
    const int64_t keys = std::min(kPvKeys, n - j0), even = keys / 2 * 2;
    if constexpr (kInt) {
      pack_p_int16<R>(p + j0, ldp, keys, pairs, step_of);
    } else {
      pack_p_pairs<R>(p + j0, ldp, keys, pairs);
    }
    const int64_t offset = Load::kBytes * col;
    for (int64_t j = j0; j < j0 + even; j += 2) {
      step(j, v.template at<unsigned char>(j) + offset,
           v.template at<unsigned char>(j + 1) + offset, (j - j0) / 2);
    }
    if (even < keys) {
      step(j0 + even, v.template at<unsigned char>(j0 + even) + offset, nullptr, even / 2);
    }
    if constexpr (kInt) flush(j0 == 0 ? alpha : nullptr);
  }
  if constexpr (kInt) return;
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
    to_o_order(r);
#pragma GCC unroll 16
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + r * ldo + c * kLanes, acc[r][c]);
  }
}

// Rows [0, rows) of a panel of `groups` (1..G) groups, rows in blocks of R.
template <int64_t R, int64_t G, bool kHalf, class Load, class Rows>
FLASHCTE_DECODE_NATIVE inline void pv_rows(int64_t groups, const float* p, int64_t ldp,
                                           int64_t rows, int64_t n, const Rows& v, const Load& load,
                                           int64_t col, int64_t last_cols, const float* alpha,
                                           float* o, int64_t ldo, int64_t prefetch_bytes,
                                           int64_t ahead) {
  if constexpr (G >= 1) {
    if (groups != G) {
      pv_rows<R, G - 1, kHalf>(groups, p, ldp, rows, n, v, load, col, last_cols, alpha, o, ldo,
                               prefetch_bytes, ahead);
      return;
    }
    for (int64_t r = 0; r < rows; r += R) {
      const int64_t left = std::min(R, rows - r);
      const float* ar = alpha ? alpha + r : nullptr;
      const int64_t pf = r == 0 ? prefetch_bytes : 0;  // later row blocks find V in L1
      const float* pr = p + r * ldp;
      float* orow = o + r * ldo;
      if (left == R) {
        pv_tile<R, G, kHalf>(pr, ldp, n, v, load, col, last_cols, ar, orow, ldo, pf, ahead);
      } else if constexpr (R == 4) {
        if (left == 3) {
          pv_tile<3, G, kHalf>(pr, ldp, n, v, load, col, last_cols, ar, orow, ldo, pf, ahead);
        } else if (left == 2) {
          pv_tile<2, G, kHalf>(pr, ldp, n, v, load, col, last_cols, ar, orow, ldo, pf, ahead);
        } else {
          pv_tile<1, G, kHalf>(pr, ldp, n, v, load, col, last_cols, ar, orow, ldo, pf, ahead);
        }
      }
    }
  }
}

// O over [0, round_up(dv, 16)), V rows read at [0, dv).
template <int64_t R, class Load, class Rows>
FLASHCTE_DECODE_NATIVE inline void pv_with(const float* p, int64_t ldp, int64_t rows, int64_t n,
                                           const Rows& v, const Load& load, int64_t dv,
                                           const float* alpha, float* o, int64_t ldo) {
  constexpr int64_t G = 8 / R;  // R * 2G = 16 accumulators
  const int64_t row_bytes = Load::kBytes * dv;
  const int64_t ahead = prefetch_rows(v.prefetch_bytes, row_bytes);
  const int64_t groups = (dv + 31) / 32;
  for (int64_t g0 = 0; g0 < groups; g0 += G) {
    const int64_t width = std::min(G, groups - g0);
    const int64_t last_cols = std::min<int64_t>(32, dv - 32 * (g0 + width - 1));
    const int64_t pf = g0 == 0 ? row_bytes : 0;  // the first panel prefetches whole rows
    float* og = o + 32 * g0;
    if (last_cols <= 16) {
      pv_rows<R, G, true>(width, p, ldp, rows, n, v, load, 32 * g0, last_cols, alpha, og, ldo, pf,
                          ahead);
    } else {
      pv_rows<R, G, false>(width, p, ldp, rows, n, v, load, 32 * g0, last_cols, alpha, og, ldo, pf,
                           ahead);
    }
  }
}

// V rows of `dtype` (bfloat16 or an 8-bit format). P is rounded to bfloat16 as it is packed
// (already bfloat16 values for a bfloat16 V: then nothing rounds); against an int8 V it is
// quantized to int16 per row and 64 keys (pack_p_int16).
FLASHCTE_DECODE_NATIVE inline void Pv(const float* p, int64_t ldp, int64_t rows, int64_t n,
                                      DecodeRows v, DType dtype, int64_t dv, const float* alpha,
                                      float* o, int64_t ldo) {
  if (rows <= 0) return;
  // Every row block at 4 rows (or all the rows): a V pair is interleaved once per 4 rows.
  with_load(dtype, [&](const auto& load) FLASHCTE_DECODE_NATIVE {
    with_rows(v, [&](const auto& vr) FLASHCTE_DECODE_NATIVE {
      if (rows >= 3) {
        pv_with<4>(p, ldp, rows, n, vr, load, dv, alpha, o, ldo);
      } else if (rows == 2) {
        pv_with<2>(p, ldp, rows, n, vr, load, dv, alpha, o, ldo);
      } else {
        pv_with<1>(p, ldp, rows, n, vr, load, dv, alpha, o, ldo);
      }
    });
  });
}

}  // namespace flashcte::simd::decode_native

#endif  // HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#endif  // FLASHCTE_SRC_SIMD_DECODE_NATIVE_PV_INL_H_
