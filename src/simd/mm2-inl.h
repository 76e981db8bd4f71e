// MM2 with the rescale folded in: O = alpha O + P.V for a block of query rows against one packed
// V tile.
//
// Register tile: kRows x 2 vectors of accumulators (AVX2: 6 x 16 floats in 12 of 16 ymm; AVX3:
// 6 x 32 floats in 12 of 32 zmm), one broadcast of P and two loads of V per key: the MM1 shape.
// Bytes moved per FLOP from L1: (2 vectors of V + 6 floats of P) / (12 x 2N FLOPs) = 0.42 B/FLOP
// on AVX2, 0.21 on AVX3. O is loaded and stored once per panel and tile.
//
// The same panel order as MM1: a 2N-wide panel of V (n x 2N floats: 16 KiB for a 256-key tile
// on AVX2, 32 KiB on AVX3) stays in L1 while every row block of P streams past it. The rescale by
// alpha is folded into the accumulator load of the first tile.
//
// Width contract W3 (ops.h): dv_pad is a multiple of N but not necessarily of 2N (AVX3: N = 16,
// and dv_pad = 16, 48, 80, ... for head dims 8, 40, 80, ...), so the columns go in two-vector
// panels and at most one one-vector panel: nothing past dv_pad is read or written.

#if defined(FLASHCTE_SRC_SIMD_MM2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_MM2_INL_H_
#undef FLASHCTE_SRC_SIMD_MM2_INL_H_
#else
#define FLASHCTE_SRC_SIMD_MM2_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"
#include "src/simd/shared-inl.h"
#include "src/simd/tile-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

// One panel of kCols vectors of the packed V tile for R rows.
template <int64_t R, int64_t kCols>
HWY_INLINE void PvPanel(const float* HWY_RESTRICT p, int64_t ldp, int64_t n,
                        const float* HWY_RESTRICT v, int64_t ldv, const float* alpha,
                        float* HWY_RESTRICT o, int64_t ldo) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto load_v = [&](int64_t j, auto&... b) FLASHCTE_TILE_LAMBDA {
    ForEach([&](auto c, auto& x) FLASHCTE_TILE_LAMBDA { x = hn::LoadU(df, v + j * ldv + c * N); },
            b...);
  };
  RescaledPvTile<R, kCols>(df, p, ldp, n, load_v, alpha, o, ldo);
}

void Pv(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv,
        int64_t dv_pad, const float* alpha, float* o, int64_t ldo) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  HWY_DASSERT(dv_pad % N == 0);
  for (int64_t c = 0; c < dv_pad; c += 2 * N) {
    const bool two = c + 2 * N <= dv_pad;  // else one vector is left (W3)
    ForEachRowBlock<kRows>(rows, [&](auto block_rows, int64_t r) HWY_ATTR {
      constexpr int64_t R = decltype(block_rows)::value;
      const float* ar = alpha ? alpha + r : nullptr;
      if (two) {
        PvPanel<R, 2>(p + r * ldp, ldp, n, v + c, ldv, ar, o + r * ldo + c, ldo);
      } else {
        PvPanel<R, 1>(p + r * ldp, ldp, n, v + c, ldv, ar, o + r * ldo + c, ldo);
      }
    });
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_MM2_INL_H_
