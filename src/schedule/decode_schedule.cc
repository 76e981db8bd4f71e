#include "src/schedule/decode_schedule.h"

#include "src/schedule/region.h"

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
  run_kernels({}, {&kernel}, kernel.problem().threads);
}

}  // namespace flashcte::internal
