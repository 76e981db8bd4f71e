// MM1: S = Q.K for a block of query rows against one packed K tile, with the row max fused into
// the epilogue.
//
// Register tile: kRows x 2 vectors of accumulators (AVX2: 6 x 16 floats in 12 of 16 ymm; AVX3:
// 6 x 32 floats in 12 of 32 zmm), one broadcast of Q and two loads of K per step of the
// contraction: 2 loads + 6 broadcasts for 12 FMAs, FMA-bound, not load-bound (2 loads per cycle
// on Zen). Bytes moved per FLOP from L1: (2 vectors of K + 6 floats of Q) / (12 x 2N FLOPs) =
// 0.42 B/FLOP on AVX2, 0.21 on AVX3; from L2 and beyond, K is read once per row group.
//
// Loop order (GotoBLAS): column panel outer, row blocks inner. A panel of K (kDTile x 2N floats:
// 8 KiB on AVX2, 16 KiB on AVX3) stays in L1 while every row block of the group streams its Q
// rows past it; row-block-outer re-read all of K (128 KiB at d = 128) from L2 per 6 rows.
//
// Width contract W2 (ops.h): a panel of two vectors is used while more than one vector of
// columns remains, so K is read and S written up to round_up(cols, N), never further.

#if defined(FLASHCTE_SRC_SIMD_MM1_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_MM1_INL_H_
#undef FLASHCTE_SRC_SIMD_MM1_INL_H_
#else
#define FLASHCTE_SRC_SIMD_MM1_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <limits>

#include "hwy/highway.h"
#include "src/simd/shared-inl.h"
#include "src/simd/tile-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

// Rows of Q whose max vectors one group keeps on the stack; Qk walks the rows in such groups.
constexpr int64_t kMaxGroupRows = 48;

// The contraction over d is tiled by kDTile (the d-tiling of flash_fwd_large_d): a K panel of
// kDTile x 2N floats stays L1-resident whatever the head dim, and the scores accumulate in S
// across d tiles.
constexpr int64_t kDTile = 128;

// One panel of kCols vectors for R rows: S[r][panel] (+)= Q[r] . K[:, panel]. `valid` columns of
// the panel are real; the rest is padding whose scores are stored but kept out of the max.
template <int64_t R, int64_t kCols>
HWY_INLINE void QkPanel(const float* HWY_RESTRICT q, int64_t ldq, const float* HWY_RESTRICT k,
                        int64_t ldk, int64_t d, float* HWY_RESTRICT s, int64_t lds, int64_t valid,
                        bool accumulate, float* max_vecs) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  const auto init = [&](int64_t r, int64_t c) FLASHCTE_TILE_LAMBDA {
    return accumulate ? hn::LoadU(df, s + r * lds + c * N) : hn::Zero(df);
  };
  const auto load_k = [&](int64_t x, auto&... b) FLASHCTE_TILE_LAMBDA {
    ForEach([&](auto c, auto& v) FLASHCTE_TILE_LAMBDA { v = hn::LoadU(df, k + x * ldk + c * N); },
            b...);
  };
  const auto finish = [&](auto r, auto&... row) FLASHCTE_TILE_LAMBDA {
    auto m = neg_inf;
    ForEach(
        [&](auto c, auto& v) FLASHCTE_TILE_LAMBDA {
          const int64_t col = c * N;
          hn::StoreU(v, df, s + r * lds + col);
          const int64_t lanes = valid - col;  // >= 1 for c == 0
          m = hn::Max(
              m, lanes >= N
                     ? v
                     : hn::IfThenElse(hn::FirstN(df, static_cast<size_t>(lanes > 0 ? lanes : 0)), v,
                                      neg_inf));
        },
        row...);
    if (max_vecs) {
      float* mv = max_vecs + r * N;
      hn::Store(hn::Max(hn::Load(df, mv), m), df, mv);
    }
  };
  OuterProductTile<R, kCols>(df, q, ldq, d, init, load_k, finish);
}

void Qk(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t ldk, int64_t cols,
        int64_t d, float* s, int64_t lds, float* row_max) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  HWY_ALIGN float max_vecs[kMaxGroupRows * kMaxLanes];
  for (int64_t g = 0; g < rows; g += kMaxGroupRows) {
    const int64_t group_rows = std::min(kMaxGroupRows, rows - g);
    const float* qg = q + g * ldq;
    float* sg = s + g * lds;
    float* mv = row_max ? max_vecs : nullptr;
    if (mv) std::fill(mv, mv + group_rows * N, -std::numeric_limits<float>::infinity());
    for (int64_t x0 = 0; x0 < d; x0 += kDTile) {
      const int64_t dn = std::min(kDTile, d - x0);
      const bool accumulate = x0 > 0;
      float* mx = x0 + dn == d ? mv : nullptr;  // the max only once the scores are complete
      const float* qx = qg + x0;
      const float* kx = k + x0 * ldk;
      for (int64_t c = 0; c < cols; c += 2 * N) {
        ForEachRowBlock<kRows>(group_rows, [&](auto block_rows, int64_t r) HWY_ATTR {
          constexpr int64_t R = decltype(block_rows)::value;
          float* mr = mx ? mx + r * N : nullptr;
          // Two vectors while more than one vector of columns remains (the second may cover
          // padding, W2).
          if (c + N < cols) {
            QkPanel<R, 2>(qx + r * ldq, ldq, kx + c, ldk, dn, sg + r * lds + c, lds, cols - c,
                          accumulate, mr);
          } else {
            QkPanel<R, 1>(qx + r * ldq, ldq, kx + c, ldk, dn, sg + r * lds + c, lds, cols - c,
                          accumulate, mr);
          }
        });
      }
    }
    if (mv) {
      for (int64_t r = 0; r < group_rows; ++r) {
        const float m = hn::GetLane(hn::MaxOfLanes(df, hn::Load(df, mv + r * N)));
        row_max[g + r] = m > row_max[g + r] ? m : row_max[g + r];
      }
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_MM1_INL_H_
