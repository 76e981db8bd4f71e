// flashcte flash_attn_with_kvcache: FlashAttention's serving entry point on the CPU. New keys
// and values are appended into a dense or paged KV cache in place, rotary embedding is applied to
// them and to the queries at their absolute positions, and the queries attend the cache, in one
// call. The semantics are FlashAttention's (flash_attn_interface.py, flash_attn_with_kvcache, and
// its tests); the differences are listed at the function.
//
// Errors come back as a Status whose message names the argument and the rule it broke; every
// argument is checked before anything is written, and a call that fails leaves the caches
// byte for byte as they were.
#ifndef FLASHCTE_KVCACHE_H_
#define FLASHCTE_KVCACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "flashcte/decode.h"
#include "flashcte/flashcte.h"

namespace flashcte {

// Everything besides q, the caches and the outputs. Tensors are optional (absent by default).
struct KvCacheOptions {
  // New keys and values, (batch, seqlen_new, kv_heads, d) and (batch, seqlen_new, kv_heads, dv)
  // in q's dtype, both or neither: written into sequence b's slots [cache_seqlens[b],
  // cache_seqlens[b] + seqlen_new) before the attention.
  TensorView k;
  TensorView v;
  // Rotary embedding, both or neither, only with k and v: (seqlen_ro, rotary_dim / 2) in q's
  // dtype or float32, rotary_dim even and <= d. The new key t of sequence b is rotated at position
  // cache_seqlens[b] + t; the queries at cache_seqlens[b] + i when causal or with a window, else
  // all at cache_seqlens[b]. The first rotary_dim channels rotate, the rest pass through.
  TensorView rotary_cos;
  TensorView rotary_sin;
  bool rotary_interleaved = true;  // pairs (0, 1), (2, 3), ...; false: GPT-NeoX (i, i + rd / 2)
  // (batch,) int32: the tokens already in each sequence's cache. Absent: every cache is full
  // (seqlen_cache, or max_blocks_per_seq * page_block_size); then k and v cannot be appended.
  TensorView cache_seqlens;
  // (batch,) int32, dense caches only: sequence b uses cache row cache_batch_idx[b] of
  // (batch_cache, ...). Absent: row b (batch_cache == batch).
  TensorView cache_batch_idx;
  // (batch,) int32: sequence b's cache starts at slot cache_leftpad[b] (<= cache_seqlens[b]);
  // earlier slots are never read.
  TensorView cache_leftpad;
  // A paged cache: (batch, max_blocks_per_seq) int32, the caches then (num_blocks,
  // page_block_size, kv_heads, d), any page_block_size >= 1. Slot j of sequence b is row
  // j % page_block_size of page block_table[b, j / page_block_size]. The entries of the pages
  // holding a slot that a query row sees or the append writes must be in [0, num_blocks); the
  // others are not looked at (pages an engine freed before a sliding window may hold anything),
  // except that a chunk of more than 16 queries reads whole tiles: every page of its slots
  // [0, cache_seqlens[b] + seqlen_new).
  TensorView block_table;
  // 8-bit caches (k_cache / v_cache of int8, float8_e4m3fn or float8_e5m2): the float32
  // dequantization scales, cache element c standing for c x scale; required with an 8-bit cache
  // and refused with a float one. K and V may differ in format and granularity.
  //   (1,) or (kv_heads,)  one per cache or per KV head, read: each finite and > 0; the appended
  //                        k / v are quantized with it
  //   per token            the cache's shape without its last axis, (batch_cache, seqlen_cache,
  //                        kv_heads) or, paged, (num_blocks, page_block_size, kv_heads): read
  //                        like the cache; the append writes its new tokens' entries (quantize_kv)
  // The append rounds to nearest even and saturates (quantize_kv); int8 holds no NaN, so a NaN
  // in an appended int8 row is refused. Not in FlashAttention's call (vLLM's k_scale, v_scale).
  MutableTensorView k_scale;
  MutableTensorView v_scale;
  // (heads,) or (batch, heads) float32: score(i, j) -= slope * |i + seqlen_k - seqlen_q - j|.
  TensorView alibi_slopes;
  // (heads,) float32: an attention sink per query head, a logit that joins every row's softmax
  // without a value (gpt-oss); -inf: none. Not in FlashAttention's call.
  TensorView sinks;
  std::optional<float> softmax_scale;  // default 1 / sqrt(d)
  bool causal = false;                 // bottom-right aligned
  // Query i sees keys j with i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
  // right, -1 unbounded; causal sets right to 0.
  int64_t window_left = -1;
  int64_t window_right = -1;
  float softcap = 0.0f;  // > 0: score -> softcap * tanh(score / softcap), before ALiBi
  int num_threads = 0;   // 0: OpenMP's default. Results are bitwise identical for any count.
};

// Attention of q (batch, seqlen_q, heads, d) over each sequence's cache after the append:
//   k_cache, v_cache  (batch_cache, seqlen_cache, kv_heads, d / dv), or pages (num_blocks,
//                     page_block_size, kv_heads, d / dv) with options.block_table; q's dtype
//                     (float32, bfloat16 or float16) or an 8-bit format with options.k_scale /
//                     v_scale; written in place where k and v are given
//   out               (batch, seqlen_q, heads, dv), q's dtype
//   lse               optional (batch, heads, seqlen_q) float32, log-sum-exp of the scaled
//                     scores
// Sequence b attends slots [cache_leftpad[b], seqlen_k) with seqlen_k = cache_seqlens[b] +
// seqlen_new, masked as in the options; a row with no key to see outputs 0 with lse -inf.
// GQA/MQA: heads a multiple of kv_heads. Any strides: FlashAttention's layouts, their
// permutations, slices.
//
// Where this differs from FlashAttention: any page_block_size from 1 (FlashAttention 2 asks for
// multiples of 256), any even rotary_dim (it asks for multiples of 16), cache_leftpad with a
// paged cache (it refuses the pair), num_splits is not taken (the split of the KV axis is the
// kernel's, fixed by the problem, and results never depend on it); refused where FlashAttention
// leaves the result undefined: a repeated cache_batch_idx entry or a page written by one sequence
// and read by another while k and v are appended, and an empty row's lse is -inf (the
// log-sum-exp of no scores) where FlashAttention 2 writes +inf.
Status flash_attn_with_kvcache(const TensorView& q, const MutableTensorView& k_cache,
                               const MutableTensorView& v_cache, const MutableTensorView& out,
                               const MutableTensorView& lse, const KvCacheOptions& options = {});

// Where the time of a call's parallel region went: each thread's seconds inside work items and
// merges, and the region's wall time, fork to join. busy_seconds[i] / wall_seconds is thread i's
// busy share; a balanced call keeps every share near 1.
struct ThreadProfile {
  std::vector<double> busy_seconds;
  double wall_seconds = 0;
};

// Everything of flash_attn_varlen_kvcache besides q, the caches and the outputs.
struct VarlenKvCacheOptions {
  // (batch + 1,) int32, from 0, non-decreasing, ending at total_q: sequence b's queries are rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and out. Required.
  TensorView cu_seqlens_q;
  // (batch,) int32: the keys in sequence b's cache, its queries' own included (they are its last
  // seqlen_q(b) tokens: bottom-right alignment). Required.
  TensorView seqused_k;
  // A paged cache, as in KvCacheOptions: (batch, max_blocks_per_seq) int32; the caches are then
  // (num_blocks, page_block_size, kv_heads, d). The same rule for its entries: those of the pages
  // holding a slot a query row sees must be in [0, num_blocks) (a chunk of more than 16 queries:
  // every page of its slots [0, seqused_k[b])); the others (pages an engine freed before a sliding
  // window, a sequence without query rows) are not looked at. Absent: dense caches (batch,
  // seqlen_cache, kv_heads, d), row b for sequence b.
  TensorView block_table;
  // 8-bit caches: their float32 scales, as in KvCacheOptions (read only: per token, (batch,
  // seqlen_cache, kv_heads) or, paged, (num_blocks, page_block_size, kv_heads)).
  TensorView k_scale;
  TensorView v_scale;
  // (heads,) or (batch, heads) float32, as in KvCacheOptions.
  TensorView alibi_slopes;
  // (heads,) float32: an attention sink per query head, a logit that joins every row's softmax
  // without a value (gpt-oss); its share of the weight is dropped.
  TensorView sinks;
  std::optional<float> softmax_scale;  // default 1 / sqrt(d)
  bool causal = false;                 // bottom-right aligned
  int64_t window_left = -1;            // as KvCacheOptions
  int64_t window_right = -1;
  float softcap = 0.0f;
  int num_threads = 0;  // 0: OpenMP's default. Results are bitwise identical for any count.
  ThreadProfile* profile = nullptr;  // when set, receives the call's per-thread busy time
};

// A serving engine's mixed batch in one call: variable-length query chunks (FlashAttention's
// flash_attn_varlen_func with block_table and seqused_k; vLLM's attention over query_start_loc
// and seq_lens) over each sequence's cache, read only:
//   q       (total_q, heads, d), float32, bfloat16 or float16
//   k_cache, v_cache  (batch, seqlen_cache, kv_heads, d / dv) or, with options.block_table, pages
//           (num_blocks, page_block_size, kv_heads, d / dv), any page_block_size >= 1; q's dtype
//           or an 8-bit format with options.k_scale / v_scale.
//           The queries' own keys and values are already in the cache (seqused_k counts them).
//   out     (total_q, heads, dv), q's dtype
//   lse     optional (heads, total_q) float32
// Query i of sequence b (seqlen_q(b) queries, seqlen_k = seqused_k[b]) sits at position
// seqlen_k - seqlen_q(b) + i and sees the keys flash_attn_with_kvcache's would. Sequences with a
// few queries (decoding) run on the decode kernel, longer chunks (prefill) on attention_cte, all
// in one parallel region whose work is split by estimated cost, so threads that finish a long
// chunk's share take decode work instead of waiting. Each sequence's result is bitwise what
// flash_attn_with_kvcache gives it alone, for any thread count, paged or dense.
Status flash_attn_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                                 const TensorView& v_cache, const MutableTensorView& out,
                                 const MutableTensorView& lse, const VarlenKvCacheOptions& options);

