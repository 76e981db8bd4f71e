// The router of the KV-cache calls (step.h).
#include "src/dispatch/step.h"

#include <utility>

namespace flashcte::internal {

void route(KvCacheRequest&& request, Step* step) {
  if (request.decode.tokens <= kDecodeMaxQueries) {
    step->decodes.push_back(std::move(request.decode));
    return;
  }
  for (int64_t b = 0; b < request.decode.batch; ++b) {
    step->prefills.push_back(prefill_problem(request, b));
  }
}

}  // namespace flashcte::internal
