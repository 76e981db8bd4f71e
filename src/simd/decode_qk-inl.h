// Decode's first matmul, QK (decode_pv-inl.h has the second, PV): a few query rows against K and
// V rows read in place from a KV cache of float32, bfloat16, float16 or an 8-bit format
// (src/kernel/decode.h). Nothing is packed: cache rows are converted to float32 in registers as
// they are loaded. decode_native-inl.h has the native AVX512_BF16 versions for bfloat16 caches.
//
// QK (DecodeQk): S[r][j] = scale * Q[r] . K[j]. The cache is (key, d) row-major, so each score is
// a dot product along d. Register tile: R rows x K keys of N-lane accumulators with R * K = N
// (AVX-512 4 x 4 = 16 zmm, AVX2 4 x 2 = 8 ymm, SSE4 4 x 1, scalar 1 x 1), filled key by key, each
// K row read from start to end (converted), the R rows of Q from L1. Reading the tile's K rows
// interleaved along d instead (all K keys per step) halved a core's K stream on float32 (QK alone,
// one thread, Zen 4: 7.8 -> 14.8 GB/s key by key). The horizontal sums wait until the tile is
// done: its N accumulators go through one transposing ladder (SumLadder: log2 N levels of
// ConcatEven + ConcatOdd + Add, N - 1 steps) that leaves the sum of accumulator i in lane i, about
// 3 vector ops per score against d / N FMAs per score (8 at d = 128 on AVX-512).
//
// bfloat16 caches on the targets that widen them read K (and V) as pairs of vectors, 2N values a
// load (LoadBf16Pairs), with Q split the same way once per call; a tile's keys then fill
// together (DotPairs). One thread, 32/8 heads, d = 128, 1024 cached, hot: 0.390 -> 0.361 ms a
// call (AMD EPYC Zen 3, AVX2; 7 interleaved pairs, x0.924 each within 0.92-0.93).
//
// Prefetch: both kernels request each K / V row the rows' prefetch_bytes ahead into L2
// (prefetcht1). A core's demand misses and L1 prefetches are capped by its L1 miss buffers (~15
// GB/s here); requests into L2 let the 2 cores approach the memory's read bandwidth
// (decode_rows.h has the measurement). The rows kL1PrefetchRows ahead are also requested into L1
// (prefetcht0), which a paged cache needs at every page boundary (decode_native-inl.h).
//
// Bytes per FLOP: each cached K or V element is read once per call and feeds 2 FLOPs per query
// row (group * T rows of one KV head). At 4 rows (32/8 heads, T = 1) that is 0.25 B/FLOP for
// bfloat16 and 0.5 for float32 caches; two Zen 4 cores (~117 GFLOP/s of fp32 FMA each) reading
// ~30 GB/s break even near 0.13 B/FLOP, so float32 is memory-bound with room to spare and
// bfloat16 within ~2x of the arithmetic limit at 4 rows (hence the native path).
//
// Width contract (ops.h, decode_qk / decode_pv): K and V are read at columns [0, d) / [0, dv) of
// rows [0, n) only (the last cache row may end a mapping: column tails are copied into a zeroed
// vector first). Q is read over [0, round_up(d, N)) and must be finite past d. S is written at
// rows [0, rows) x columns [0, n) exactly. O is read and written over [0, round_up(dv, N)).

#if defined(FLASHCTE_SRC_SIMD_DECODE_QK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_DECODE_QK_INL_H_
#undef FLASHCTE_SRC_SIMD_DECODE_QK_INL_H_
#else
#define FLASHCTE_SRC_SIMD_DECODE_QK_INL_H_
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

// Rows of a QK tile: 4 at most (Q loads stay at one per K keys' FMAs), never more than N, since
// the tile holds R * K = N accumulators.
constexpr int64_t kDecodeQkRows = kMaxLanes < 4 ? kMaxLanes : 4;

