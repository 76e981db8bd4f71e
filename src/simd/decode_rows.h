// Where the decode kernels (ops.h decode_qk / decode_pv) find their K or V rows: a table of row
// addresses, so that a dense cache and a paged one (src/core/kv_source.h) go through the same
// instructions and give the same bits. The kernel layer fills the table for a chunk of slots;
// one address per row costs a load per row of d elements (256 bytes of bfloat16 at d = 128).
#ifndef FLASHCTE_SRC_SIMD_DECODE_ROWS_H_
#define FLASHCTE_SRC_SIMD_DECODE_ROWS_H_

#include <cstdint>

namespace flashcte::simd {

struct DecodeRows {
  // row[j]: the first element of row j, for j < avail (unit stride along the channels).
  const void* const* row = nullptr;
  // Rows [0, n) are read; [n, avail) are the rows the stream reads next (the rest of the chunk),
  // only ever prefetched.
  int64_t avail = 0;

  template <class T>
  const T* at(int64_t j) const {
    return static_cast<const T*>(row[j]);
  }
  // The address to prefetch for row j, or 0 past the table (a prefetch never faults, but a
  // guessed address past a page of a paged cache would only waste bandwidth).
  uintptr_t prefetch_address(int64_t j) const {
    return j < avail ? reinterpret_cast<uintptr_t>(row[j]) : 0;
  }
};

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_DECODE_ROWS_H_
