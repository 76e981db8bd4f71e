// Decode's second matmul, PV (decode_qk-inl.h has QK, and the prefetch, bytes per FLOP and
// width contract of both).
//
// PV (DecodePv): O[r] = alpha[r] O[r] + sum_j P[r][j] V[j]: per key, C vectors of the V row
// (converted) and one broadcast of P per row. Register tile R x C (AVX-512: R * C <= 16, AVX2
// R * C <= 8) with all the rows in one block where possible (4 x 4 on AVX-512 for 4 rows), so a
// 16-bit V value is converted once per 4 rows; keys innermost, column panels outer (the second
// panel finds the rows in L2).

#if defined(FLASHCTE_SRC_SIMD_DECODE_PV_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_DECODE_PV_INL_H_
#undef FLASHCTE_SRC_SIMD_DECODE_PV_INL_H_
#else
#define FLASHCTE_SRC_SIMD_DECODE_PV_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "hwy/highway.h"
#include "src/simd/decode_rows.h"
#include "src/simd/shared-inl.h"
#include "src/simd/tile-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

// PV's accumulator budget and widest panel: 16 of AVX-512's 32 registers (8 of 16 elsewhere),
// leaving room for the C converted V vectors and the P broadcast.
constexpr int64_t kDecodePvAcc = kMaxLanes >= 16 ? 16 : 8;
constexpr int64_t kDecodePvCols = kMaxLanes >= 16 ? 8 : 4;

// One PV tile: R rows x C vectors of columns starting at V column `col`; with kTail the last
// vector holds only `tail` (< N) columns of V. With prefetch_bytes, each step also requests that
// many bytes of the V row `ahead` rows on into L2.
template <int64_t R, int64_t C, bool kTail, class T, class Rows>
HWY_INLINE void PvTile(const float* HWY_RESTRICT p, int64_t ldp, int64_t n, const Rows& v,
                       int64_t col, int64_t tail, const float* alpha, float* HWY_RESTRICT o,
                       int64_t ldo, int64_t prefetch_bytes, int64_t ahead) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  // A bfloat16 panel of whole pairs of vectors widens 2N values per load (LoadBf16Pairs).
  constexpr bool kPairs = kBf16Pairs<T> && !kTail && C % 2 == 0;
  const auto load_v = [&](int64_t j, auto&... b) FLASHCTE_TILE_LAMBDA {
    const T* row = v.template at<T>(j) + col;
    if (prefetch_bytes) {
      prefetch_lines<2>(v.prefetch_address(j + ahead), prefetch_bytes);
      prefetch_lines<3>(v.prefetch_address(j + kL1PrefetchRows), prefetch_bytes);
    }
    if constexpr (kPairs) {
      ForEachPair([&](auto m, auto& even, auto& odd)
                      FLASHCTE_TILE_LAMBDA { LoadBf16Pairs(df, row + 2 * m * N, even, odd); },
                  b...);
    } else {
      ForEach(
          [&](auto c, auto& x) FLASHCTE_TILE_LAMBDA {
            const T* at = row + c * N;
            x = kTail && c == C - 1 ? LoadTailAsFloat(df, at, tail) : LoadAsFloat(df, at);
          },
          b...);
    }
  };
  RescaledPvTile<R, C, kPairs>(df, p, ldp, n, load_v, alpha, o, ldo);
}

// Rows [0, rows) of one panel of C vectors, in row blocks of the most rows the budget allows (at
// most kMaxRows). Only the first row block reads V from memory, and prefetches ahead; the others
// find it in L1.
template <int64_t C, bool kTail, class T, class Rows, int64_t kMaxRows = 4>
HWY_INLINE void PvPanel(const float* p, int64_t ldp, int64_t rows, int64_t n, const Rows& v,
                        int64_t col, int64_t tail, const float* alpha, float* o, int64_t ldo,
                        int64_t prefetch_bytes, int64_t ahead) {
  constexpr int64_t R = std::min<int64_t>(kMaxRows, std::max<int64_t>(1, kDecodePvAcc / C));
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    PvTile<R, C, kTail, T, Rows>(p + r * ldp, ldp, n, v, col, tail, alpha ? alpha + r : nullptr,
                                 o + r * ldo, ldo, r == 0 ? prefetch_bytes : 0, ahead);
  }
  RemainderBlock<R - 1>(rows - r, r, [&](auto block_rows, int64_t r1) HWY_ATTR {
    constexpr int64_t R1 = decltype(block_rows)::value;
    PvTile<R1, C, kTail, T, Rows>(p + r1 * ldp, ldp, n, v, col, tail, alpha ? alpha + r1 : nullptr,
                                  o + r1 * ldo, ldo, r1 == 0 ? prefetch_bytes : 0, ahead);
  });
}