// The ladder needs N > 1 fixed lanes (the scalar target has no ConcatEven).
#define FLASHCTE_DECODE_SUM_LADDER (!HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR)

#if FLASHCTE_DECODE_SUM_LADDER
// The vector whose lane i is the sum of v_i's lanes, for N vectors v_0..v_{N-1}. Each level
// halves the vectors and the lanes per source: lower half of a result = v_{2i}'s lanes summed
// in pairs, upper half = v_{2i + 1}'s.
template <class... V>
HWY_INLINE hn::Vec<DF> SumLadder(DF df, const V&... v);

template <size_t... I, class... V>
HWY_INLINE hn::Vec<DF> SumLadderLevel(DF df, std::index_sequence<I...> /* pairs */, const V&... v) {
  return SumLadder(df, hn::Add(hn::ConcatEven(df, Nth<2 * I + 1>(v...), Nth<2 * I>(v...)),
                               hn::ConcatOdd(df, Nth<2 * I + 1>(v...), Nth<2 * I>(v...)))...);
}

template <class... V>
HWY_INLINE hn::Vec<DF> SumLadder(DF df, const V&... v) {
  if constexpr (sizeof...(V) == 1) {
    return Nth<0>(v...);
  } else {
    return SumLadderLevel(df, std::make_index_sequence<sizeof...(V) / 2>(), v...);
  }
}
#endif

// acc_r += Q[r] . K-row over [x0, d) for the R = sizeof...(acc) rows, the K row read from x0 to
// the end.
template <class T, class... V>
HWY_INLINE void DotRow(DF df, const float* const* qr, const T* HWY_RESTRICT krow, int64_t x0,
                       int64_t d, V&... acc) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df)), full = d / lanes * lanes;
  const auto fma_rows = [&](int64_t x, const hn::Vec<DF>& kv) FLASHCTE_TILE_LAMBDA {
    ForEach([&](auto r, auto& a)
                FLASHCTE_TILE_LAMBDA { a = hn::MulAdd(hn::LoadU(df, qr[r] + x), kv, a); },
            acc...);
  };
  for (int64_t x = x0; x < full; x += lanes) fma_rows(x, LoadAsFloat(df, krow + x));
  if (full < d) fma_rows(full, LoadTailAsFloat(df, krow + full, d - full));
}

// A bfloat16 tile's columns [0, d / 2N * 2N) (LoadBf16Pairs; Q rows split by SplitQRows), all K
// keys together: each step takes the even and the odd half of every key, so R x K accumulators
// are in flight. Key by key, as DotRow goes, only R = 4 are: each takes two dependent FMAs a step
// and the loop waited on their latency (Zen 3, AVX2: 4 cycles an FMA, 2 issued per cycle, so 8
// chains keep the FMA units busy). `krows` are the tile's K keys; the accumulators are the pack,
// row-major R x K. Returns where the pairs end.
template <int64_t K, class... V>
HWY_INLINE int64_t DotPairs(DF df, const float* const* qr, const hwy::bfloat16_t* const* krows,
                            int64_t d, V&... acc) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df)), pairs = d / (2 * lanes) * (2 * lanes);
  for (int64_t x = 0; x < pairs; x += 2 * lanes) {
    ForEachColumn<K>(
        [&](auto c, auto&... key) FLASHCTE_TILE_LAMBDA {
          hn::Vec<DF> even, odd;
          LoadBf16Pairs(df, krows[c] + x, even, odd);
          ForEach(
              [&](auto r, auto& a) FLASHCTE_TILE_LAMBDA {
                a = hn::MulAdd(hn::LoadU(df, qr[r] + x), even, a);
                a = hn::MulAdd(hn::LoadU(df, qr[r] + x + lanes), odd, a);
              },
              key...);
        },
        acc...);
  }
  return pairs;
}

