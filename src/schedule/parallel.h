// The one parallel region of the schedule: every thread prepares (sizes its scratch for any item),
// then every work item and then every merge runs, on `threads` OpenMP threads with dynamic
// hand-out (largest first when the items are sorted so), or inline on one thread (no region at
// all: for tiny problems its fork and join cost more than the work).
//
// An exception must not leave an OpenMP region (that terminates the process): the first one (a
// failed scratch allocation) is kept, the remaining items are skipped, and it is rethrown here
// for the API layer to turn into a Status. The items and merges allocate nothing once every
// thread has prepared, and none starts before all have: a call short of memory fails before it
// writes a row. Which thread runs which item never changes a result: each item and each merge
// writes its own rows.
#ifndef FLASHCTE_SRC_SCHEDULE_PARALLEL_H_
#define FLASHCTE_SRC_SCHEDULE_PARALLEL_H_

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <vector>

#include "flashcte/kvcache.h"

namespace flashcte::internal {

template <class Prepare, class RunItem, class Merge>
void run_then_merge(int threads, const Prepare& prepare, int64_t items, const RunItem& run_item,
                    int64_t merges, const Merge& merge, ThreadProfile* profile = nullptr) {
  const double start = profile ? omp_get_wtime() : 0.0;
  if (profile) profile->busy_seconds.assign(static_cast<size_t>(threads), 0.0);
  if (threads == 1) {
    prepare();
    for (int64_t i = 0; i < items; ++i) run_item(i);
    for (int64_t i = 0; i < merges; ++i) merge(i);
    if (profile) profile->busy_seconds[0] = profile->wall_seconds = omp_get_wtime() - start;
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
    double busy = 0;
    const auto timed = [&](auto&& body) {
      if (!profile) return guarded(body);
      const double t0 = omp_get_wtime();
      guarded(body);
      busy += omp_get_wtime() - t0;
    };
    timed(prepare);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) timed([&] { run_item(i); });
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < merges; ++i) timed([&] { merge(i); });
    if (profile) profile->busy_seconds[static_cast<size_t>(omp_get_thread_num())] = busy;
  }
  if (profile) profile->wall_seconds = omp_get_wtime() - start;
  if (failure) std::rethrow_exception(failure);
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_SCHEDULE_PARALLEL_H_
