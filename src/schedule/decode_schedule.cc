#include "src/schedule/decode_schedule.h"

#include <vector>

#include "src/schedule/region.h"
#include "src/schedule/schedule.h"

namespace flashcte::internal {

namespace {

// KV heads per item where a slot's heads lie side by side: all of them, unless that leaves fewer
// than two items per thread (a short cache), then the largest divisor of kv_heads that does not.
// Any grouping gives the same bytes: each pair's arithmetic is its own.
int64_t heads_per_item(const DecodeKernel& kernel) {
  const DecodeProblem& p = kernel.problem();
  int64_t chunks = 0;
  for (int64_t b = 0; b < p.batch; ++b) chunks += kernel.num_chunks(b);
  const int64_t threads = resolve_threads(p.threads, chunks * p.kv_heads);
  for (int64_t heads = p.kv_heads; heads > 1; --heads) {
    if (p.kv_heads % heads == 0 && chunks * (p.kv_heads / heads) >= 2 * threads) return heads;
  }
  return 1;
}

}  // namespace

std::vector<DecodeItem> make_decode_items(const DecodeKernel& kernel, int64_t* partials) {
  const DecodeProblem& p = kernel.problem();
  const int64_t batch = kernel.num_pairs() / p.kv_heads;
  // Partial states pair by pair, chunk by chunk: the merge reads a pair's in chunk order.
  std::vector<int64_t> first(static_cast<size_t>(kernel.num_pairs()), -1);
  int64_t next_partial = 0;
  std::vector<DecodeItem> items;
  for (int64_t pair = 0; pair < kernel.num_pairs(); ++pair) {
    const int64_t chunks = kernel.num_chunks(pair / p.kv_heads);
    if (chunks > 1) {
      first[static_cast<size_t>(pair)] = next_partial;
      next_partial += chunks;
    }
  }
  // Items sequence by sequence: where each KV head's slots lie together ((batch, heads, seqlen,
  // d); vLLM's pages by the same rule), pair by pair, each KV head's slots one chunk after
  // another, so each thread stays on one stream. Where a slot's heads lie side by side
  // (FlashAttention's (batch, seqlen, heads, d) and its pages: head stride < slot stride), one
  // item takes a chunk of several KV heads, and the kernel reads them block by block with the
  // heads one after another (DecodeKernel::run): each stretch of memory is read in one go where
  // head by head a stream reads d of every heads x d elements. AMD EPYC Zen 4 (AVX3), 2 threads,
  // batch 1, 32/8 heads, d = 128, bf16, 32768 cached, flash_attn_with_kvcache on numpy arrays,
  // six interleaved rounds of 15 calls:
  //   (batch, seqlen, heads, d): chunk by chunk, one head per item, 9.2-13.3 ms; heads together
  //     6.4-7.2 ms (16 bytes past a line: 0.99-1.07x that; bench/alignment.py);
  //   FlashAttention's pages ((blocks, 16, heads, d), the table shuffled), six rounds of 21 calls:
  //     8.5-12.2 ms -> 6.7-7.9 (per-round ratio, median 0.75);
  //   the (batch, heads, seqlen, d) view of the same values, pair by pair: 4.9-7.4 ms before,
  //     5.3-5.9 after (per-round ratio over 16 rounds: median 1.0);
  //   (batch, heads, seqlen, d) chunk by chunk instead of pair by pair (`flashcte bench --decode`,
  //     3 rounds of 9 reps): 5.4-5.8 ms against 4.6-5.0 (batch 8 at 4096: 5.1-7.0 against
  //     5.3-5.7).
  // The reads alone (rows of 256 bytes every 2 KiB over 128 MiB, 2 threads): head by head 14 GB/s,
  // chunks of 1024 slots with the heads inner 15-17, blocks of 64 slots with the heads inner 20
  // (22-25 prefetching a block ahead), all of it in order 25-27.
  const bool heads_inner = p.k.strides[1] < p.k.strides[2];
  const int64_t heads = heads_inner ? heads_per_item(kernel) : 1;
  const auto add = [&](int64_t pair, int64_t c) {
    const int64_t base = first[static_cast<size_t>(pair)];
    items.push_back({pair, heads, c, base >= 0 ? base + c : -1});
  };
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t chunks = kernel.num_chunks(b);
    if (heads_inner) {
      for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t h = 0; h < p.kv_heads; h += heads) add(b * p.kv_heads + h, c);
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

}  // namespace flashcte::internal
