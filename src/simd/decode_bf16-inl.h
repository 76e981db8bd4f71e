// The decode matmuls on AVX512_BF16's vdpbf16ps, for bfloat16 caches (decode-inl.h has the
// portable ones). Highway 1.0.3 has no bf16 dot product on x86, so these are intrinsics compiled
// once, outside the per-target code, with their own target attribute; they run only where
// simd::bf16_dot_for (bf16_dot.h) says the CPU has the instruction and it pays (AMD Zen 4/5: the
// native dot is twice the fp32 FMA rate; an Intel Xeon widens).
//
// QK (Qk): S[r][j] = scale * sum_x Q2[r][x] K[j][x], Q2 the query rows as bfloat16 (exact: the
// inputs are bfloat16) and K the cache rows as they are. One vdpbf16ps multiplies 32 bfloat16
// pairs of a Q row and a K row and adds each pair's two products into one of 16 float32 lanes, so
// a dot product along d = 128 is 4 instructions where the portable path converts 8 K vectors and
// issues 8 FMAs. Register tile R x 16/R keys as in decode-inl.h, stepping along d with all the
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
// 8-bit caches (int8, float8_e4m3fn, float8_e5m2) run on the same kernels: every code's value is
// a bfloat16 value (int8's at most 7 significant bits, e4m3's 4 and e5m2's 3, all within
// bfloat16's exponent range, the fp8 subnormals normal there), so each loaded row converts
// exactly to bfloat16 in registers (the loads below) and the products stay exact. The 8-bit rows
// are read at half the bytes, and the vdpbf16ps arithmetic is the bfloat16 cache's.
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
#include <type_traits>

#include "hwy/base.h"
#include "hwy/detect_targets.h"
#include "src/core/kv8.h"
#include "src/simd/decode_rows.h"

namespace flashcte::simd {

// Rows ahead that are also requested into L1 (prefetcht0), besides the L2 requests
// the rows' prefetch_bytes ahead (decode_rows.h), by both kernels. A paged cache's rows come in
// runs of a page (4 KiB per head at 16 slots of bfloat16, d = 128), and at every run the L1
// prefetcher starts over; this keeps the next rows' lines arriving. Zen 5 EPYC, 2 threads, 32/8
// heads, 32768 cached tokens, cold, 3 rounds of 7 reps, bf16 native: pages of 16 went from 7.4-7.9
// to 4.7-5.8 ms per call and the dense cache from 4.5-4.8 to 3.8-5.3 ms (8 rows; only the table
// form: pages 5.1-5.9, dense unchanged).
inline constexpr int64_t kL1PrefetchRows = 8;

}  // namespace flashcte::simd

#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#include <immintrin.h>
#define FLASHCTE_DECODE_HAVE_BF16 1

