// Scalar conversions between the storage dtypes and float32. Packing converts each element once
// per tile (O(tile * d)) against O(rows * tile * d) arithmetic, so scalar code is not the cost.
#ifndef FLASHCTE_SRC_KERNEL_CONVERT_H_
#define FLASHCTE_SRC_KERNEL_CONVERT_H_

#include <cstdint>
#include <cstring>

#include "flashcte/flashcte.h"

namespace flashcte::internal {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));  // inf / nan
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24, exact in float32.
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}

// Round to nearest even, overflow to inf, NaN stays NaN.
inline uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (a < 0x38800000u) {                        // below 2^-14: subnormal or zero
    // Scale to units of 2^-24 and round to nearest even via float arithmetic.
    const float scaled = bits_to_float(a) * 16777216.0f;  // exact
    float r = static_cast<float>(static_cast<int32_t>(scaled));
    const float frac = scaled - r;
    if (frac > 0.5f || (frac == 0.5f && (static_cast<int32_t>(r) & 1))) r += 1.0f;
    return sign | static_cast<uint16_t>(r);
  }
  // Normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits.
  const uint32_t rebased = a - (112u << 23);
  const uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>(rounded >> 13);
}

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
