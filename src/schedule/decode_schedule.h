// The decode kernel's work over threads. A work item is one chunk of one (sequence, KV head)
// pair, or of several KV heads of a sequence where the cache holds them side by side
// (src/kernel/decode.h); chunk boundaries are the kernel's, fixed by the problem. Items are
// handed out dynamically in a fixed order; pairs with several chunks park a partial state per
// chunk and are merged afterwards in chunk order, each pair by one thread. Which thread ran which
// chunk changes nothing in the arithmetic, so results are bitwise identical for any thread count.
#ifndef FLASHCTE_SRC_SCHEDULE_DECODE_SCHEDULE_H_
#define FLASHCTE_SRC_SCHEDULE_DECODE_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "src/kernel/decode.h"

namespace flashcte::internal {

struct DecodeItem {
  int64_t pair = 0;   // the first of its pairs
  int64_t heads = 1;  // pairs [pair, pair + heads), KV heads of one sequence
  int64_t chunk = 0;
  int64_t partial = -1;  // index of its first pair's partial state, -1 when there is one chunk
};

// Every work item of the problem, sequence by sequence, in the order the cache lies in memory
// (decode_schedule.cc; partial states numbered pair by pair, chunk by chunk); `partials` receives
// the number of partial states they park.
std::vector<DecodeItem> make_decode_items(const DecodeKernel& kernel, int64_t* partials);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_SCHEDULE_DECODE_SCHEDULE_H_
