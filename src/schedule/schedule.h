// Work items and their split over threads. A work item is one query block of one GQA group
// (every query head sharing a KV batch), so each packed K/V tile serves the whole group. Items
// are costed by the query-key pairs they really compute (causal triangles, windows and packing
// make them uneven), handed out largest first, and each is computed by exactly one thread with
// the same code: results are bitwise identical for any thread count.
//
// When a problem has too few items to keep every core busy (one head, few query rows, long KV),
// each item's KV axis is split into ranges computed separately and merged with the flash
// recurrence. The split depends on the problem only, never on the thread count, so results stay
// bitwise identical across thread counts.
#ifndef FLASHCTE_SRC_SCHEDULE_SCHEDULE_H_
#define FLASHCTE_SRC_SCHEDULE_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "src/kernel/attention.h"

namespace flashcte::internal {

struct WorkItem {
  int64_t item = 0;   // the kernel's item index
  int64_t split = 0;  // which KV range, when the KV axis is split
  int64_t kv_begin = 0, kv_end = 0;
  double cost = 0;  // the kernel's relative cost of the range
};

// How many KV ranges each item is split into (1: none).
int64_t kv_splits(const AttentionKernel& kernel);

// All work items of the problem, item by item and split by split (run_kernels orders the
// region's items by cost).
std::vector<WorkItem> make_work_items(const AttentionKernel& kernel);

// The number of threads a run with `num_items` work items uses (requested: Options::num_threads,
// 0 = OpenMP's default).
int resolve_threads(int requested, int64_t num_items);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_SCHEDULE_SCHEDULE_H_
