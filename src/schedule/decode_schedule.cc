#include "src/schedule/decode_schedule.h"

#include "src/schedule/parallel.h"
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
  // A pair none of whose rows attends a slot has no chunk: the merge of its no partials writes
  // its rows (0, or the sink's share).
  for (int64_t pair = 0; pair < kernel.num_pairs(); ++pair) {
    if (kernel.num_chunks(pair / p.kv_heads) == 0) merges.push_back({pair, 0, 0});
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
  run_then_merge(resolve_threads(p.threads, n), n, run_item, m, merge);
}

}  // namespace flashcte::internal
