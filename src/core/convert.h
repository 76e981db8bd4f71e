// Element and row conversions between the storage dtypes (float32, bfloat16, float16) and
// float32, for every layer that reads or writes tensors element by element: the kernels'
// packing fallbacks and write-back, the merge, the attention layer. The scalar conversions are
// half.h; the vectorized ones of the hot paths are src/simd (to_float, narrow_bf16).
#ifndef FLASHCTE_SRC_CORE_CONVERT_H_
#define FLASHCTE_SRC_CORE_CONVERT_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "flashcte/flashcte.h"
#include "src/core/half.h"
#include "src/core/kv8.h"

namespace flashcte::internal {

// A dtype that validation keeps from `where` (int32 / int64 indices and the 8-bit cache formats
// are no attention compute dtype): reaching it is a bug, so stop rather than read garbage.
[[noreturn]] inline void unreachable_dtype(const char* where, DType dtype) {
  std::fprintf(stderr, "flashcte internal error: %s called with dtype %s\n", where,
               dtype_name(dtype));
  std::abort();
}

inline float load_as_float(const void* base, int64_t offset, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return half::bf16_to_float(static_cast<const uint16_t*>(base)[offset]);
    case DType::kFloat16:
      return half::f16_to_float(static_cast<const uint16_t*>(base)[offset]);
    case DType::kFloat32:
      return static_cast<const float*>(base)[offset];
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;
  }
  unreachable_dtype("load_as_float", dtype);
}

// x rounded to the nearest value of `dtype` (float32: unchanged), ties to even.
inline float round_to(DType dtype, float x) {
  switch (dtype) {
    case DType::kBFloat16:
      return half::bf16_to_float(half::float_to_bf16(x));
    case DType::kFloat16:
      return half::f16_to_float(half::float_to_f16(x));
    case DType::kFloat32:
      return x;
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;
  }
  unreachable_dtype("round_to", dtype);
}

// dst[c] = base[offset + c * stride] for c < n, as float32: one dtype switch per row. An 8-bit
// cache format gives its codes' values, unscaled.
inline void load_row_as_float(const void* base, int64_t offset, int64_t stride, DType dtype,
                              float* dst, int64_t n) {
  switch (dtype) {
    case DType::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c] = half::bf16_to_float(src[c * stride]);
      return;
    }
    case DType::kFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c] = half::f16_to_float(src[c * stride]);
      return;
    }
    case DType::kFloat32: {
      const float* src = static_cast<const float*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c] = src[c * stride];
      return;
    }
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: {  // an 8-bit cache's codes, unscaled
      const uint8_t* src = static_cast<const uint8_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c] = kv8::decode(dtype, src[c * stride]);
      return;
    }
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  unreachable_dtype("load_row_as_float", dtype);
}

// base[offset + c * stride] = src[c] for c < n in dtype: one dtype switch per row, so the
// float32 loop vectorizes (a switch per element cost ~10 instructions per output value).
inline void store_row_from_float(void* base, int64_t offset, int64_t stride, DType dtype,
                                 const float* src, int64_t n) {
  switch (dtype) {
    case DType::kBFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c * stride] = half::float_to_bf16(src[c]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* dst = static_cast<uint16_t*>(base) + offset;
      for (int64_t c = 0; c < n; ++c) dst[c * stride] = half::float_to_f16(src[c]);
      return;
    }
    case DType::kFloat32: {
      float* dst = static_cast<float*>(base) + offset;
      if (stride == 1) {
        std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
        return;
      }
      for (int64_t c = 0; c < n; ++c) dst[c * stride] = src[c];
      return;
    }
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;
  }
  unreachable_dtype("store_row_from_float", dtype);
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_CORE_CONVERT_H_
