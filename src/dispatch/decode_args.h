// The arguments every entry point of the decode kernel shares, each kind read by one reader into
// the DecodeProblem: q and the caches, their 8-bit scales, the pages (block table or cache rows),
// the sinks, the scalar options and the outputs. decode_attention (decode_validate.cc) and the
// KV-cache calls (kvcache_validate.cc) differ in their axis order and names, which a DecodeLayout
// gives, and add what is theirs: positions; the lengths, the append and FlashAttention's masks.
// Messages are "<argument>: <rule it broke>".
#ifndef FLASHCTE_SRC_DISPATCH_DECODE_ARGS_H_
#define FLASHCTE_SRC_DISPATCH_DECODE_ARGS_H_

#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/dispatch/views.h"
#include "src/kernel/decode.h"

namespace flashcte::internal {

// How an entry point lays out its rank-4 arguments, and the names its messages use. q and out
// are (batch, heads, tokens, d) or (batch, tokens, heads, d); the caches are (batch or page,
// kv_heads, slot, d) or (batch or page, slot, kv_heads, d), their heads on q's heads axis.
struct DecodeLayout {
  int heads_axis;  // 1 or 2; the tokens' (the slots') is the other
  const char *q, *out, *lse;
  const char *k_dense, *v_dense, *k_paged, *v_paged;
  const char* heads;  // q's heads axis, in messages
  // The sizes other arguments must match, as messages name them (whole strings: the readers
  // build no string unless a rule is broken).
  const char *q_heads, *q_tokens;
  // A dense cache's rows: q's batch (cache_rows_are_batch), or its own count, named k_rows.
  bool cache_rows_are_batch;
  const char *k_rows, *k_slots_dense, *k_slots_paged;
  const char* page_slots;  // a page's slot axis
  const char* sink;        // the sinks' shapes; (heads,) and, with sink_column, (heads, 1)
  bool sink_column;

  int tokens_axis() const { return 3 - heads_axis; }
};

// decode_attention (include/flashcte/decode.h).
inline constexpr DecodeLayout kDecodeAttentionLayout = {
    1,                                         // heads_axis
    "(batch, q_heads, T, d)",                  // q
    "(batch, q_heads, T, dv)",                 // out
    "(batch, q_heads, T)",                     // lse
    "(batch, kv_heads, max_len, d)",           // k_dense
    "(batch, kv_heads, max_len, dv)",          // v_dense
    "(num_blocks, kv_heads, block_size, d)",   // k_paged
    "(num_blocks, kv_heads, block_size, dv)",  // v_paged
    "q_heads",                                 // heads
    "q's q_heads",                             // q_heads
    "q's T",                                   // q_tokens
    true,                                      // cache_rows_are_batch
    "q's batch",                               // k_rows
    "k_cache's max_len",                       // k_slots_dense
    "k_cache's block_size",                    // k_slots_paged
    "block_size",                              // page_slots
    "(q_heads,) or (q_heads, 1)",              // sink
    true,                                      // sink_column
};

// flash_attn_with_kvcache and the calls built on it (include/flashcte/kvcache.h).
inline constexpr DecodeLayout kFlashAttentionLayout = {
    2,                                              // heads_axis
    "(batch, seqlen_q, heads, d)",                  // q
    "(batch, seqlen_q, heads, dv)",                 // out
    "(batch, heads, seqlen_q)",                     // lse
    "(batch_cache, seqlen_cache, kv_heads, d)",     // k_dense
    "(batch_cache, seqlen_cache, kv_heads, dv)",    // v_dense
    "(num_blocks, page_block_size, kv_heads, d)",   // k_paged
    "(num_blocks, page_block_size, kv_heads, dv)",  // v_paged
    "heads",                                        // heads
    "q's heads",                                    // q_heads
    "q's seqlen_q",                                 // q_tokens
    false,                                          // cache_rows_are_batch
    "k_cache's batch_cache",                        // k_rows
    "k_cache's seqlen_cache",                       // k_slots_dense
    "k_cache's page_block_size",                    // k_slots_paged
    "page_block_size",                              // page_slots
    "(heads,)",                                     // sink
    false,                                          // sink_column
};

// The bytes of the shared arguments, for each entry point's aliasing rules.
struct DecodeExtents {
  Extent q, k_cache, v_cache, k_scale, v_scale, sink, out, lse;
};

// q and the caches (present, ranks, dtypes, sizes, GQA): the problem's sizes, q and the K/V
// sources in the kernel's (batch, head, token or slot, channel) order. A dense cache's slot
// count is max_len; a paged one's is set by read_pages.
Status read_q_and_caches(const DecodeLayout& layout, const TensorView& q, const TensorView& k_cache,
                         const TensorView& v_cache, bool paged, DecodeProblem* p, DecodeExtents* e);

// k_scale / v_scale (views.h's check_cache_scale, on the caches' heads axis): the per-head values
// into the problem; `*_per_token` says a scale is one per token, a source attach_token_scales
// places once the pages are read.
Status read_cache_scales(const DecodeLayout& layout, const TensorView& k_scale,
                         const TensorView& v_scale, const TensorView& k_cache,
                         const TensorView& v_cache, DecodeProblem* p, bool* k_per_token,
                         bool* v_per_token, DecodeExtents* e);

// The pages of every slot the call reads or writes: `read[b]` and `written[b]` are sequence b's
// spans of slots (empty: none). `name` is the table, block_table (paged: (batch,
// pages_per_sequence), its shape checked by views.h's check_block_table) or cache_batch_idx (one
// cache row per sequence, pages_per_sequence 1). Each used entry must be in [0, cache_rows) and
// is copied into the K/V sources (the rest stay -1, never read); a page the call writes must not
// be used by another entry.
Status read_pages(const char* name, const TensorView& table, bool paged, int64_t cache_rows,
                  int64_t page_slots, int64_t pages_per_sequence,
                  const std::vector<SlotRange>& read, const std::vector<SlotRange>& written,
                  DecodeProblem* p);

// Per-token scales as float32 sources beside their caches (after read_pages: same pages).
void attach_token_scales(const DecodeLayout& layout, bool k_per_token, const TensorView& k_scale,
                         bool v_per_token, const TensorView& v_scale, DecodeProblem* p);

// The sinks, one float32 logit per query head: each finite or -inf.
Status read_sinks(const DecodeLayout& layout, const char* name, const TensorView& sinks,
                  DecodeProblem* p, DecodeExtents* e);

// The score scale (named `scale_name`: finite), softcap (finite, >= 0) and num_threads (>= 0).
Status read_scalars(const char* scale_name, float scale, float softcap, int num_threads,
                    DecodeProblem* p);

// out (q's dtype; q's shape with dv channels) and the optional lse (batch, heads, tokens)
// float32, each with distinct elements in distinct memory.
Status read_outputs(const DecodeLayout& layout, const MutableTensorView& out,
                    const MutableTensorView& lse, DecodeProblem* p, DecodeExtents* e);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_DECODE_ARGS_H_
