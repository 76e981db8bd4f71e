// The native decode matmuls, QK here and PV in decode_native_pv-inl.h, each cache kind read as
// decode_native_loads-inl.h says: bfloat16 and fp8 caches on AVX512_BF16's vdpbf16ps, int8 caches
// on AVX512_VNNI's vpdpwssd (decode_qk-inl.h and decode_pv-inl.h have the portable kernels).
// Highway 1.0.3 has no bf16 dot product on x86, so these are intrinsics compiled once, outside the
// per-target code, with their own target attribute; they run only where simd::native_ops_for
// (native_ops.h) says the CPU has the instruction and it pays (AMD Zen 4/5: the native dot is twice
// the fp32 FMA rate; an Intel Xeon widens).
//
// QK (Qk): S[r][j] = scale * sum_x Q2[r][x] K[j][x], Q2 the query rows as bfloat16 (exact: the
// inputs are bfloat16) and K the cache rows as they are. One vdpbf16ps multiplies 32 bfloat16
// pairs of a Q row and a K row and adds each pair's two products into one of 16 float32 lanes, so
// a dot product along d = 128 is 4 instructions where the portable path converts 8 K vectors and
// issues 8 FMAs. Register tile R x 16/R keys as in decode_qk-inl.h, stepping along d with all the
// tile's keys at once (R * K independent chains: key by key, the vdpbf16ps latency showed), and
// an in-lane ladder for the sums. Column tails are masked loads (fault-suppressing), no copies.
//
// Measured alone (one thread, 4 rows, d = 128, K / V in L1, Zen 4): QK 9.3 ns per key against
// 13.4 for the portable kernel, PV 6.5 against 10.5; a cold decode call on 2 threads reads
// 25.9 GB/s of K/V against 20.4 widened (32/8 heads, 32768 tokens, read bandwidth ~32 GB/s).
//
// PV (Pv): decode_native_pv-inl.h.
//
// fp8 caches (float8_e4m3fn, float8_e5m2) run on the same kernels: every code's value is a
// bfloat16 value (e4m3's 4 significant bits, e5m2's 3, within bfloat16's exponent range, the fp8
// subnormals normal there), so each loaded row converts exactly to bfloat16 in registers (Fp8Load,
// decode_native_loads-inl.h)
// and the products stay exact. The 8-bit rows are read at half the bytes, and the vdpbf16ps
// arithmetic is the bfloat16 cache's.
//
// int8 caches run on integers (AVX512_VNNI's vpdpwssd: 32 int16 products per instruction, pairs
// added into int32 lanes, as vdpbf16ps): a row's codes are sign-extended to int16 (one vpmovsxbw
// per 32, where converting them to bfloat16 took five and made int8 decode compute-bound). The
// other operand is quantized to int16 per row: QK's query rows by their largest |q| (qk_rows),
// PV's probabilities by their largest P per 64 keys (pack_p_int16), rounded to nearest; the int32
// sums convert to float32 once, times the row's step. The one error beyond the bfloat16 kernels'
// is that rounding: at most half a step, 2^-16 of the row's largest |q| or P (2^-15 at d > 512,
// where the step doubles to keep QK's sums within int32), against bfloat16's 2^-9 of each value.
//
// The numbers: products of two bfloat16 are exact in float32; vdpbf16ps rounds each addition to
// nearest and flushes subnormal inputs and results to zero, where the portable path keeps them: a
// difference below 2^-126 per product. Width contracts as decode_qk / decode_pv (ops.h) with
// N = 16, except that Q2 is read over [0, round_up(d, 32)) (zero past d).
#ifndef FLASHCTE_SRC_SIMD_DECODE_NATIVE_INL_H_
#define FLASHCTE_SRC_SIMD_DECODE_NATIVE_INL_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "flashcte/flashcte.h"
#include "hwy/base.h"
#include "hwy/detect_targets.h"
#include "src/core/kv8.h"
#include "src/simd/decode_native_loads-inl.h"
#include "src/simd/decode_rows.h"

#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#include <immintrin.h>

