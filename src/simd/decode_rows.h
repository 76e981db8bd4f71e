// Where the decode kernels (ops.h decode_qk / decode_pv) find their K or V rows: rows `stride`
// bytes apart from `base` (a dense cache), or a table of row addresses (a paged cache,
// src/core/kv_source.h). The kernels are instantiated once for each form (StridedRows,
// TableRows) from the same code, so a dense cache pays no table load and a paged one gives the
// dense result bit for bit.
#ifndef FLASHCTE_SRC_SIMD_DECODE_ROWS_H_
#define FLASHCTE_SRC_SIMD_DECODE_ROWS_H_

#include <cstdint>

namespace flashcte::simd {

struct DecodeRows {
  const void* const* table = nullptr;  // row j at table[j]; null: row j at base + j * stride
  const void* base = nullptr;
  int64_t stride = 0;  // bytes
  // Rows [0, n) are read; [n, avail) are the rows the stream reads next (the rest of the chunk),
  // only ever prefetched.
  int64_t avail = 0;

  static DecodeRows strided(const void* base, int64_t stride, int64_t avail) {
    return {nullptr, base, stride, avail};
  }
  static DecodeRows of_table(const void* const* table, int64_t avail) {
    return {table, nullptr, 0, avail};
  }
  // Row j's first element, in either form (for code outside the kernels' loops).
  const void* address(int64_t j) const {
    return table ? table[j] : static_cast<const unsigned char*>(base) + j * stride;
  }
};

// The two forms as the kernels' template arguments: at<T>(j) is row j, prefetch_address(j) the
// address to prefetch for row j (0: none).
struct StridedRows {
  const unsigned char* base;
  int64_t stride, avail;
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
  int64_t avail;
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
    f(TableRows{rows.table, rows.avail});
  } else {
    f(StridedRows{static_cast<const unsigned char*>(rows.base), rows.stride, rows.avail});
  }
}

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_DECODE_ROWS_H_
