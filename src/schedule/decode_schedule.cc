#include "src/schedule/decode_schedule.h"

#include <vector>

#include "src/schedule/region.h"

namespace flashcte::internal {

std::vector<DecodeItem> make_decode_items(const DecodeKernel& kernel, int64_t* partials) {
  const DecodeProblem& p = kernel.problem();
  const int64_t batch = kernel.num_pairs() / p.kv_heads;
  // Partial states pair by pair, chunk by chunk: the merge reads a pair's in chunk order.
  std::vector<int64_t> first(static_cast<size_t>(kernel.num_pairs()), -1);
  int64_t next_partial = 0;
  for (int64_t pair = 0; pair < kernel.num_pairs(); ++pair) {
    const int64_t chunks = kernel.num_chunks(pair / p.kv_heads);
    if (chunks > 1) {
      first[static_cast<size_t>(pair)] = next_partial;
      next_partial += chunks;
    }
  }
  // Items sequence by sequence, and within one either pair by pair (each KV head's slots one
  // chunk after another) or chunk by chunk with a chunk's KV heads one after another, as the
  // cache lies in memory. Where a slot's heads lie side by side (FlashAttention's (batch, seqlen,
  // heads, d): head stride < slot stride), chunk by chunk reads each stretch of memory once; a
  // row that starts past a cache line (numpy's 16 bytes) shares its last line with the next
  // head's row, which pair by pair over a long cache fetched twice from DRAM. Where each head's
  // slots lie together ((batch, heads, seqlen, d); vLLM's pages by the same rule, not measured
  // chunk by chunk), pair by pair keeps each thread on one stream. AMD EPYC Zen 4 (AVX3), 2
  // threads, batch 1, 32/8 heads, d = 128, bf16:
  //   (batch, seqlen, heads, d), 32768 cached, bench/alignment.py, 21 interleaved rounds:
  //     pair by pair 10.7-11.2 ms aligned, 1.26x that 16 bytes past a line (two runs);
  //     chunk by chunk 7.9-9.6 ms aligned, 1.065-1.09x that 16 bytes past in four runs and
  //     1.21-1.24x in two;
  //   (batch, heads, seqlen, d), `flashcte bench --decode`, 3 rounds of 9 reps: chunk by chunk
  //     5.4-5.8 ms at 32768 cached against 4.6-5.0 pair by pair (batch 8 at 4096: 5.1-7.0
  //     against 5.3-5.7).
  const bool heads_inner = p.k.strides[1] < p.k.strides[2];
  std::vector<DecodeItem> items;
  const auto add = [&](int64_t pair, int64_t c) {
    const int64_t base = first[static_cast<size_t>(pair)];
    items.push_back({pair, c, base >= 0 ? base + c : -1});
  };
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t chunks = kernel.num_chunks(b);
    if (heads_inner) {
      for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t h = 0; h < p.kv_heads; ++h) add(b * p.kv_heads + h, c);
      }
    } else {
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        for (int64_t c = 0; c < chunks; ++c) add(b * p.kv_heads + h, c);
      }
    }
  }
  *partials = next_partial;
  return items;
}

void run_decode(const DecodeKernel& kernel) {
  run_kernels({}, {&kernel}, kernel.problem().threads);
}

}  // namespace flashcte::internal