namespace flashcte::simd::decode_native {

// a + b lane by lane: float32, or with kInt the int32 sums the integer kernels keep in __m512
// registers (the shuffles below move bits, whatever they hold).
template <bool kInt>
FLASHCTE_DECODE_NATIVE inline __m512 add_lanes(__m512 a, __m512 b) {
  if constexpr (kInt) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  } else {
    return _mm512_add_ps(a, b);
  }
}

// Lane i of the result = the sum of v[i]'s 16 lanes (clobbers v). Two in-block levels (vshufps:
// lanes 0 + 1 and 2 + 3 of each 128-bit block of a pair of vectors), then two across blocks
// (vshuff32x4): 45 three-operand shuffles and adds, no register copies, where the ConcatEven /
// ConcatOdd ladder of decode_qk-inl.h costs a copy per vpermt2ps (Zen 4, one thread, 4 rows,
// d = 128, K in L1: QK 12.8 -> 9.3 ns per key).
template <bool kInt>
FLASHCTE_DECODE_NATIVE inline __m512 sum_ladder(__m512* v) {
  // v[2i], v[2i+1] -> per block [a0+a1, a2+a3, b0+b1, b2+b3].
#pragma GCC unroll 8
  for (int64_t i = 0; i < 8; ++i) {
    v[i] = add_lanes<kInt>(_mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0x88),
                           _mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0xDD));
  }
  // -> per block [sum a, sum b, sum c, sum d] of that block, sources 4i .. 4i + 3.
#pragma GCC unroll 4
  for (int64_t i = 0; i < 4; ++i) {
    v[i] = add_lanes<kInt>(_mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0x88),
                           _mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0xDD));
  }
  // Blocks: v[i] block k holds block k's partials of sources 4i .. 4i + 3; sum the 4 blocks.
#pragma GCC unroll 2
  for (int64_t i = 0; i < 2; ++i) {
    v[i] = add_lanes<kInt>(_mm512_maskz_shuffle_f32x4(kAll, v[2 * i], v[2 * i + 1], 0x88),
                           _mm512_maskz_shuffle_f32x4(kAll, v[2 * i], v[2 * i + 1], 0xDD));
  }
  return add_lanes<kInt>(_mm512_maskz_shuffle_f32x4(kAll, v[0], v[1], 0x88),
                         _mm512_maskz_shuffle_f32x4(kAll, v[0], v[1], 0xDD));
}

// acc + the pairwise products of a and b: vdpbf16ps on bfloat16 pairs, or with kInt vpdpwssd on
// int16 pairs into int32 lanes (exact: see qk_int_max and pack_p_int16).
template <bool kInt>
FLASHCTE_DECODE_NATIVE inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  if constexpr (kInt) {
    return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), a, b));
  } else {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
}

// The largest of the 16 unsigned lanes of v (GCC 12's _mm512_reduce_max_epu32 reads an undefined
// vector: see kAll).
FLASHCTE_DECODE_NATIVE inline uint32_t max_lane(__m512i v) {
  alignas(64) uint32_t lanes[kLanes];
  _mm512_store_si512(lanes, v);
  return *std::max_element(lanes, lanes + kLanes);
}

// Lanes [0, 16) of `x` (bfloat16 bits) as float32.
FLASHCTE_DECODE_NATIVE inline __m512 bf16_to_float(__m256i x) {
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, x), 16));
}

// The longest Q2 row the integer QK quantizes (on the stack): the API's head dim limit.
constexpr int64_t kQkIntMaxDim = (kMaxHeadDim + 31) / 32 * 32;

// The largest |q| an int16 query element takes for head dim d, so that QK's int32 sums (d
// products of at most that times 128, int8's -128) stay below 2^31: 32767 up to d = 512, 16383
// to 1024.
inline int32_t qk_int_max(int64_t d) {
  const int64_t pairs = (d + 31) / 32 * 32;  // Q2 is read over round_up(d, 32), zero past d
  return static_cast<int32_t>(std::min<int64_t>(32767, ((int64_t{1} << 31) - 1) / (128 * pairs)));
}

