// flash_attn_with_kvcache (include/flashcte/kvcache.h) inside the dispatch layer: the validator
// turns the call into the decode kernel's problem (each query row's slot range from the cache
// lengths, the bottom-right causal alignment, the window and the left padding) and the append
// that precedes it; kvcache_api.cc applies the append and runs the kernel.
#ifndef FLASHCTE_SRC_DISPATCH_KVCACHE_H_
#define FLASHCTE_SRC_DISPATCH_KVCACHE_H_

#include <cstdint>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/core/problem.h"
#include "src/kernel/decode.h"

namespace flashcte::internal {

// Query rows per sequence up to which the decode kernel runs the call; longer chunks go to
// attention_cte with the cache as its prior (decode.h: past ~16 new tokens the arithmetic per
// cached byte outgrows the bandwidth, and the decode kernel keeps every query row of a KV head
// resident). The prefill kernel packs whole tiles, so there every page of [0, seqlen_k) is read.
inline constexpr int64_t kDecodeMaxQueries = 16;

// The new keys and values, where they go, and the rotary embedding of them and of the queries.
struct KvAppend {
  int64_t tokens = 0;          // seqlen_new; 0: nothing is written
  TensorView k, v;             // (batch, seqlen_new, kv_heads, d / dv)
  std::vector<int64_t> start;  // per sequence: the slot of its first new token (cache_seqlens)
  // Rotary: the first rotary_dim channels of q and the new k turn; 0: none.
  int64_t rotary_dim = 0;
  TensorView cos, sin;  // (seqlen_ro, rotary_dim / 2)
  bool interleaved = true;
  // Query i of sequence b turns at start[b] + i (causal or windowed); else all at start[b].
  bool q_per_token = false;
};

// Checks every argument (nothing is written before it returns Ok) and fills the decode problem
// (its K/V sources address the caches, written through them by the append) and the append.
Status validate_kvcache(const TensorView& q, const MutableTensorView& k_cache,
                        const MutableTensorView& v_cache, const MutableTensorView& out,
                        const MutableTensorView& lse, const KvCacheOptions& options,
                        DecodeProblem* problem, KvAppend* append);

// Sequence b of a validated call whose queries run on attention_cte: its query heads as the
// batch, the cache (its pages, or its cache row) as the prior of length seqlen_k with no new
// keys, FlashAttention's masks as a window relative to bottom-right aligned positions, left
// padding as packing bounds, the sinks as attention_cte's. The problem reads only the caller's
// tensors and its own copies.
Status prefill_problem(const DecodeProblem& p, const KvAppend& a, const MutableTensorView& k_cache,
                       const MutableTensorView& v_cache, const KvCacheOptions& o, int64_t b,
                       Problem* problem);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_KVCACHE_H_
