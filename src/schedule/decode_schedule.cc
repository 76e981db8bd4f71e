#include "src/schedule/decode_schedule.h"

#include <omp.h>

#include <atomic>
#include <exception>

#include "src/schedule/schedule.h"

namespace flashcte::internal {

std::vector<DecodeItem> make_decode_items(const DecodeKernel& kernel, int64_t* partials) {
  const DecodeProblem& p = kernel.problem();
  std::vector<DecodeItem> items;
  int64_t next_partial = 0;
  for (int64_t pair = 0; pair < kernel.num_pairs(); ++pair) {
    const int64_t chunks = kernel.num_chunks(pair / p.kv_heads);
    for (int64_t c = 0; c < chunks; ++c) {
      items.push_back({pair, c, chunks > 1 ? next_partial++ : -1});
    }
  }
  *partials = next_partial;
  return items;
}

void run_decode(const DecodeKernel& kernel) {
  const DecodeProblem& p = kernel.problem();
  int64_t num_partials = 0;
  const std::vector<DecodeItem> items = make_decode_items(kernel, &num_partials);
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t partial_floats = kernel.partial_floats();
  std::vector<float> partials(static_cast<size_t>(num_partials * partial_floats));
  // The pairs to merge, with the index of their first partial (their chunks' are consecutive).
  std::vector<DecodeItem> merges;
  for (const DecodeItem& it : items) {
    if (it.chunk == 0 && it.partial >= 0) merges.push_back(it);
  }
  const int64_t m = static_cast<int64_t>(merges.size());
  const auto run_item = [&](int64_t i) {
    const DecodeItem& it = items[i];
    kernel.run(it.pair, it.chunk,
               it.partial >= 0 ? partials.data() + it.partial * partial_floats : nullptr);
  };
  const auto merge = [&](int64_t i) {
    kernel.merge(merges[i].pair, partials.data() + merges[i].partial * partial_floats);
  };
  const int threads = resolve_threads(p.threads, n);
  if (threads == 1) {
    // No parallel region: for a single short sequence its fork and join cost more than the work.
    for (int64_t i = 0; i < n; ++i) run_item(i);
    for (int64_t i = 0; i < m; ++i) merge(i);
    return;
  }
  // As in schedule.cc: the first exception (a failed scratch allocation) is kept, the remaining
  // items are skipped, and it is rethrown outside the region for the API to report.
  std::exception_ptr failure;
  std::atomic<bool> failed{false};
  const auto guarded = [&](auto&& body) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      body();
    } catch (...) {
#pragma omp critical(flashcte_decode_failure)
      if (!failure) failure = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  };
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) guarded([&] { run_item(i); });
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < m; ++i) guarded([&] { merge(i); });
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace flashcte::internal
