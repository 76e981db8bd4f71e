// Several kernels' work in one parallel region: the prefill items of attention_cte problems and
// the chunks of decode problems, as a serving engine's mixed batch brings them (long prompt
// chunks next to sequences decoding a token each). Every item of every kernel goes into one list,
// ordered by its estimated time, largest first, and handed out dynamically; then every merge
// (split prefill items, decode pairs with several chunks). So a thread that finishes its share of
// a long chunk takes decode chunks, and no thread waits at a join between the two kinds.
//
// Each item and merge is the kernels' own, computed by one thread in a fixed arithmetic order:
// results are bitwise those of the kernels run one by one, for any thread count.
#ifndef FLASHCTE_SRC_SCHEDULE_REGION_H_
#define FLASHCTE_SRC_SCHEDULE_REGION_H_

#include <vector>

#include "src/kernel/attention.h"
#include "src/kernel/decode.h"
#include "src/schedule/parallel.h"

namespace flashcte::internal {

// Runs every item and merge of the problems' kernels on `threads` threads (0: OpenMP's default;
// never more than there are items). `profile`, when given, receives each thread's busy time.
void run_kernels(const std::vector<Problem>& prefill, const std::vector<DecodeProblem>& decode,
                 int threads, ThreadProfile* profile = nullptr);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_SCHEDULE_REGION_H_