// The column tail, when dv is not a whole number of vectors, is compiled into few tile shapes: the
// decode tiles are most of the SIMD layer's compile time (each shape once per cache dtype, row
// form and target), and a tail form of every panel shape made decode_pv.cc take ~175 s instead of
// ~80 s (x86 Release, Xeon, one compile at a time). At one row per KV head (MHA) the tail joins the
// last panel (one-row tiles); with more rows it is a 1-vector panel of its own.

// A panel of `vectors` vectors (1..kDecodePvCols; with kTail 2..kDecodePvCols, the last one the
// tail's `tail` columns), in row blocks of at most kMaxRows rows.
template <int64_t C, bool kTail, int64_t kMaxRows, class T, class Rows>
HWY_INLINE void PvPanelOf(int64_t vectors, const float* p, int64_t ldp, int64_t rows, int64_t n,
                          const Rows& v, int64_t col, int64_t tail, const float* alpha, float* o,
                          int64_t ldo, int64_t prefetch_bytes, int64_t ahead) {
  if constexpr (C >= (kTail ? 2 : 1)) {
    if (vectors == C) {
      PvPanel<C, kTail, T, Rows, kMaxRows>(p, ldp, rows, n, v, col, tail, alpha, o, ldo,
                                           prefetch_bytes, ahead);
    } else {
      PvPanelOf<C - 1, kTail, kMaxRows, T, Rows>(vectors, p, ldp, rows, n, v, col, tail, alpha, o,
                                                 ldo, prefetch_bytes, ahead);
    }
  }
}

template <class T, class Rows>
void PvTyped(const float* p, int64_t ldp, int64_t rows, int64_t n, const Rows& v, int64_t dv,
             const float* alpha, float* o, int64_t ldo) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t full = dv / N, tail = dv % N;
  // Panels as wide as the budget allows with every row block at 4 rows (or all the rows): a
  // bfloat16 / float16 V value is converted once per 4 rows (AVX-512, 4 rows: 4 x 4 tiles, not
  // 2 x 8 tiles that convert each V row twice).
  const int64_t panel =
      std::min(kDecodePvCols, std::max<int64_t>(1, kDecodePvAcc / std::min<int64_t>(rows, 4)));
  const int64_t row_bytes = dv * static_cast<int64_t>(sizeof(T));
  const int64_t ahead = prefetch_rows(v.prefetch_bytes, row_bytes);
  bool tail_done = tail == 0;
  // The first panel prefetches whole rows ahead; the later ones find them in L2.
  for (int64_t c0 = 0; c0 < full; c0 += panel) {
    const int64_t width = std::min(panel, full - c0);
    const int64_t prefetch = c0 == 0 ? row_bytes : 0;
    if (!tail_done && rows == 1 && c0 + width == full && width < panel) {
      PvPanelOf<kDecodePvCols, true, 1, T, Rows>(width + 1, p, ldp, rows, n, v, c0 * N, tail, alpha,
                                                 o + c0 * N, ldo, prefetch, ahead);
      tail_done = true;
    } else {
      PvPanelOf<kDecodePvCols, false, 4, T, Rows>(width, p, ldp, rows, n, v, c0 * N, 0, alpha,
                                                  o + c0 * N, ldo, prefetch, ahead);
    }
  }
  if (!tail_done) {
    PvPanel<1, true, T, Rows>(p, ldp, rows, n, v, full * N, tail, alpha, o + full * N, ldo,
                              full == 0 ? row_bytes : 0, ahead);
  }
}

void DecodePv(const float* p, int64_t ldp, int64_t rows, int64_t n, DecodeRows v, DType dtype,
              int64_t dv, const float* alpha, float* o, int64_t ldo) {
  if (rows <= 0) return;
  WithCacheType(dtype, "decode_pv", [&](auto type) HWY_ATTR {
    with_rows(v, [&](const auto& vr) HWY_ATTR {
      PvTyped<typename decltype(type)::type>(p, ldp, rows, n, vr, dv, alpha, o, ldo);
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_DECODE_PV_INL_H_