// One layer's tensors of a planned step (run_varlen_kvcache): the arguments of
// VarlenKvCacheOptions that may differ from layer to layer. Each is given exactly when the plan's
// was, with the plan's dtype, shape and strides.
struct VarlenKvCacheLayer {
  TensorView k_scale;
  TensorView v_scale;
  TensorView alibi_slopes;
  TensorView sinks;
};

// A serving step's flash_attn_varlen_kvcache planned once and run in every layer (FlashInfer's
// plan() / run()). plan_varlen_kvcache checks the whole call on one layer's tensors, as
// flash_attn_varlen_kvcache does, and keeps the step: cu_seqlens_q, seqused_k and the block table
// (copied: run reads none of them), each sequence's slot ranges and kernel, the scalar options.
// run_varlen_kvcache takes a layer's q, caches, outputs and VarlenKvCacheLayer, at any address
// but with the planned dtypes, shapes and strides; checks what may differ (the layouts against
// the plan, that the outputs overlap nothing read, the scales', slopes' and sinks' values) and
// runs the kernels. Its result is bitwise flash_attn_varlen_kvcache's on that layer's tensors.
// The plan keeps no address of the tensors it was made with, nor options.profile: a run's
// `profile`, when given, receives that run's per-thread busy time. Plans are cheap to copy and may
// be run from several threads at once.
struct VarlenKvCachePlan {
  struct State;                        // the validated step (src/dispatch)
  std::shared_ptr<const State> state;  // null until plan_varlen_kvcache succeeds
};
Status plan_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                           const TensorView& v_cache, const MutableTensorView& out,
                           const MutableTensorView& lse, const VarlenKvCacheOptions& options,
                           VarlenKvCachePlan* plan);
