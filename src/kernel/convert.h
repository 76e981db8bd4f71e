// Element loads and row stores between the storage dtypes and float32 (the scalar conversions
// are src/core/half.h).
#ifndef FLASHCTE_SRC_KERNEL_CONVERT_H_
#define FLASHCTE_SRC_KERNEL_CONVERT_H_

#include <cstdint>
#include <cstring>

#include "flashcte/flashcte.h"
#include "src/core/half.h"

namespace flashcte::internal {

using half::bf16_to_float;
using half::f16_to_float;
using half::float_to_bf16;
using half::float_to_f16;

inline float load_as_float(const void* base, int64_t offset, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[offset]);
    case DType::kFloat16:
      return f16_to_float(static_cast<const uint16_t*>(base)[offset]);
    default:
      return static_cast<const float*>(base)[offset];
  }
}

// base[offset + c * stride] = src[c] for c < n in dtype: one dtype switch per row, so the
// float32 loop vectorizes (a switch per element cost ~10 instructions per output value).
inline void store_row_from_float(void* base, int64_t offset, int64_t stride, DType dtype,
                                 const float* src, int64_t n) {
  switch (dtype) {
    case DType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c * stride] = float_to_bf16(src[c]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c * stride] = float_to_f16(src[c]);
      return;
    }
    default: {
      float* dst = static_cast<float*>(base) + offset;
      if (stride == 1) {
        std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
        return;
      }
      for (int64_t c = 0; c < n; ++c) dst[c * stride] = src[c];
    }
  }
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_CONVERT_H_