// Q rows [0, rows) for a bfloat16 cache's pairs (LoadBf16Pairs): each run of 2N columns below
// d / 2N * 2N as its N even-indexed values, then its N odd-indexed ones; the columns after, to
// round_up(d, N), as they are. Copied once per block of rows, read by every key of the call.
HWY_INLINE void SplitQRows(const float* HWY_RESTRICT q, int64_t ldq, int64_t rows, int64_t d,
                           float* HWY_RESTRICT split, int64_t ld_split) {
  const DF df;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const int64_t pairs = d / (2 * lanes) * (2 * lanes), padded = (d + lanes - 1) / lanes * lanes;
  for (int64_t r = 0; r < rows; ++r) {
    const float* from = q + r * ldq;
    float* to = split + r * ld_split;
    int64_t x = 0;
    for (; x < pairs; x += 2 * lanes) {
      hn::Vec<DF> even, odd;
      hn::LoadInterleaved2(df, from + x, even, odd);
      hn::Store(even, df, to + x);
      hn::Store(odd, df, to + x + lanes);
    }
    for (; x < padded; x += lanes) hn::Store(hn::LoadU(df, from + x), df, to + x);
  }
}

// One QK tile: rows [0, R) of a block of `rows` x keys [j0, j0 + N / R), prefetching K `ahead`
// rows on (0: no prefetch). Rows and keys past the ends are computed on the last row / key (clamped
// pointers) and not stored.
template <int64_t R, class T, class Rows>
HWY_INLINE void QkTile(const float* HWY_RESTRICT q, int64_t ldq, int64_t rows, const Rows& k,
                       int64_t n, int64_t j0, int64_t d, int64_t ahead, float scale,
                       float* HWY_RESTRICT s, int64_t lds) {
  const DF df;
  constexpr int64_t N = kMaxLanes, K = N / R;
  static_assert(R * K == N, "the ladder sums exactly N accumulators");
  const float* qr[R];
  for (int64_t r = 0; r < R; ++r) qr[r] = q + std::min(r, rows - 1) * ldq;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  HWY_ALIGN float sums[N];  // sums[r * K + c]: row r, key j0 + c
  // The N accumulators as R rows of K keys, filled key by key (a column of the tile each), each
  // K row read from start to end: sequential lines for the prefetchers. A bfloat16 cache's pairs
  // fill all the keys together (DotPairs).
  WithVectors<N>(df, [&](auto&... acc) FLASHCTE_TILE_LAMBDA {
    const auto prefetch = [&](int64_t c) FLASHCTE_TILE_LAMBDA {
      if (ahead == 0) return;
      prefetch_lines<2>(k.prefetch_address(j0 + c + ahead), row_bytes);
      prefetch_lines<3>(k.prefetch_address(j0 + c + kL1PrefetchRows), row_bytes);
    };
    const auto key_row = [&](int64_t c) FLASHCTE_TILE_LAMBDA {
      return k.template at<T>(std::min<int64_t>(j0 + c, n - 1));
    };
    if constexpr (kBf16Pairs<T>) {
      const hwy::bfloat16_t* krows[K];
      for (int64_t c = 0; c < K; ++c) {
        prefetch(c);
        krows[c] = key_row(c);
      }
      const int64_t x0 = DotPairs<K>(df, qr, krows, d, acc...);
      ForEachColumn<K>([&](auto c, auto&... key)
                           FLASHCTE_TILE_LAMBDA { DotRow(df, qr, krows[c], x0, d, key...); },
                       acc...);
    } else {
      ForEachColumn<K>(
          [&](auto c, auto&... key) FLASHCTE_TILE_LAMBDA {
            prefetch(c);
            DotRow(df, qr, key_row(c), 0, d, key...);
          },
          acc...);
    }
#if !FLASHCTE_DECODE_SUM_LADDER
    ForEach([&](auto i, auto& a)
                FLASHCTE_TILE_LAMBDA { sums[i] = hn::GetLane(hn::SumOfLanes(df, a)) * scale; },
            acc...);
#else
    hn::Store(hn::Mul(SumLadder(df, acc...), hn::Set(df, scale)), df, sums);
#endif
  });
  const int64_t keys = std::min(K, n - j0);
  for (int64_t r = 0; r < R && r < rows; ++r) {
    float* dst = s + r * lds + j0;
    if (keys == K) {
      std::memcpy(dst, sums + r * K, sizeof(float) * K);
    } else {
      for (int64_t c = 0; c < keys; ++c) dst[c] = sums[r * K + c];
    }
  }
}

