#include "src/schedule/schedule.h"

#include <omp.h>

#include <algorithm>

#include "src/core/math.h"
#include "src/schedule/region.h"

namespace flashcte::internal {
namespace {

// Below this many (GQA group, query block) items the KV axis is split. 16 keeps up to 16 threads
// busy; a fixed number, not the thread count, so that results do not depend on the thread count.
// Chosen, not measured: the smallest count that fills the 2..16-core machines this runs on.
constexpr int64_t kMinItems = 16;
// A split covers at least this many keys, so the merge (O(rows * dv) per split) stays small next
// to the split's own work (O(rows * keys * d)).
constexpr int64_t kMinSplitKeys = 1024;

int64_t split_length(const AttentionKernel& kernel, int64_t splits) {
  // Whole granules (the kernel's sections), so a split computes what it would unsplit.
  return round_up(ceil_div(kernel.kv_length(), splits), kernel.split_granule());
}

}  // namespace

int64_t kv_splits(const AttentionKernel& kernel) {
  const int64_t items = kernel.num_items();
  if (items == 0 || items >= kMinItems) return 1;
  const int64_t wanted = ceil_div(kMinItems, items);
  const int64_t possible = std::max<int64_t>(1, kernel.kv_length() / kMinSplitKeys);
  const int64_t splits = std::min(wanted, possible);
  if (splits <= 1) return 1;
  // Granules may make fewer ranges than asked for; count the ones that exist.
  return ceil_div(kernel.kv_length(), split_length(kernel, splits));
}

std::vector<WorkItem> make_work_items(const AttentionKernel& kernel) {
  std::vector<WorkItem> items;
  const int64_t splits = kv_splits(kernel);
  const int64_t length = splits > 1 ? split_length(kernel, splits) : INT64_MAX / 2;
  items.reserve(static_cast<size_t>(kernel.num_items() * splits));
  for (int64_t item = 0; item < kernel.num_items(); ++item) {
    for (int64_t split = 0; split < splits; ++split) {
      const int64_t begin = split * length, end = splits > 1 ? begin + length : INT64_MAX;
      items.push_back({item, split, begin, end, kernel.cost(item, begin, end)});
    }
  }
  return items;
}

int resolve_threads(int requested, int64_t num_items) {
  const int64_t wanted = requested > 0 ? requested : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, num_items)));
}

}  // namespace flashcte::internal
