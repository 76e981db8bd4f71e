// Where a sequence's K or V rows live (ARCHITECTURE.md, "Where K and V live"): one type for a
// dense strided cache and a paged one, so that the kernels that read a cache ask it for row
// addresses and never see which it is. Everything above them sees only lengths and positions.
//
// Axes are (sequence, head, slot, channel). Dense: element (b, h, j, x) is at
//   b * strides[0] + h * strides[1] + j * strides[2] + x * strides[3]  (elements).
// Paged: slot j of sequence b is row j % block_size of page table[b][j / block_size], and the
// page's axes are (page, head, row, channel) with the same four strides:
//   page * strides[0] + h * strides[1] + (j % block_size) * strides[2] + x * strides[3].
// vLLM's (num_blocks, kv_heads, block_size, d) and FlashAttention's (num_blocks, block_size,
// kv_heads, d) are both such views, the second with its strides permuted.
#ifndef FLASHCTE_SRC_CORE_KV_SOURCE_H_
#define FLASHCTE_SRC_CORE_KV_SOURCE_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte::internal {

struct KvSource {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  std::array<int64_t, 4> strides{};  // (sequence or page, head, slot or row, channel)
  // Paged when block_size > 0: the validated page of every slot a call reads,
  // table[b * pages_per_sequence + j / block_size].
  int64_t block_size = 0;
  int64_t pages_per_sequence = 0;
  std::vector<int32_t> table;

  bool paged() const { return block_size > 0; }
  int64_t element_bytes() const { return dtype_size(dtype); }

  // The element offset of (b, head, slot j, channel 0).
  int64_t offset(int64_t b, int64_t head, int64_t j) const {
    if (!paged()) return b * strides[0] + head * strides[1] + j * strides[2];
    const int64_t page = table[static_cast<size_t>(b * pages_per_sequence + j / block_size)];
    return page * strides[0] + head * strides[1] + (j % block_size) * strides[2];
  }
  const unsigned char* row(int64_t b, int64_t head, int64_t j) const {
    return static_cast<const unsigned char*>(data) + offset(b, head, j) * element_bytes();
  }

  // The end of the run of slots from j (< hi) that lie strides[2] apart: the end of j's page.
  int64_t run_end(int64_t j, int64_t hi) const {
    return paged() ? std::min(hi, (j / block_size + 1) * block_size) : hi;
  }

  // rows[j - lo] = row(b, head, j) for j in [lo, hi): one page lookup per page, not per slot.
  void fill_rows(int64_t b, int64_t head, int64_t lo, int64_t hi, const void** rows) const {
    const int64_t step = strides[2] * element_bytes();
    for (int64_t j = lo; j < hi;) {
      const int64_t end = run_end(j, hi);
      const unsigned char* first = row(b, head, j);
      for (const int64_t j0 = j; j < end; ++j) rows[j - lo] = first + (j - j0) * step;
    }
  }
};

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_CORE_KV_SOURCE_H_
