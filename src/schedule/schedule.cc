#include "src/schedule/schedule.h"

#include <omp.h>

#include <algorithm>

#include "src/kernel/attention.h"
#include "src/kernel/plan.h"
#include "src/simd/ops.h"

namespace flashcte::internal {
namespace {

// Per query row and head, the fixed work besides the pairs (Q packing, the softmax state and
// the write-back), in units of one query-key pair; keeps empty rows from costing nothing.
constexpr double kRowOverheadPairs = 16.0;

}  // namespace

std::vector<WorkItem> make_work_items(const Problem& p) {
  std::vector<WorkItem> items;
  const int64_t blocks = num_q_blocks(p);
  items.reserve(static_cast<size_t>(p.kv_batch * blocks));
  for (int64_t kv_b = 0; kv_b < p.kv_batch; ++kv_b) {
    for (int64_t qb = 0; qb < blocks; ++qb) {
      const int64_t row0 = qb * p.tiles.q_block;
      const int64_t row1 = std::min(p.seqlen_q, row0 + p.tiles.q_block);
      double pairs = 0;
      for (int64_t i = row0; i < row1; ++i) {
        const RowInterval iv = row_interval(p, kv_b, i);
        pairs += static_cast<double>(iv.hi - iv.lo) + kRowOverheadPairs;
      }
      items.push_back({kv_b, qb, pairs * static_cast<double>(p.group)});
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
  // Largest first with dynamic hand-out: the longest-processing-time rule, which keeps the
  // causal triangle's long rows from landing on one thread at the end.
#pragma omp parallel for schedule(dynamic, 1) num_threads(resolve_threads(p, n))
  for (int64_t i = 0; i < n; ++i) {
    run_work_item(p, ops, items[i].kv_batch, items[i].q_block);
  }
}

}  // namespace flashcte::internal
