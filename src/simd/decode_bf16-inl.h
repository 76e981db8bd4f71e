// The decode matmuls on AVX512_BF16's vdpbf16ps, for bfloat16 caches (decode_qk-inl.h and
// decode_pv-inl.h have the portable ones). Highway 1.0.3 has no bf16 dot product on x86, so these
// are intrinsics compiled once, outside the per-target code, with their own target attribute; they
// run only where simd::bf16_dot_for (bf16_dot.h) says the CPU has the instruction and it pays (AMD
// Zen 4/5: the native dot is twice the fp32 FMA rate; an Intel Xeon widens).
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
// PV (Pv): O[r] = alpha[r] O[r] + sum_j P[r][j] V[j]. vdpbf16ps wants pairs along the
// contraction (keys): V rows j and j+1 are interleaved in registers (vpermt2w: 32 columns of
// both rows -> two vectors of 16 (V[j][c], V[j+1][c]) pairs) and P[r][j], P[r][j+1] go as one
// broadcast pair. P is already rounded to bfloat16 for bfloat16 inputs (Ops::exp_sum), so the
// pair is exact. Register tile R rows x G groups of 32 columns (2 accumulators each), R * 2G <= 16.
//
// fp8 caches (float8_e4m3fn, float8_e5m2) run on the same kernels: every code's value is a
// bfloat16 value (e4m3's 4 significant bits, e5m2's 3, within bfloat16's exponent range, the fp8
// subnormals normal there), so each loaded row converts exactly to bfloat16 in registers (Fp8Load)
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
#ifndef FLASHCTE_SRC_SIMD_DECODE_BF16_INL_H_
#define FLASHCTE_SRC_SIMD_DECODE_BF16_INL_H_

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
#include "src/simd/decode_rows.h"

#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#include <immintrin.h>

namespace flashcte::simd::decode_bf16 {

// AVX512_VNNI for the int8 kernels: every CPU with AVX512_BF16 has it (Cooper Lake, Sapphire
// Rapids, Zen 4 and 5), and bf16_dot.cc's check asks for both.
#define FLASHCTE_DECODE_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

constexpr int64_t kLanes = 16;
// GCC 12 warns that the unmasked _mm512_shuffle_* read an undefined vector (fixed in GCC 13); the
// zero-masked forms with every lane selected compute the same.
constexpr __mmask16 kAll = 0xFFFF;

// How the kernels load the 32 elements [x, x + 32) of a cache row (those outside the mask m as
// 0), exactly: as bfloat16 bits (a bfloat16 row as it is, an fp8 one converted), or with kInt as
// int16 (int8 codes sign-extended) for the integer kernels.
struct Bf16Load {
  static constexpr int64_t kBytes = 2;
  static constexpr bool kInt = false;
  FLASHCTE_DECODE_BF16 __m512i operator()(const unsigned char* row, int64_t x, __mmask32 m) const {
    return _mm512_maskz_loadu_epi16(m, row + 2 * x);
  }
};

struct Int8Load {
  static constexpr int64_t kBytes = 1;
  static constexpr bool kInt = true;
  FLASHCTE_DECODE_BF16 __m512i operator()(const unsigned char* row, int64_t x, __mmask32 m) const {
    return _mm512_maskz_cvtepi8_epi16(~__mmask32{0}, _mm256_maskz_loadu_epi8(m, row + x));
  }
};

// The bfloat16 bits of an fp8 format's 128 magnitudes (NaN 0x7FC0, e5m2's infinity 0x7F80).
template <DType kFormat>
const uint16_t* fp8_bf16_table() {
  alignas(64) static const auto table = [] {
    std::array<uint16_t, 128> t{};
    for (int code = 0; code < 128; ++code) {
      uint32_t bits = 0;
      const float value = kv8::decode(kFormat, static_cast<uint8_t>(code));
      std::memcpy(&bits, &value, sizeof bits);
      t[static_cast<size_t>(code)] = static_cast<uint16_t>(bits >> 16);  // exact: see the top
    }
    return t;
  }();
  return table.data();
}

// fp8: the magnitude's (7 bits) bfloat16 bits from the table (two vpermi2w of 64 entries, bit 6
// choosing), the code's sign bit OR-ed in: 7 operations per 32 codes.
struct Fp8Load {
  static constexpr int64_t kBytes = 1;
  static constexpr bool kInt = false;
  __m512i t0, t1, t2, t3;  // table entries 0-31, 32-63, 64-95, 96-127
  FLASHCTE_DECODE_BF16 explicit Fp8Load(const uint16_t* table)
      : t0(_mm512_loadu_si512(table)),
        t1(_mm512_loadu_si512(table + 32)),
        t2(_mm512_loadu_si512(table + 64)),
        t3(_mm512_loadu_si512(table + 96)) {}
  FLASHCTE_DECODE_BF16 __m512i operator()(const unsigned char* row, int64_t x, __mmask32 m) const {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, row + x));
    const __m512i low = _mm512_permutex2var_epi16(t0, w, t1);  // index bits 0-5
    const __m512i high = _mm512_permutex2var_epi16(t2, w, t3);
    const __mmask32 upper = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
    // magnitude | (code << 8 & 0x8000): ternary-logic A | (B & C).
    return _mm512_ternarylogic_epi32(_mm512_mask_blend_epi16(upper, low, high),
                                     _mm512_slli_epi16(w, 8),
                                     _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
  }
};

