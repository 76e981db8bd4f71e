// What flash_attn_with_kvcache's validator (kvcache_validate.cc) and flash_attn_varlen_kvcache's
// (varlen_validate.cc) read alike into their request, over decode_args.h's readers of the
// arguments every decode entry point shares.
#ifndef FLASHCTE_SRC_DISPATCH_KVCACHE_ARGS_H_
#define FLASHCTE_SRC_DISPATCH_KVCACHE_ARGS_H_

#include <cstdint>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/dispatch/decode_args.h"
#include "src/dispatch/kvcache.h"

namespace flashcte::internal {

// The options both calls take under one name (KvCacheOptions, VarlenKvCacheOptions): the window
// (each entry >= -1) into the request, the score scale, softcap, threads, ALiBi ((heads,) or
// (batch, heads) float32, finite) and sinks into its problem, after the problem's sizes.
template <class Options>
Status read_call_options(const Options& options, Extent* alibi, DecodeExtents* e,
                         KvCacheRequest* request);

// Each query row's slots into the request (FlashAttention's bottom-right alignment about
// seqlen_k = seqlens[b] + the appended tokens, the window, leftpad[b] as the first slot), and the
// pages of every slot a row sees or the append writes (read_pages), from the table named
// `table_name` (null: sequence b's is cache row b, no table).
Status place_rows(const char* table_name, const TensorView& table, int64_t cache_rows,
                  int64_t row_slots, int64_t pages_per_sequence,
                  const std::vector<int64_t>& seqlens, const std::vector<int64_t>& leftpad,
                  KvCacheRequest* request);

// The caches' scales are memory of their own (neither overlaps a cache) and, when the append
// writes both, of each their own.
Status check_scales_apart(const DecodeExtents& e, bool both_written);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_KVCACHE_ARGS_H_