Status run_varlen_kvcache(const VarlenKvCachePlan& plan, const TensorView& q,
                          const TensorView& k_cache, const TensorView& v_cache,
                          const MutableTensorView& out, const MutableTensorView& lse,
                          const VarlenKvCacheLayer& layer = {}, ThreadProfile* profile = nullptr);

// quantize_kv: new K or V rows into an 8-bit cache format, for engines that write their own cache
// (vLLM's reshape_and_cache with an fp8 cache, say). dst * scale stands for src:
//   src    (tokens, kv_heads, d) float32, bfloat16 or float16, any strides
//   dst    (tokens, kv_heads, d) int8, float8_e4m3fn or float8_e5m2, any strides (the rows of a
//          dense cache or of pages); written only when the call succeeds
//   scale  float32, the dequantization scale, one of
//            (1,)                 per tensor, read
//            (kv_heads,)          per KV head, read
//            (tokens, kv_heads)   per token and KV head, written: the largest finite |src| of the
//                                 row over the format's largest value (int8 127, e4m3fn 448,
//                                 e5m2 57344), or 1 for a row of zeros
// Each element becomes src / scale (divided in double) rounded to nearest, ties to even, and
// saturated to the format's largest value of its sign, infinities included where the format has
// none (e4m3fn; int8's range is +-127). NaN stays NaN in fp8; int8 has no NaN, so a NaN in src is
// refused (by its index) for an int8 dst. A read scale must be finite and > 0, or the call is
// refused naming the entry. dst must not overlap src or scale.
Status quantize_kv(const TensorView& src, const MutableTensorView& dst,
                   const MutableTensorView& scale);

}  // namespace flashcte

#endif  // FLASHCTE_KVCACHE_H_