template <class T, class Rows>
void QkTyped(const float* q, int64_t ldq, int64_t rows, const Rows& k, int64_t n, int64_t d,
             float scale, float* s, int64_t lds) {
  constexpr int64_t R = kDecodeQkRows;
  const int64_t first_ahead = prefetch_rows(k.prefetch_bytes, d * static_cast<int64_t>(sizeof(T)));
  // A bfloat16 cache's block of Q rows, split into pairs (SplitQRows); 16 KiB at d = 1024.
  constexpr int64_t kSplitStride = (kMaxHeadDim + kMaxLanes - 1) / kMaxLanes * kMaxLanes;
  HWY_ALIGN float split[kBf16Pairs<T> ? R * kSplitStride : 1];
  if (kBf16Pairs<T> && d > kSplitStride) HWY_ABORT("decode_qk: d = %ld > %ld", d, kSplitStride);
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    // The block's rows; tiles clamp to its last row. Only the first block prefetches: the later
    // ones (MLA's 16-128 heads over one KV head) read the K rows it brought in (two prefetches
    // per line of a K row in every block of 4 rows: 9 per score for bfloat16 at d = 576). AMD EPYC
    // Zen 5, 2 threads, d 576 over 4096 cached in pages of 64 (bench/mla.py, 3 interleaved pairs):
    // 128 heads x1.17 fp32 and x1.26 bf16 (native) in speed, 16 heads x1.08 / x1.16; GQA 32/8 heads
    // with 4 new tokens (16 rows, d 128, 8192 cached) x1.10 / x1.13; 4 rows unchanged (one block).
    const int64_t block = std::min(R, rows - r0), ahead = r0 == 0 ? first_ahead : 0;
    const float* qb = q + r0 * ldq;
    int64_t ldb = ldq;
    if constexpr (kBf16Pairs<T>) {
      SplitQRows(qb, ldq, block, d, split, kSplitStride);
      qb = split;
      ldb = kSplitStride;
    }
    float* sb = s + r0 * lds;
    // The last block narrows to 2 or 1 rows when that is all that is left (R * K stays N), so
    // that few rows do not pay for a full tile of duplicates; 3 rows take a 4-row tile.
    if constexpr (R >= 2) {
      if (block <= 2) {
        if (block == 2) {
          for (int64_t j0 = 0; j0 < n; j0 += kMaxLanes / 2) {
            QkTile<2, T, Rows>(qb, ldb, block, k, n, j0, d, ahead, scale, sb, lds);
          }
        } else {
          for (int64_t j0 = 0; j0 < n; j0 += kMaxLanes) {
            QkTile<1, T, Rows>(qb, ldb, block, k, n, j0, d, ahead, scale, sb, lds);
          }
        }
        continue;
      }
    }
    for (int64_t j0 = 0; j0 < n; j0 += kMaxLanes / R) {
      QkTile<R, T, Rows>(qb, ldb, block, k, n, j0, d, ahead, scale, sb, lds);
    }
  }
}

void DecodeQk(const float* q, int64_t ldq, int64_t rows, DecodeRows k, DType dtype, int64_t n,
              int64_t d, float scale, float* s, int64_t lds) {
  if (rows <= 0 || n <= 0) return;
  WithCacheType(dtype, "decode_qk", [&](auto type) HWY_ATTR {
    with_rows(k, [&](const auto& kr) HWY_ATTR {
      QkTyped<typename decltype(type)::type>(q, ldq, rows, kr, n, d, scale, s, lds);
    });
  });
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_DECODE_QK_INL_H_