namespace flashcte::simd::decode_bf16 {

#define FLASHCTE_DECODE_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int64_t kLanes = 16;
// GCC 12 warns that the unmasked _mm512_shuffle_* read an undefined vector (fixed in GCC 13); the
// zero-masked forms with every lane selected compute the same.
constexpr __mmask16 kAll = 0xFFFF;

// One L2 prefetch (prefetcht1) per cache line of [p, p + bytes); nothing for p = 0 (no row
// there: prefetch_address of decode_rows.h).
FLASHCTE_DECODE_BF16 inline void prefetch_row(uintptr_t p, int64_t bytes) {
  if (p == 0) return;
  for (uintptr_t a = p & ~uintptr_t{63}; a < p + static_cast<uintptr_t>(bytes); a += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
  }
}

// One L1 prefetch (prefetcht0) per cache line of [p, p + bytes); nothing for p = 0.
FLASHCTE_DECODE_BF16 inline void prefetch_row_to_l1(uintptr_t p, int64_t bytes) {
  if (p == 0) return;
  for (uintptr_t a = p & ~uintptr_t{63}; a < p + static_cast<uintptr_t>(bytes); a += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
  }
}

// How the kernels load the 32 elements [x, x + 32) of a cache row (those outside the mask m as 0)
// as bfloat16 bits, exactly: a bfloat16 row as it is, an 8-bit one converted.
struct Bf16Load {
  static constexpr int64_t kBytes = 2;
  FLASHCTE_DECODE_BF16 __m512i operator()(const unsigned char* row, int64_t x, __mmask32 m) const {
    return _mm512_maskz_loadu_epi16(m, row + 2 * x);
  }
};

// int8: widened to int32 and converted (2 vpmovsxbd, 2 vcvtdq2ps, 1 vcvtne2ps2bf16 per 32),
// -128 included.
struct Int8Load {
  static constexpr int64_t kBytes = 1;
  FLASHCTE_DECODE_BF16 __m512i operator()(const unsigned char* row, int64_t x, __mmask32 m) const {
    // The zero-masked forms with every lane selected: see kAll.
    const __m256i codes = _mm256_maskz_loadu_epi8(m, row + x);
    const __m512 lo = _mm512_maskz_cvtepi32_ps(
        kAll, _mm512_maskz_cvtepi8_epi32(kAll, _mm256_castsi256_si128(codes)));
    const __m512 hi = _mm512_maskz_cvtepi32_ps(
        kAll, _mm512_maskz_cvtepi8_epi32(kAll, _mm256_extracti128_si256(codes, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
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

// Lane i of the result = the sum of v[i]'s 16 lanes (clobbers v). Two in-block levels (vshufps:
// lanes 0 + 1 and 2 + 3 of each 128-bit block of a pair of vectors), then two across blocks
// (vshuff32x4): 45 three-operand shuffles and adds, no register copies, where the ConcatEven /
// ConcatOdd ladder of decode-inl.h costs a copy per vpermt2ps (Zen 4, one thread, 4 rows,
// d = 128, K in L1: QK 12.8 -> 9.3 ns per key).
FLASHCTE_DECODE_BF16 inline __m512 sum_ladder(__m512* v) {
  // v[2i], v[2i+1] -> per block [a0+a1, a2+a3, b0+b1, b2+b3].
#pragma GCC unroll 8
  for (int64_t i = 0; i < 8; ++i) {
    v[i] = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0xDD));
  }
  // -> per block [sum a, sum b, sum c, sum d] of that block, sources 4i .. 4i + 3.
#pragma GCC unroll 4
  for (int64_t i = 0; i < 4; ++i) {
    v[i] = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_ps(kAll, v[2 * i], v[2 * i + 1], 0xDD));
  }
  // Blocks: v[i] block k holds block k's partials of sources 4i .. 4i + 3; sum the 4 blocks.
#pragma GCC unroll 2
  for (int64_t i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(kAll, v[2 * i], v[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, v[0], v[1], 0x88),
                       _mm512_maskz_shuffle_f32x4(kAll, v[0], v[1], 0xDD));
}

// Rows [r0, r0 + R) of S (the last ones clamped to rows - 1 and not stored) against every key,
// kLanes / R keys per step: R x K accumulators, one ladder, and each row's K sums stored from
// their lanes (compressed to the front of a register, then one masked store: no call to memcpy).
// One loop over the keys, so the per-step setup is only the K row pointers and their prefetch.
// Zen 4, one thread, 4 rows, d = 128, K in L1 (bench/micro_kernels decode_qk_bf16/4): 10.4 ns
// per key as one call per step with a memcpy of the sums, 7.7 ns as this loop (medians of 5).
template <int64_t R, class Load, class Rows>
FLASHCTE_DECODE_BF16 inline void qk_rows(const uint16_t* q, int64_t ldq, int64_t rows, int64_t r0,
                                         const Rows& k, const Load& load, int64_t n, int64_t d,
                                         float scale, float* s, int64_t lds, int64_t ahead) {
  constexpr int64_t K = kLanes / R;
  const uint16_t* qr[R];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) qr[r] = q + std::min(r0 + r, rows - 1) * ldq;
  const int64_t full = d / 32 * 32, row_bytes = Load::kBytes * d;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (d - full)) - 1);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += K) {
    __m512 acc[kLanes];
#pragma GCC unroll 16
    for (int64_t i = 0; i < kLanes; ++i) acc[i] = _mm512_setzero_ps();
    const unsigned char* kr[K];
#pragma GCC unroll 16
    for (int64_t c = 0; c < K; ++c) {
      kr[c] = k.template at<unsigned char>(std::min(j0 + c, n - 1));
      prefetch_row(k.prefetch_address(j0 + c + ahead), row_bytes);
      prefetch_row_to_l1(k.prefetch_address(j0 + c + kL1PrefetchRows), row_bytes);
    }
    // Step by step along d, all K keys at once: R * K independent accumulator chains hide the
    // vdpbf16ps latency that key by key (R chains) left exposed (4 rows, d = 128, K in L1, Zen 4:
    // 14.8 -> 12.9 ns per key, both before the in-lane ladder).
    for (int64_t x = 0; x < full; x += 32) {
      __m512bh kv[K];
#pragma GCC unroll 16
      for (int64_t c = 0; c < K; ++c) kv[c] = (__m512bh)load(kr[c], x, ~__mmask32{0});
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr[r] + x);
#pragma GCC unroll 16
        for (int64_t c = 0; c < K; ++c) {
          acc[r * K + c] = _mm512_dpbf16_ps(acc[r * K + c], qv, kv[c]);
        }
      }
    }
    if (tail) {
      __m512bh kv[K];
#pragma GCC unroll 16
      for (int64_t c = 0; c < K; ++c) kv[c] = (__m512bh)load(kr[c], full, tail);
#pragma GCC unroll 16
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qr[r] + full);
#pragma GCC unroll 16
        for (int64_t c = 0; c < K; ++c) {
          acc[r * K + c] = _mm512_dpbf16_ps(acc[r * K + c], qv, kv[c]);
        }
      }
    }
    // Lane r * K + c holds row r0 + r's score of key j0 + c.
    const __m512 sums = _mm512_mul_ps(sum_ladder(acc), vscale);
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
        const int64_t left = rows - r0;  // 3 rows take a 4-row tile, as in decode-inl.h
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

