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

#include "src/dispatch/problem.h"

namespace flashcte::internal {

// Fills the zero fields of problem->tiles with this machine's choices.
void resolve_tiles(Problem* problem);

struct RowInterval {
  int64_t lo = 0, hi = 0;  // allowed concatenated-KV indices [lo, hi); empty when lo >= hi
};

// The allowed interval of local query row i against KV batch kv_b (SEMANTICS.md steps 2-3).
RowInterval row_interval(const Problem& p, int64_t kv_b, int64_t i);

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
int64_t section_length(const Problem& p, int64_t kv_b);

// Plans query rows [row_begin, row_end) against KV batch kv_b; `intervals` holds their
// row_interval()s. Reuses plan's storage.
void plan_block(const Problem& p, int64_t kv_b, const RowInterval* intervals, int64_t rows,
                BlockPlan* plan);

int64_t num_q_blocks(const Problem& p);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_PLAN_H_