// Calls body(load) with the load of a cache dtype (bfloat16 or an 8-bit format).
template <class Body>
FLASHCTE_DECODE_BF16 inline void with_load(DType dtype, const Body& body) {
  switch (dtype) {
    case DType::kBFloat16:
      body(Bf16Load());
      break;
    case DType::kInt8:
      body(Int8Load());
      break;
    case DType::kFloat8E4M3:
      body(Fp8Load(fp8_bf16_table<DType::kFloat8E4M3>()));
      break;
    case DType::kFloat8E5M2:
      body(Fp8Load(fp8_bf16_table<DType::kFloat8E5M2>()));
      break;
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      HWY_ABORT("decode_bf16: %s rows are not bfloat16-exact", dtype_name(dtype));
  }
}

// a + b lane by lane: float32, or with kInt the int32 sums the integer kernels keep in __m512
// registers (the shuffles below move bits, whatever they hold).
template <bool kInt>
FLASHCTE_DECODE_BF16 inline __m512 add_lanes(__m512 a, __m512 b) {
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
FLASHCTE_DECODE_BF16 inline __m512 sum_ladder(__m512* v) {
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
FLASHCTE_DECODE_BF16 inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  if constexpr (kInt) {
    return _mm512_castsi512_ps(_mm512_dpwssd_epi32(_mm512_castps_si512(acc), a, b));
  } else {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
}

// The largest of the 16 unsigned lanes of v (GCC 12's _mm512_reduce_max_epu32 reads an undefined
// vector: see kAll).
FLASHCTE_DECODE_BF16 inline uint32_t max_lane(__m512i v) {
  alignas(64) uint32_t lanes[kLanes];
  _mm512_store_si512(lanes, v);
  return *std::max_element(lanes, lanes + kLanes);
}

// Lanes [0, 16) of `x` (bfloat16 bits) as float32.
FLASHCTE_DECODE_BF16 inline __m512 bf16_to_float(__m256i x) {
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
FLASHCTE_DECODE_BF16 inline float quantize_q_row(const uint16_t* q, int64_t d32, int32_t top,
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
FLASHCTE_DECODE_BF16 inline void qk_rows(const uint16_t* q, int64_t ldq, int64_t rows, int64_t r0,
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
      prefetch_lines<2>(k.prefetch_address(j0 + c + ahead), row_bytes);
      prefetch_lines<3>(k.prefetch_address(j0 + c + kL1PrefetchRows), row_bytes);
    }
    // Step by step along d, all K keys at once: R * K independent accumulator chains hide the
    // vdpbf16ps latency that key by key (R chains) left exposed (4 rows, d = 128, K in L1, Zen 4:
    // 14.8 -> 12.9 ns per key, both before the in-lane ladder).
    const auto step = [&](int64_t x, __mmask32 m) FLASHCTE_DECODE_BF16 {
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
FLASHCTE_DECODE_BF16 inline void Qk(const uint16_t* q, int64_t ldq, int64_t rows, DecodeRows k,
                                    DType dtype, int64_t n, int64_t d, float scale, float* s,
                                    int64_t lds) {
  with_load(dtype, [&](const auto& load) FLASHCTE_DECODE_BF16 {
    using Load = std::decay_t<decltype(load)>;
    const int64_t row_bytes = Load::kBytes * d;
    const int64_t ahead = prefetch_rows(k.prefetch_bytes, row_bytes);
    with_rows(k, [&](const auto& kr) FLASHCTE_DECODE_BF16 {
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t left = rows - r0;  // 3 rows take a 4-row tile, as in decode_qk-inl.h
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

// Keys per pass of pv_tile: the P pairs of its rows for this many keys are packed first.
constexpr int64_t kPvKeys = 64;

// P rows [R][n <= kPvKeys] (float32) as pairs (P[j], P[j + 1]) of
// bfloat16 bits in one 32-bit lane, pairs[r][j / 2], the second of an odd n zero: vcvtneps2bf16
// of 16 floats is exactly 8 such pairs. For a bfloat16 V the values are bfloat16 already and
// nothing rounds; for an fp8 V this is where P (times its per-token scale) rounds to nearest even.
template <int64_t R>
FLASHCTE_DECODE_BF16 inline void pack_p_pairs(const float* p, int64_t ldp, int64_t n,
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
FLASHCTE_DECODE_BF16 inline void pack_p_int16(const float* p, int64_t ldp, int64_t n,
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
FLASHCTE_DECODE_BF16 inline void pv_tile(const float* p, int64_t ldp, int64_t n, const Rows& v,
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
                        int64_t i) FLASHCTE_DECODE_BF16 {
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
  const auto to_o_order = [&](int64_t r) FLASHCTE_DECODE_BF16 {
#pragma GCC unroll 16
    for (int64_t g = 0; g < kUnpacked; ++g) {
      const __m512 lo = acc[r][2 * g], hi = acc[r][2 * g + 1];
      acc[r][2 * g] = _mm512_permutex2var_ps(lo, from_x, hi);
      acc[r][2 * g + 1] = _mm512_permutex2var_ps(lo, from_y, hi);
    }
  };
  // kInt: O[r] = a[r] O[r] + step[r] * sums (a = 1 without alpha), the sums zeroed.
  float step_of[R];
  const auto flush = [&](const float* a) FLASHCTE_DECODE_BF16 {
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
FLASHCTE_DECODE_BF16 inline void pv_rows(int64_t groups, const float* p, int64_t ldp, int64_t rows,
                                         int64_t n, const Rows& v, const Load& load, int64_t col,
                                         int64_t last_cols, const float* alpha, float* o,
                                         int64_t ldo, int64_t prefetch_bytes, int64_t ahead) {
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
FLASHCTE_DECODE_BF16 inline void pv_with(const float* p, int64_t ldp, int64_t rows, int64_t n,
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
FLASHCTE_DECODE_BF16 inline void Pv(const float* p, int64_t ldp, int64_t rows, int64_t n,
                                    DecodeRows v, DType dtype, int64_t dv, const float* alpha,
                                    float* o, int64_t ldo) {
  if (rows <= 0) return;
  // Every row block at 4 rows (or all the rows): a V pair is interleaved once per 4 rows.
  with_load(dtype, [&](const auto& load) FLASHCTE_DECODE_BF16 {
    with_rows(v, [&](const auto& vr) FLASHCTE_DECODE_BF16 {
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

}  // namespace flashcte::simd::decode_bf16

#endif  // HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#endif  // FLASHCTE_SRC_SIMD_DECODE_BF16_INL_H_