// Row q of Q2 (bfloat16 bits over [0, d32), zero past d) as int16 q16 = round(q / step) with
// |q16| <= top and the step returned: top / max |q|; 0 for a zero row (every q16 0), NaN for a
// row holding NaN or an infinity (every q16 0, so each score of the row is NaN, as it would be).
FLASHCTE_DECODE_NATIVE inline float quantize_q_row(const uint16_t* q, int64_t d32, int32_t top,
                                                   int16_t* q16) {
  // The largest |q| as bits: non-negative floats order as their bits, NaN above infinity.
  __m512i bits = _mm512_setzero_si512();
  for (int64_t x = 0; x < d32; x += 16) {
    const __m512 v = bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + x)));
    bits = _mm512_maskz_max_epu32(kAll, bits, _mm512_castps_si512(_mm512_abs_ps(v)));
  }
  const uint32_t top_bits = max_lane(bits);
  float largest = 0.0f;
  std::memcpy(&largest, &top_bits, sizeof largest);
  if (top_bits == 0 || top_bits >= 0x7F800000u) {
    std::memset(q16, 0, static_cast<size_t>(d32) * sizeof(int16_t));
    return top_bits == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const __m512 inverse = _mm512_set1_ps(static_cast<float>(top) / largest);
  for (int64_t x = 0; x < d32; x += 16) {
    const __m512 v = bf16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + x)));
    // Rounded to nearest even (MXCSR); top / largest * |q| rounds to at most top.
    const __m256i w = _mm512_maskz_cvtsepi32_epi16(
        kAll, _mm512_maskz_cvtps_epi32(kAll, _mm512_mul_ps(v, inverse)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + x), w);
  }
  return largest / static_cast<float>(top);
}

