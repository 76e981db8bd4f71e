// Where the decode kernels (ops.h decode_qk / decode_pv) find their K or V rows: rows `stride`
// bytes apart from `base` (a dense cache), or a table of row addresses (a paged cache,
// src/core/kv_source.h). The kernels are instantiated once for each form (StridedRows,
// TableRows) from the same code, so a dense cache pays no table load and a paged one gives the
// dense result bit for bit.
#ifndef FLASHCTE_SRC_SIMD_DECODE_ROWS_H_
#define FLASHCTE_SRC_SIMD_DECODE_ROWS_H_

#include <cstdint>

#include "hwy/base.h"

namespace flashcte::simd {

// How far ahead of their reads (bytes of each K or V stream) the decode kernels, portable and
// native, prefetch into L2 (prefetcht1, one request per line). Without it a core's K/V misses go
// through its L1 miss buffers and a decode call reads ~15 GB/s on 2 threads (Zen 4 EPYC, 32/8
// heads, d = 128, bf16 native, medians of 5 interleaved cold runs; read bandwidth ~33 GB/s):
//   distance      0      2 KiB   4 KiB   8 KiB
//   4096 slots    15.3   19.4    21.8    23.3 GB/s
//   32768 slots   16.2   20.8    26.0    25.9 GB/s
inline constexpr int64_t kDecodePrefetchBytes = 8192;
// The distance where a slot's KV heads lie side by side and one item reads them block by block in
// turn (src/kernel/decode.cc): a head's next block is then every other head's block away. Zen 4
// EPYC, 2 threads, batch 1, 32/8 heads, d = 128, 32768 cached bf16, flash_attn_with_kvcache on
// numpy's (batch, seqlen, heads, d), six interleaved rounds of 15 calls: 8 KiB 6.6-9.8 ms, 16 KiB
// 6.1-6.6 (per-round ratio, median 1.20; 24 KiB no better in four rounds). Head by head ((batch,
// heads, seqlen, d)) 16 KiB was slower: 1.075x the 8 KiB time (median of 8 interleaved rounds).
inline constexpr int64_t kDecodeHeadsTogetherPrefetchBytes = 16384;

// Rows ahead that are also requested into L1 (prefetcht0), besides the L2 requests
// the rows' prefetch_bytes ahead, by the portable and the native decode kernels. A paged cache's
// rows come in runs of a page (4 KiB per head at 16 slots of bfloat16, d = 128), and at every run
// the L1 prefetcher starts over; this keeps the next rows' lines arriving. Zen 5 EPYC, 2 threads,
// 32/8 heads, 32768 cached tokens, cold, 3 rounds of 7 reps, bf16 native: pages of 16 went
// from 7.4-7.9 to 4.7-5.8 ms per call and the dense cache from 4.5-4.8 to 3.8-5.3 ms (8 rows; only
// the table form: pages 5.1-5.9, dense unchanged).
inline constexpr int64_t kL1PrefetchRows = 8;

// Requests the `bytes` at p into L2 (kLocality 2: prefetcht1) or L1 (3: prefetcht0), one request
// per cache line; nothing for p = 0 (no row there: prefetch_address below). Both the portable
// and the native decode kernels prefetch through it.
template <int kLocality>
HWY_INLINE void prefetch_lines(uintptr_t p, int64_t bytes) {
#if HWY_COMPILER_GCC || HWY_COMPILER_CLANG
  if (p == 0) return;
  for (uintptr_t a = p & ~uintptr_t{63}; a < p + static_cast<uintptr_t>(bytes); a += 64) {
    // An address that may lie past the buffer: integer arithmetic keeps it clear of
    // out-of-bounds pointer arithmetic, and a prefetch never faults.
    // NOLINTNEXTLINE(performance-no-int-to-ptr)
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, kLocality);
  }
#else
  (void)p;
  (void)bytes;
#endif
}

// Rows of `row_bytes` each that make `prefetch_bytes` of a stream (at least 1).
inline int64_t prefetch_rows(int64_t prefetch_bytes, int64_t row_bytes) {
  row_bytes = row_bytes > 0 ? row_bytes : 1;
  return (prefetch_bytes + row_bytes - 1) / row_bytes;
}

struct DecodeRows {
  const void* const* table = nullptr;  // row j at table[j]; null: row j at base + j * stride
  const void* base = nullptr;
  int64_t stride = 0;  // bytes
  // Rows [0, n) are read; [n, avail) are the rows the stream reads next (the rest of the chunk),
  // only ever prefetched.
  int64_t avail = 0;
  int64_t prefetch_bytes = kDecodePrefetchBytes;  // how far ahead the kernels prefetch

  static DecodeRows strided(const void* base, int64_t stride, int64_t avail,
                            int64_t prefetch_bytes = kDecodePrefetchBytes) {
    return {nullptr, base, stride, avail, prefetch_bytes};
  }
  static DecodeRows of_table(const void* const* table, int64_t avail,
                             int64_t prefetch_bytes = kDecodePrefetchBytes) {
    return {table, nullptr, 0, avail, prefetch_bytes};
  }
  // Row j's first element, in either form (for code outside the kernels' loops).
  const void* address(int64_t j) const {
    return table ? table[j] : static_cast<const unsigned char*>(base) + j * stride;
  }
};

// The two forms as the kernels' template arguments: at<T>(j) is row j, prefetch_address(j) the
// address to prefetch for row j (0: none), prefetch_bytes as DecodeRows'.
struct StridedRows {
  const unsigned char* base;
  int64_t stride, avail, prefetch_bytes;
  template <class T>
  const T* at(int64_t j) const {
    return reinterpret_cast<const T*>(base + j * stride);
  }
  // Past `avail` too: the rows that follow in the stream (the next chunk), as a dense cache lays
  // them out; an address past the buffer is only ever prefetched, which never faults.
  uintptr_t prefetch_address(int64_t j) const {
    return reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(j * stride);
  }
};

struct TableRows {
  const void* const* table;
  int64_t avail, prefetch_bytes;
  // Only the table's rows: an address guessed past a page would only waste bandwidth.
  template <class T>
  const T* at(int64_t j) const {
    return static_cast<const T*>(table[j]);
  }
  uintptr_t prefetch_address(int64_t j) const {
    return j < avail ? reinterpret_cast<uintptr_t>(table[j]) : 0;
  }
};

// Calls f(rows) with `rows` as the form it holds.
template <class F>
inline void with_rows(const DecodeRows& rows, const F& f) {
  if (rows.table) {
    f(TableRows{rows.table, rows.avail, rows.prefetch_bytes});
  } else {
    f(StridedRows{static_cast<const unsigned char*>(rows.base), rows.stride, rows.avail,
                  rows.prefetch_bytes});
  }
}

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_DECODE_ROWS_H_
