#include "src/schedule/schedule.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>

#include "src/kernel/attention.h"
#include "src/kernel/plan.h"
#include "src/simd/ops.h"

namespace flashcte::internal {
namespace {

// Per query row and head, the fixed work besides the pairs (Q packing, the softmax state and
// the write-back), in units of one query-key pair; keeps empty rows from costing nothing.
constexpr double kRowOverheadPairs = 16.0;

// Below this many (GQA group, query block) items the KV axis is split. 16 keeps up to 16 threads
// busy; a fixed number, not the thread count, so that results do not depend on the thread count.
constexpr int64_t kMinItems = 16;
// A split covers at least this many keys, so the merge (O(rows * dv) per split) stays small next
// to the split's own work (O(rows * keys * d)).
constexpr int64_t kMinSplitKeys = 1024;

int64_t split_length(const Problem& p, int64_t splits) {
  // Whole sections, so a split computes the same sections it would without splitting.
  const int64_t total = p.max_kv_total();
  const int64_t section = section_length(p, 0);
  const int64_t per_split = (total + splits - 1) / splits;
  return (per_split + section - 1) / section * section;
}

}  // namespace

int64_t kv_splits(const Problem& p) {
  const int64_t items = p.kv_batch * num_q_blocks(p);
  if (items == 0 || items >= kMinItems) return 1;
  const int64_t wanted = (kMinItems + items - 1) / items;
  const int64_t possible = std::max<int64_t>(1, p.max_kv_total() / kMinSplitKeys);
  const int64_t splits = std::min(wanted, possible);
  if (splits <= 1) return 1;
  // Sections may make fewer ranges than asked for; count the ones that exist.
  const int64_t length = split_length(p, splits);
  return (p.max_kv_total() + length - 1) / length;
}

std::vector<WorkItem> make_work_items(const Problem& p) {
  std::vector<WorkItem> items;
  const int64_t blocks = num_q_blocks(p);
  const int64_t splits = kv_splits(p);
  const int64_t length = splits > 1 ? split_length(p, splits) : INT64_MAX / 2;
  items.reserve(static_cast<size_t>(p.kv_batch * blocks * splits));
  for (int64_t kv_b = 0; kv_b < p.kv_batch; ++kv_b) {
    for (int64_t qb = 0; qb < blocks; ++qb) {
      const int64_t row0 = qb * p.tiles.q_block;
      const int64_t row1 = std::min(p.seqlen_q, row0 + p.tiles.q_block);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int64_t begin = sp * length, end = splits > 1 ? begin + length : INT64_MAX;
        double pairs = 0;
        for (int64_t i = row0; i < row1; ++i) {
          const RowInterval iv = row_interval(p, kv_b, i);
          const int64_t lo = std::max(iv.lo, begin), hi = std::min(iv.hi, end);
          pairs += static_cast<double>(std::max<int64_t>(hi - lo, 0)) + kRowOverheadPairs;
        }
        items.push_back({kv_b, qb, sp, begin, end, pairs * static_cast<double>(p.group)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

int resolve_threads(const Problem& p, int64_t num_items) {
  const int64_t wanted = p.threads > 0 ? p.threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min(wanted, num_items)));
}

void run_all(const Problem& p) {
  const std::vector<WorkItem> items = make_work_items(p);
  const int64_t n = static_cast<int64_t>(items.size());
  const simd::Ops& ops = simd::ops();
  const int64_t splits = kv_splits(p);
  const int64_t blocks = num_q_blocks(p);
  // Split items park their unnormalized state here until every split of their block is done.
  std::vector<float> partials;
  if (splits > 1) {
    partials.resize(static_cast<size_t>(p.kv_batch * blocks * splits * partial_floats(p)));
  }
  const auto run_item = [&](int64_t i) {
    const WorkItem& it = items[i];
    float* partial = nullptr;
    if (splits > 1) {
      partial = partials.data() +
                ((it.kv_batch * blocks + it.q_block) * splits + it.split) * partial_floats(p);
    }
    run_work_item(p, ops, {it.kv_batch, it.q_block, it.kv_begin, it.kv_end}, partial);
  };
  const auto merge = [&](int64_t i) {
    merge_splits(p, i / blocks, i % blocks, partials.data() + i * splits * partial_floats(p),
                 splits);
  };
  const int threads = resolve_threads(p, n);
  if (threads == 1) {
    // No parallel region at all: for tiny problems its fork and join cost more than the work.
    for (int64_t i = 0; i < n; ++i) run_item(i);
    if (splits > 1) {
      for (int64_t i = 0; i < p.kv_batch * blocks; ++i) merge(i);
    }
    return;
  }
  // An exception must not leave an OpenMP region (that terminates the process): the first one
  // (a failed scratch allocation) is kept, the remaining items are skipped, and it is rethrown
  // here for the API layer to turn into a Status.
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  const auto guarded = [&](auto&& body) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body();
    } catch (...) {
#pragma omp critical(flashcte_failure)
      if (!failure) failure = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };
  // Largest first with dynamic hand-out: the longest-processing-time rule, which keeps the
  // causal triangle's long rows from landing on one thread at the end.
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) guarded([&] { run_item(i); });
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < p.kv_batch * blocks; ++i) guarded([&] { merge(i); });
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace flashcte::internal
