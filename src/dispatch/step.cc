// The router of the KV-cache calls (step.h).
#include "src/dispatch/step.h"

#include <utility>

namespace flashcte::internal {

void route(KvCacheRequest&& request, Step* step) {
  if (request.row_start.empty() && request.decode.tokens <= kDecodeMaxQueries) {
    step->decodes.push_back(std::move(request.decode));
    return;
  }
  for (int64_t b = 0; b < request.decode.batch; ++b) {
    const int64_t rows = request.rows(b);
    if (rows == 0) continue;  // a varlen sequence without query rows
    if (rows <= kDecodeMaxQueries) {
      step->decodes.push_back(decode_problem(request, b));
    } else {
      step->prefills.push_back(prefill_problem(request, b));
    }
  }
}

}  // namespace flashcte::internal
