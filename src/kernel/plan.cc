#include "src/kernel/plan.h"

#include <algorithm>

#include "src/core/math.h"

namespace flashcte::internal {
namespace {

// Query rows per work item. Each packed K/V tile serves q_block x group query rows, so the
// packing (a copy from L3 or DRAM) costs 1 / (q_block x group) per score: 7.4% of the cycles at
// 192 rows, MHA, 1.9% at 768 (perf, 2 threads, S=4096, d=128, fp32). Larger blocks also make
// fewer, larger work items, which balance worse at the end of a causal run. Zen 3 EPYC, 2
// threads, d=128, fp32, GFLOP/s, median of 3 interleaved rounds:
//                                 q_block  192    384    768
//   MHA 8 heads, S=4096, non-causal        136    142    139
//   MHA 8 heads, S=4096, causal            138    142    141
//   GQA 32:8,    S=2048, causal            143    140    129
// Hence 768 query rows per packed tile: 384-row blocks for MHA, 192 from a group of 4 up.
// (Earlier: 48-row blocks spent ~50% of the matmul instructions on packing, callgrind, and 96
// rows measured slower than 192.)
//
// The native bfloat16 kernels (AVX512_BF16 on Zen 4/5, 1 MiB of L2 per core) do twice the
// arithmetic per cycle, so the same packing costs twice the share; MHA's block may grow to 768.
// Zen 4 EPYC, 2 threads, d=128, bf16 native (AVX3), GFLOP/s, medians of 5 interleaved rounds
// (kv_tile 256), q_block per head:
//                                 q_block  192    384    768
//   MHA 8 heads, S=4096, non-causal               342    350
//   MHA 8 heads, S=4096, causal                   334    337
//   GQA 32:8,    S=2048, causal            331    324
//   GQA 32:8,    S=4096, causal            344    345
// So a GQA group keeps 768 rows per packed tile; only the cap moves.
//
// float32 on AVX-512 (16 lanes) moves the cap too, once V is read in place (pack.cc) and the K
// copy is all the packing left. Zen 4 EPYC, AVX3, 2 threads, fp32, MHA 8 heads, 768 against 384
// rows, medians of interleaved process pairs: S=4096 d=128 non-causal 1.009-1.019 (8 pairs),
// causal 1.019-1.026 (6); S=2048 causal 0.98-1.00 and S=4096 d=64 1.00 (6 each). Widened
// inputs on the same kernels, S=4096 d=128, 5 pairs each: fp16 non-causal 1.008-1.028, causal
// 1.017-1.025; bf16 widened (FLASHCTE_BF16_DOT=widen, the Intel path) 1.024-1.028. The 8-lane
// targets keep Zen 3's 384.
constexpr int64_t kRowsPerPackedTile = 768;
constexpr int64_t kMaxQBlock = 384, kMaxQBlockWide = 768;
constexpr int64_t kWideLanes = 16;
constexpr int64_t kMinQBlock = 192;
// The work item's Q and O scratch, group x q_block x (d + dv) floats, stays within 8 MiB per
// thread (issue 3 bounds the extra memory at 16 MiB per thread): large head dims and groups
// halve the block, down to one 48-row sub-block.
constexpr int64_t kQoScratchFloats = int64_t{2} << 20;
constexpr int64_t kSmallestQBlock = 48;

int64_t default_q_block(bool native_bf16, int64_t lanes, int64_t group, int64_t d, int64_t dv) {
  const int64_t max_block = native_bf16 || lanes >= kWideLanes ? kMaxQBlockWide : kMaxQBlock;
  int64_t rows = std::clamp(kRowsPerPackedTile / group, kMinQBlock, max_block);
  while (rows > kSmallestQBlock && group * rows * (d + dv) > kQoScratchFloats) rows /= 2;
  return rows;
}

// KV columns per tile: 256 keys x d=128 x 4 B = 128 KiB of packed K plus as much V, which stays
// in the 512 KiB L2 of Zen 3 while every head of the GQA group streams over it. Larger head dims
// shrink the tile to keep that footprint (the Neuron large-d kernel halves its LARGE_TILE_SZ
// for the same reason): 128 keys at d = 256, 64 at d = 512. The native bfloat16 path packs K and
// V as bfloat16 pairs, half the bytes, so the same footprint holds twice the keys. Zen 4 EPYC,
// 2 threads, d=128, bf16 native (AVX3), GFLOP/s, medians of 6 interleaved rounds, 256 -> 512
// keys: MHA 8 heads S=4096 non-causal 360 -> 366, causal 346 -> 353; GQA 32:8 S=2048 causal
// 335 -> 346.
constexpr int64_t kPackedTileFloats = 65536;  // K + V floats of one packed tile (256 KiB)
constexpr int64_t kMaxKvTile = 256, kMaxKvTileNative = 512;
constexpr int64_t kMinKvTile = 32;

int64_t default_kv_tile(bool native_bf16, int64_t d, int64_t dv) {
  // Elements of one packed tile: floats, or twice as many bfloat16 halves.
  const int64_t budget = native_bf16 ? 2 * kPackedTileFloats : kPackedTileFloats;
  int64_t tile = native_bf16 ? kMaxKvTileNative : kMaxKvTile;
  while (tile > kMinKvTile && tile * (d + dv) > budget) tile /= 2;
  return tile;
}

}  // namespace

TileConfig resolve_tiles(const Problem& problem, bool native_bf16, int64_t lanes) {
  TileConfig t = problem.tile_request;
  if (t.q_block == 0) {
    t.q_block =
        default_q_block(native_bf16, lanes, problem.group, problem.head_dim, problem.value_dim);
  }
  if (t.kv_tile == 0) {
    t.kv_tile = default_kv_tile(native_bf16, problem.head_dim, problem.value_dim);
    if (t.section > 0 && t.section % t.kv_tile != 0) t.kv_tile = t.section;
  }
  if (t.section == 0) t.section = t.kv_tile;
  return t;
}

QueryBlock query_block(const Problem& problem, const TileConfig& tiles, int64_t q_block) {
  const int64_t row0 = q_block * tiles.q_block;
  return {row0, std::min(tiles.q_block, problem.seqlen_q - row0)};
}

int64_t num_q_blocks(const Problem& problem, const TileConfig& tiles) {
  return ceil_div(problem.seqlen_q, tiles.q_block);
}

RowInterval row_interval(const Problem& problem, int64_t kv_b, int64_t i) {
  const int64_t prior = problem.prior_used[kv_b];
  const int64_t q_pos = problem.q_pos_offset + i * problem.cp_stride;
  // kv_pos(j) = j - prior must satisfy -window_left <= kv_pos - q_pos <= window_right: causal is
  // window_right 0 (prior tokens have negative positions, so they are never causally masked),
  // a sliding window sw is window_left sw - 1.
  RowInterval r{0, prior + problem.seqlen_kv};
  if (problem.window_right < Problem::kNoLimit)
    r.hi = std::min(r.hi, q_pos + prior + problem.window_right + 1);
  if (problem.window_left < Problem::kNoLimit)
    r.lo = std::max(r.lo, q_pos + prior - problem.window_left);
  if (!problem.bound_lo.empty()) {
    r.lo = std::max(r.lo, problem.bound_lo[i]);
    r.hi = std::min(r.hi, problem.bound_hi[i]);
  }
  if (r.hi < r.lo) r.hi = r.lo;
  return r;
}

int64_t section_length(const Problem& problem, const TileConfig& t, int64_t kv_b) {
  const int64_t total = problem.kv_total(kv_b);
  if (t.section_threshold > 0 && total <= t.section_threshold) {
    // One section over the whole KV axis, rounded up to the tile grid.
    return std::max<int64_t>(t.kv_tile, round_up(total, t.kv_tile));
  }
  return t.section;
}

void plan_block(const Problem& problem, const TileConfig& tiles, int64_t kv_b,
                const RowInterval* intervals, int64_t rows, BlockPlan* plan) {
  plan->tiles.clear();
  plan->sections.clear();
  plan->tiles_full = plan->tiles_masked = plan->tiles_skipped = plan->computed_columns = 0;
  const int64_t total = problem.kv_total(kv_b);
  const int64_t section = section_length(problem, tiles, kv_b);
  const int64_t tile = tiles.kv_tile;
  for (int64_t s0 = 0; s0 < total; s0 += section) {
    const int64_t s1 = std::min(total, s0 + section);
    const int64_t first = static_cast<int64_t>(plan->tiles.size());
    for (int64_t c0 = s0; c0 < s1; c0 += tile) {
      const int64_t c1 = std::min(s1, c0 + tile);
      // Union of the rows' intersections with [c0, c1), and whether every row covers it.
      int64_t lo = c1, hi = c0;
      bool every_row_covers = true;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t a = std::max(intervals[r].lo, c0), b = std::min(intervals[r].hi, c1);
        if (a < b) {
          lo = std::min(lo, a);
          hi = std::max(hi, b);
        }
      }
      if (lo >= hi) {
        ++plan->tiles_skipped;
        continue;
      }
      for (int64_t r = 0; r < rows && every_row_covers; ++r) {
        every_row_covers = intervals[r].lo <= lo && intervals[r].hi >= hi;
      }
      plan->tiles.push_back({lo, hi, !every_row_covers});
      ++(every_row_covers ? plan->tiles_full : plan->tiles_masked);
      plan->computed_columns += hi - lo;
    }
    const int64_t end = static_cast<int64_t>(plan->tiles.size());
    if (end > first) plan->sections.push_back({s0, first, end});
  }
}

BlockCounts count_block(const Problem& problem, const TileConfig& tiles, int64_t kv_b,
                        int64_t q_block) {
  BlockCounts counts;
  const QueryBlock block = query_block(problem, tiles, q_block);
  std::vector<RowInterval> intervals(static_cast<size_t>(block.rows));
  for (int64_t r = 0; r < block.rows; ++r) {
    intervals[r] = row_interval(problem, kv_b, block.row0 + r);
    counts.pairs_useful += intervals[r].hi - intervals[r].lo;
  }
  BlockPlan plan;
  for (int64_t r0 = 0; r0 < block.rows; r0 += kSubBlockRows) {
    const int64_t n = std::min(kSubBlockRows, block.rows - r0);
    plan_block(problem, tiles, kv_b, intervals.data() + r0, n, &plan);
    counts.tiles_full += plan.tiles_full;
    counts.tiles_masked += plan.tiles_masked;
    counts.tiles_skipped += plan.tiles_skipped;
    counts.pairs_computed += n * plan.computed_columns;
  }
  return counts;
}

}  // namespace flashcte::internal
