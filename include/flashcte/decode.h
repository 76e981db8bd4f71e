// flashcte decode: token generation against a KV cache (shared/spec/LAYER.md sections 6 and 7).
//
// A few new query tokens per sequence (decode: 1; speculation or a short chunk: a handful)
// attend the cache slots up to their own position. The cache is the module's layout,
// (batch, kv_heads, max_len, head_dim), not transposed, and slot j holds the token at position
// j; the caller writes the new tokens' K and V into their slots before the call, so that each
// new token sees itself and the new tokens before it.
//
// The kernel is built for short chunks: it keeps every query row of a KV head's group resident
// and streams that head's K and V once, so its cost is one pass over the attended cache at the
// machine's read bandwidth. Any T is accepted, but past ~16 new tokens the arithmetic per cached
// byte outgrows the bandwidth and the prefill kernel (attention_cte with the cache as the prior)
// is the better tool.
//
// Errors come back as a Status whose message names the argument and the rule it broke; nothing
// here throws.
#ifndef FLASHCTE_DECODE_H_
#define FLASHCTE_DECODE_H_

#include <array>
#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte {

// Everything besides the tensors, with the prefill kernel's conventions (Options).
struct DecodeOptions {
  // S = scale * q.k. 1.0 by default, as attention_cte's Options::scale: callers that want the
  // usual 1/sqrt(d) pass it (the module's qk_scale).
  float scale = 1.0f;
  float softcap = 0.0f;  // > 0: S -> softcap * tanh(S / softcap), before the masks
  // > 0: query token t of sequence b sees only slots j > positions[b, t] - sliding_window (its
  // own slot and the sliding_window - 1 before it); 0: no window.
  int64_t sliding_window = 0;
  // (q_heads,) or (q_heads, 1) float32: one value-less logit per query head, not scaled, joining
  // every row's softmax (as attention_cte's sink, whose batch axis is batch*heads); finite or
  // -inf (no sink).
  TensorView sink;
  // A paged cache (vLLM's PagedAttention, FlashAttention's block_table): (batch,
  // max_blocks_per_seq) int32. k_cache / v_cache are then pools of pages, (num_blocks, kv_heads,
  // block_size, d) with any block_size >= 1 (FlashAttention's (num_blocks, block_size, kv_heads,
  // d) is the same view with its strides permuted), and slot j of sequence b is row
  // j % block_size of page block_table[b, j / block_size]; a sequence has max_blocks_per_seq *
  // block_size slots. Pages may be shared between sequences (a common prefix). Only the entries
  // of the pages a call reads are looked at, and each must be in [0, num_blocks); the rest may
  // hold anything. The result is bitwise the one over the same rows in a dense cache.
  TensorView block_table;
  // 8-bit caches (int8, float8_e4m3fn, float8_e5m2; quantize_kv writes them): the float32
  // dequantization scales, (1,) for the whole cache or (kv_heads,) one per KV head, each finite
  // and > 0, or one per token: the cache's shape without its last axis ((batch, kv_heads,
  // max_len), or (num_blocks, kv_heads, block_size) beside a paged cache, in its pages). A cache
  // element c stands for c times its scale. Per-token scales are data like the cache, not
  // checked: a NaN or infinity reaches the rows that attend its slot. Required with an 8-bit
  // cache, refused with a float one. K and V may use different formats and granularities.
  TensorView k_scale;
  TensorView v_scale;
  int num_threads = 0;  // 0: OpenMP's default. Results are bitwise identical for any count.
};

struct DecodeOutputs {
  MutableTensorView out;  // (batch, q_heads, T, dv), the dtype of q
  MutableTensorView lse;  // optional (batch, q_heads, T) float32: max + log(sum), sink included
};

// Attention of the new tokens q against the cache:
//   q         (batch, q_heads, T, d)
//   k_cache   (batch, kv_heads, max_len, d), or pages (num_blocks, kv_heads, block_size, d) with
//             DecodeOptions::block_table
//   v_cache   (batch, kv_heads, max_len, dv), or pages as k_cache
//   positions (batch, T) int64: query token t of sequence b is at positions[b, t], in
//             [0, max_len), and attends every slot j <= positions[b, t] (and, with a window,
//             j > positions[b, t] - sliding_window). Positions need not be consecutive or
//             distinct; the sequences of a batch may sit at different positions.
// q and out share one dtype: float32, bfloat16 or float16; each cache has it too, or is 8-bit
// (read in place, its codes converted in registers and its scale folded into the score scale and
// the output; the probabilities are then not rounded to bfloat16). GQA: q_heads is a multiple
// of kv_heads and query head h reads KV head h / (q_heads / kv_heads); MQA (kv_heads 1) and MHA
// (kv_heads = q_heads) are its ends. Scores and the softmax run in float32; with bfloat16 inputs
// the probabilities are rounded to bfloat16 before P.V, as in attention_cte. bfloat16 and float16
// caches are read in place (converted in registers), and only the slots some row attends are read.
// Where bfloat16 runs on the native dot product (AVX512_BF16 on AMD Zen 4/5, the choice
// attention_cte makes, FLASHCTE_BF16_DOT=widen turns it off), subnormal bfloat16 inputs count as
// zero: a difference below 2^-126 per product.
// Thread-safe; outputs are bitwise identical for any num_threads.
Status decode_attention(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                        const TensorView& positions, const DecodeOutputs& outputs,
                        const DecodeOptions& options = {});

}  // namespace flashcte

#endif  // FLASHCTE_DECODE_H_
