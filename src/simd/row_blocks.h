// The row-block loop of the register-tiled matmuls. A register tile's height must be a
// compile-time constant (its accumulators are indexed by constants only), so rows [0, rows) are
// covered by full blocks of kR and then one block of the remaining 1..kR-1 rows, each block's
// height passed to the body as a type. Target-independent: the Highway kernels (mm1-inl.h,
// mm2-inl.h, decode_pv-inl.h) and the native bfloat16 ones (native_ops.cc) share it. Always
// inlined, so the loop takes the target of the kernel it is written in.
#ifndef FLASHCTE_SRC_SIMD_ROW_BLOCKS_H_
#define FLASHCTE_SRC_SIMD_ROW_BLOCKS_H_

#include <cstdint>
#include <type_traits>

#include "hwy/base.h"

namespace flashcte::simd {

// body(std::integral_constant<int64_t, left>(), r) when 1 <= left <= R; nothing when left is 0.
template <int64_t R, class Body>
HWY_INLINE void RemainderBlock(int64_t left, int64_t r, const Body& body) {
  if constexpr (R > 0) {
    if (left == R) {
      body(std::integral_constant<int64_t, R>(), r);
    } else {
      RemainderBlock<R - 1>(left, r, body);
    }
  }
}

// body(std::integral_constant<int64_t, R>(), r) for consecutive row blocks covering [0, rows).
template <int64_t kR, class Body>
HWY_INLINE void ForEachRowBlock(int64_t rows, const Body& body) {
  int64_t r = 0;
  for (; r + kR <= rows; r += kR) body(std::integral_constant<int64_t, kR>(), r);
  RemainderBlock<kR - 1>(rows - r, r, body);
}

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_ROW_BLOCKS_H_