// Rows [r0, r0 + R) of S (the last ones clamped to rows - 1 and not stored) against every key,
// kLanes / R keys per step: R x K accumulators, one ladder, and each row's K sums stored from
// their lanes (compressed to the front of a register, then one masked store: no call to memcpy).
// One loop over the keys, so the per-step setup is only the K row pointers and their prefetch.
// Zen 4, one thread, 4 rows, d = 128, K in L1 (bench/micro_kernels decode_qk_bf16/4): 10.4 ns
// per key as one call per step with a memcpy of the sums, 7.7 ns as this loop (medians of 5).
// With an int8 K (Load::kInt) the rows are first quantized to int16 (quantize_q_row), and each
// score is its int32 sum times the row's step and `scale`.
template <int64_t R, class Load, class Rows>
FLASHCTE_DECODE_NATIVE inline void qk_rows(const uint16_t* q, int64_t ldq, int64_t rows, int64_t r0,
                                           const Rows& k, const Load& load, int64_t n, int64_t d,
                                           float scale, float* s, int64_t lds, int64_t ahead) {
  constexpr int64_t K = kLanes / R;
  constexpr bool kInt = Load::kInt;
  const int64_t full = d / 32 * 32, row_bytes = Load::kBytes * d;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (d - full)) - 1);
  // The query operand's rows, and the factor of each lane r * K + c of the sums.
  const void* qr[R];
  __m512 vscale = _mm512_set1_ps(scale);
  alignas(64) int16_t q16[kInt ? R : 1][kInt ? kQkIntMaxDim : 1];
  if constexpr (kInt) {
    const int64_t d32 = (d + 31) / 32 * 32;
    HWY_DASSERT(d32 <= kQkIntMaxDim);
    alignas(64) float lane_scale[kLanes];
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const float step =
          quantize_q_row(q + std::min(r0 + r, rows - 1) * ldq, d32, qk_int_max(d), q16[r]);
      qr[r] = q16[r];
      for (int64_t c = 0; c < K; ++c) lane_scale[r * K + c] = scale * step;
    }
    vscale = _mm512_load_ps(lane_scale);
  } else {
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) qr[r] = q + std::min(r0 + r, rows - 1) * ldq;
  }
  for (int64_t j0 = 0; j0 < n; j0 += K) {
    __m512 acc[kLanes];
#pragma GCC unroll 16
    for (int64_t i = 0; i < kLanes; ++i) acc[i] = _mm512_setzero_ps();
    const unsigned char* kr[K];
#pragma GCC unroll 16
    for (int64_t c = 0; c < K; ++c) {
      kr[c] = k.template at<unsigned char>(std::min(j0 + c, n - 1));
      if (ahead == 0) continue;
      prefetch_lines<2>(k.prefetch_address(j0 + c + ahead), row_bytes);
      prefetch_lines<3>(k.prefetch_address(j0 + c + kL1PrefetchRows), row_bytes);
    }
    // Step by step along d, all K keys at once: R * K independent accumulator chains hide the
    // vdpbf16ps latency that key by key (R chains) left exposed (4 rows, d = 128, K in L1, Zen 4:
    // 14.8 -> 12.9 ns per key, both before the in-lane ladder).
    const auto step = [&](int64_t x, __mmask32 m) FLASHCTE_DECODE_NATIVE {
      __m512i kv[K];
#pragma GCC unroll 16
      for (int64_t c = 0; c < K; ++c) kv[c] = load(kr[c], x, m);
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        const __m512i qv = _mm512_loadu_si512(static_cast<const uint16_t*>(qr[r]) + x);
#pragma GCC unroll 16
        for (int64_t c = 0; c < K; ++c) acc[r * K + c] = dot_pairs<kInt>(acc[r * K + c], qv, kv[c]);
      }
    };
    for (int64_t x = 0; x < full; x += 32) step(x, ~__mmask32{0});
    if (tail) step(full, tail);
    // Lane r * K + c holds row r0 + r's score of key j0 + c.
    __m512 sums = sum_ladder<kInt>(acc);
    if constexpr (kInt) sums = _mm512_maskz_cvtepi32_ps(kAll, _mm512_castps_si512(sums));
    sums = _mm512_mul_ps(sums, vscale);
    const __mmask16 keys = static_cast<__mmask16>((1u << std::min(K, n - j0)) - 1);
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      if (r0 + r >= rows) break;
      const __mmask16 lanes = static_cast<__mmask16>(((1u << K) - 1) << (r * K));
      _mm512_mask_storeu_ps(s + (r0 + r) * lds + j0, keys, _mm512_maskz_compress_ps(lanes, sums));
    }
  }
}

// Q2 [rows][ldq] bfloat16 (ldq >= round_up(d, 32), zero past d), K rows of d elements of
// `dtype` (bfloat16 or an 8-bit format).
FLASHCTE_DECODE_NATIVE inline void Qk(const uint16_t* q, int64_t ldq, int64_t rows, DecodeRows k,
                                      DType dtype, int64_t n, int64_t d, float scale, float* s,
                                      int64_t lds) {
  with_load(dtype, [&](const auto& load) FLASHCTE_DECODE_NATIVE {
    using Load = std::decay_t<decltype(load)>;
    const int64_t row_bytes = Load::kBytes * d;
    const int64_t first_ahead = prefetch_rows(k.prefetch_bytes, row_bytes);
    with_rows(k, [&](const auto& kr) FLASHCTE_DECODE_NATIVE {
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t left = rows - r0;  // 3 rows take a 4-row tile, as in decode_qk-inl.h
        // Only the first row block prefetches (decode_qk-inl.h); 0 prefetches nothing.
        const int64_t ahead = r0 == 0 ? first_ahead : 0;
        if (left >= 3) {
          qk_rows<4>(q, ldq, rows, r0, kr, load, n, d, scale, s, lds, ahead);
        } else if (left == 2) {
          qk_rows<2>(q, ldq, rows, r0, kr, load, n, d, scale, s, lds, ahead);
        } else {
          qk_rows<1>(q, ldq, rows, r0, kr, load, n, d, scale, s, lds, ahead);
        }
      }
    });
  });
}

}  // namespace flashcte::simd::decode_native

#endif  // HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#endif  // FLASHCTE_SRC_SIMD_DECODE_NATIVE_INL_H_
