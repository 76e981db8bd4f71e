// The KV-cache calls (include/flashcte/kvcache.h) inside the dispatch layer: each call's
// validator (flash_attn_with_kvcache's, flash_attn_varlen_kvcache's) turns it into one request,
// the decode kernel's problem (each query row's slot range from the cache lengths, the
// bottom-right causal alignment, the window and the left padding), the append that precedes it
// and the masks a longer chunk's prefill kernel takes; the router (step.h) sends each sequence to
// its kernel, after kvcache_api.cc applies the append.
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

// A validated KV-cache call (flash_attn_with_kvcache, or flash_attn_varlen_kvcache's whole
// batch), the one form between the caller's arguments and the kernels: the decode kernel reads
// `decode` as it is when every sequence has the same few rows, route() cuts it by sequence
// otherwise (decode_problem(), prefill_problem()), and the append precedes either.
struct KvCacheRequest {
  DecodeProblem decode;  // its K/V sources address the caches, written through them by the append
  KvAppend append;
  bool paged = false;  // the caches are pages (else rows: cache_batch_idx's, or one per sequence)
  // What the prefill kernel takes as masks where the decode kernel reads decode.slots:
  // FlashAttention's window (-1 unbounded; causal is a right bound of 0) and the left padding.
  int64_t window_left = -1, window_right = -1;
  std::vector<int64_t> leftpad;  // per sequence; empty without cache_leftpad
  // A varlen call's rows: sequence b's are rows [row_start[b], row_start[b + 1]) of the token
  // axis of q, out and lse, whose batch strides are 0; decode.tokens is then 0 and decode.slots
  // (and .diagonal) hold the rows one after another. Empty: every sequence has decode.tokens.
  std::vector<int64_t> row_start;

  int64_t first_row(int64_t b) const { return row_start.empty() ? 0 : row_start[b]; }
  int64_t rows(int64_t b) const {
    return row_start.empty() ? decode.tokens : row_start[b + 1] - row_start[b];
  }
  // Where row t of sequence b is in decode.slots and decode.diagonal.
  int64_t row_index(int64_t b, int64_t t) const { return b * decode.tokens + first_row(b) + t; }
};

// Checks every argument (nothing is written before it returns Ok) and fills the request.
Status validate_kvcache(const TensorView& q, const MutableTensorView& k_cache,
                        const MutableTensorView& v_cache, const MutableTensorView& out,
                        const MutableTensorView& lse, const KvCacheOptions& options,
                        KvCacheRequest* request);

// flash_attn_varlen_kvcache's checks (every rule, the sequences without query rows included)
// and its whole batch as one request with row_start.
Status validate_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                               const TensorView& v_cache, const MutableTensorView& out,
                               const MutableTensorView& lse, const VarlenKvCacheOptions& options,
                               KvCacheRequest* request);

// Sequence b of a validated request as the decode kernel's problem of batch 1.
DecodeProblem decode_problem(const KvCacheRequest& request, int64_t b);

// Sequence b of a validated request as attention_cte's problem: its query heads as the batch,
// its pages (or cache row) as the prior of length seqlen_k with no new keys, FlashAttention's
// masks as a window relative to bottom-right aligned positions, left padding as packing bounds,
// the sinks as attention_cte's. Nothing is checked again: the request holds validated values.
Problem prefill_problem(const KvCacheRequest& request, int64_t b);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_KVCACHE_H_
