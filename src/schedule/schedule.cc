#include "src/schedule/schedule.h"

#include <omp.h>

#include <algorithm>

#include "src/core/math.h"
#include "src/schedule/parallel.h"

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
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

int resolve_threads(int requested, int64_t num_items) {
  const int64_t wanted = requested > 0 ? requested : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, num_items)));
}

void run_all(const AttentionKernel& kernel) {
  const std::vector<WorkItem> items = make_work_items(kernel);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t splits = kv_splits(kernel);
  const int64_t merged = kernel.num_items(), partial_floats = kernel.partial_floats();
  // Split items park their unnormalized state here until every split of their item is done.
  std::vector<float> partials;
  if (splits > 1) partials.resize(static_cast<size_t>(merged * splits * partial_floats));
  const auto run_item = [&](int64_t i) {
    const WorkItem& it = items[i];
    float* partial = nullptr;
    if (splits > 1) partial = partials.data() + (it.item * splits + it.split) * partial_floats;
    kernel.run(it.item, it.kv_begin, it.kv_end, partial);
  };
  const auto merge = [&](int64_t i) {
    kernel.merge(i, partials.data() + i * splits * partial_floats, splits);
  };
  // Largest first with dynamic hand-out: the longest-processing-time rule, which keeps the
  // causal triangle's long rows from landing on one thread at the end.
  run_then_merge(resolve_threads(kernel.problem().threads, n), n, run_item, splits > 1 ? merged : 0,
                 merge);
}

}  // namespace flashcte::internal
