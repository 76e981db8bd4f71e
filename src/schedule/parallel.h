// The one parallel region of the schedule: every work item, then every merge, on `threads` OpenMP
// threads with dynamic hand-out (largest first when the items are sorted so), or inline on one
// thread (no region at all: for tiny problems its fork and join cost more than the work).
//
// An exception must not leave an OpenMP region (that terminates the process): the first one (a
// failed scratch allocation) is kept, the remaining items are skipped, and it is rethrown here
// for the API layer to turn into a Status. Which thread runs which item never changes a result:
// each item and each merge writes its own rows.
#ifndef FLASHCTE_SRC_SCHEDULE_PARALLEL_H_
#define FLASHCTE_SRC_SCHEDULE_PARALLEL_H_

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <exception>

namespace flashcte::internal {

template <class RunItem, class Merge>
void run_then_merge(int threads, int64_t items, const RunItem& run_item, int64_t merges,
                    const Merge& merge) {
  if (threads == 1) {
    for (int64_t i = 0; i < items; ++i) run_item(i);
    for (int64_t i = 0; i < merges; ++i) merge(i);
    return;
  }
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
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) guarded([&] { run_item(i); });
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < merges; ++i) guarded([&] { merge(i); });
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_SCHEDULE_PARALLEL_H_
