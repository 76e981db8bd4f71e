// The one form every entry point's call takes before its kernels run, and the one router and
// runner. attention_cte (rank 3 and 4), decode_attention and the KV-cache calls (dense, paged,
// varlen, planned) each validate their arguments into a Step: every sequence with query rows as
// its kernel's problem. route() is the rule that sends a KV-cache call's sequences to the decode
// or the prefill kernel, run_step() runs any Step in one parallel region.
#ifndef FLASHCTE_SRC_DISPATCH_STEP_H_
#define FLASHCTE_SRC_DISPATCH_STEP_H_

#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/problem.h"
#include "src/dispatch/kvcache.h"
#include "src/kernel/decode.h"
#include "src/schedule/region.h"

namespace flashcte::internal {

struct Step {
  std::vector<DecodeProblem> decodes;
  std::vector<Problem> prefills;
};

// A validated KV-cache request's sequences onto their kernels, added to `step`: the whole batch
// as one decode problem when every sequence has the same kDecodeMaxQueries query rows or fewer,
// else sequence by sequence (a varlen request, longer chunks): a decode problem of its own
// (decode_problem) up to kDecodeMaxQueries rows, a prefill problem over its cache
// (prefill_problem) past them, none without rows. The request is consumed.
void route(KvCacheRequest&& request, Step* step);

// Every kernel of the step in one parallel region (src/schedule/region.h) on `threads` threads
// (0: OpenMP's default); `profile`, when given, receives each thread's busy time.
inline void run_step(const Step& step, int threads, ThreadProfile* profile = nullptr) {
  run_kernels(step.prefills, step.decodes, threads, profile);
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_STEP_H_