// P rows [R][n <= kPvKeys] (float32 holding bfloat16 values) as pairs (P[j], P[j + 1]) of
// bfloat16 bits in one 32-bit lane, pairs[r][j / 2], the second of an odd n zero: vcvtneps2bf16
// of 16 floats is exactly 8 such pairs (the values are bfloat16 already, so nothing rounds).
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
  __m512 acc[R][2 * G];
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
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
  const __m512i lo_idx =
      _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                       37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __mmask32 last = static_cast<__mmask32>((uint64_t{1} << last_cols) - 1);
  alignas(64) uint32_t pairs[R][kPvKeys / 2];
  // One pair of keys j, j + 1: V rows a and b (b absent: zero) against P pairs[r][i].
  const auto step = [&](int64_t j, const unsigned char* a, const unsigned char* b,
                        int64_t i) FLASHCTE_DECODE_BF16 {
    if (prefetch_bytes) {
      prefetch_row(v.prefetch_address(j + ahead), prefetch_bytes);
      prefetch_row(v.prefetch_address(j + ahead + 1), prefetch_bytes);
      prefetch_row_to_l1(v.prefetch_address(j + kL1PrefetchRows), prefetch_bytes);
      prefetch_row_to_l1(v.prefetch_address(j + kL1PrefetchRows + 1), prefetch_bytes);
    }
    __m512bh vp[2 * G];
#pragma GCC unroll 16
    for (int64_t g = 0; g < G; ++g) {
      const __mmask32 m = g == G - 1 ? last : ~__mmask32{0};
      const __m512i va = load(a, 32 * g, m);
      const __m512i vb = b ? load(b, 32 * g, m) : _mm512_setzero_si512();
      if (g < kUnpacked) {
        vp[2 * g] = (__m512bh)_mm512_unpacklo_epi16(va, vb);
        vp[2 * g + 1] = (__m512bh)_mm512_unpackhi_epi16(va, vb);
      } else {
        vp[2 * g] = (__m512bh)_mm512_permutex2var_epi16(va, lo_idx, vb);
      }
    }
#pragma GCC unroll 16
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][i]));
#pragma GCC unroll 16
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, vp[c]);
    }
  };
  for (int64_t j0 = 0; j0 < n; j0 += kPvKeys) {
    const int64_t keys = std::min(kPvKeys, n - j0), even = keys / 2 * 2;
    pack_p_pairs<R>(p + j0, ldp, keys, pairs);
    const int64_t offset = Load::kBytes * col;
    for (int64_t j = j0; j < j0 + even; j += 2) {
      step(j, v.template at<unsigned char>(j) + offset,
           v.template at<unsigned char>(j + 1) + offset, (j - j0) / 2);
    }
    if (even < keys) {
      step(j0 + even, v.template at<unsigned char>(j0 + even) + offset, nullptr, even / 2);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int64_t g = 0; g < kUnpacked; ++g) {
      const __m512 lo = acc[r][2 * g], hi = acc[r][2 * g + 1];
      acc[r][2 * g] = _mm512_permutex2var_ps(lo, from_x, hi);
      acc[r][2 * g + 1] = _mm512_permutex2var_ps(lo, from_y, hi);
    }
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
// (already bfloat16 values for a bfloat16 V: then nothing rounds).
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

namespace flashcte::simd {
inline constexpr auto kDecodeQkBf16 = &decode_bf16::Qk;
inline constexpr auto kDecodePvBf16 = &decode_bf16::Pv;
}  // namespace flashcte::simd

#else  // no AVX512_BF16 code on this architecture or compiler

namespace flashcte::simd {
inline constexpr void (*kDecodeQkBf16)(const uint16_t*, int64_t, int64_t, DecodeRows, DType,
                                       int64_t, int64_t, float, float*, int64_t) = nullptr;
inline constexpr void (*kDecodePvBf16)(const float*, int64_t, int64_t, int64_t, DecodeRows, DType,
                                       int64_t, const float*, float*, int64_t) = nullptr;
}  // namespace flashcte::simd

#endif  // HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#endif  // FLASHCTE_SRC_SIMD_DECODE_BF16_INL_H_
