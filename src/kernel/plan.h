// The plan of one work item: which (query block, KV tile) pairs are computed, which need an
// element-wise mask, which are skipped; grouped into softmax sections.
//
// One mask model for every mode (shared/design/ARCHITECTURE.md): each query row i of KV batch
// kv_b may attend exactly the concatenated-KV indices in one interval [lo(i), hi(i)), the
// intersection of the causal, sliding-window and packing constraints over positions that
// include the prefix and the context-parallel offsets. A tile is skipped when no row of the
// block meets it, computed unmasked when every row covers the part that is computed, and masked
// element-wise otherwise. Computed columns are cut to the union of the rows' intervals, so the
// diagonal tile of a causal block stops at the last key that exists for its rows.
#ifndef FLASHCTE_SRC_KERNEL_PLAN_H_
#define FLASHCTE_SRC_KERNEL_PLAN_H_

#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/problem.h"

namespace flashcte::internal {

// The problem's tile sizes: the caller's Problem::tile_request where set, this machine's choices
// for its zero fields (`native_bf16`: the problem runs on the vdpbf16ps kernels; `lanes`: floats
// per vector of the float32 kernels' SIMD target). Every field of the result is set.
TileConfig resolve_tiles(const Problem& problem, bool native_bf16, int64_t lanes);

// Query rows resident at once in one recurrence (the score buffer's height). A work item's
// q_block rows share each packed K/V tile; they are computed kSubBlockRows at a time so that the
// scores stay small. 48 = 8 register blocks of the 6-row float32 micro-kernels, and 12 of the
// native bfloat16 QK's 4 rows and 6 of its PV's 8 (native_ops.cc); a sub-block of 48 x 256 scores
// is 48 KiB, L1/L2 resident.
constexpr int64_t kSubBlockRows = 48;

// The rows [row0, row0 + rows) of query block `q_block`.
struct QueryBlock {
  int64_t row0 = 0, rows = 0;
};
QueryBlock query_block(const Problem& problem, const TileConfig& tiles, int64_t q_block);
int64_t num_q_blocks(const Problem& problem, const TileConfig& tiles);

struct RowInterval {
  int64_t lo = 0, hi = 0;  // allowed concatenated-KV indices [lo, hi); empty when lo >= hi
};

// The allowed interval of local query row i against KV batch kv_b (SEMANTICS.md steps 2-3).
RowInterval row_interval(const Problem& problem, int64_t kv_b, int64_t i);

struct TileWork {
  int64_t begin = 0, end = 0;  // computed concatenated-KV columns [begin, end)
  bool masked = false;         // some row does not cover [begin, end)
};

struct SectionWork {
  int64_t begin = 0;       // the section's first column (on the section grid)
  int64_t first_tile = 0;  // its computed tiles are BlockPlan::tiles[first_tile, end_tile)
  int64_t end_tile = 0;
};

// Flat vectors so that a reused plan allocates nothing once warm.
struct BlockPlan {
  std::vector<TileWork> tiles;        // computed tiles only, ascending
  std::vector<SectionWork> sections;  // sections with at least one computed tile
  int64_t tiles_full = 0, tiles_masked = 0, tiles_skipped = 0;
  int64_t computed_columns = 0;  // sum over computed tiles of (end - begin)
};

// Length of the softmax section for KV batch kv_b (the whole KV axis below the threshold).
int64_t section_length(const Problem& problem, const TileConfig& tiles, int64_t kv_b);

// Plans `rows` query rows against KV batch kv_b; `intervals` holds their row_interval()s.
// Reuses plan's storage.
void plan_block(const Problem& problem, const TileConfig& tiles, int64_t kv_b,
                const RowInterval* intervals, int64_t rows, BlockPlan* plan);

// What the recurrence computes for one query block over the whole KV axis, counted as its
// sub-blocks plan it: (sub-block, tile) pairs per head and the query-key pairs computed.
struct BlockCounts {
  int64_t tiles_full = 0, tiles_masked = 0, tiles_skipped = 0;
  int64_t pairs_computed = 0;  // rows x computed columns, summed over sub-blocks
  int64_t pairs_useful = 0;    // unmasked (query, key) pairs
};
BlockCounts count_block(const Problem& problem, const TileConfig& tiles, int64_t kv_b,
                        int64_t q_block);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_PLAN_H_
