// Scalar conversions of the 8-bit KV cache formats (ARCHITECTURE.md, "Where K and V live"): the
// OCP fp8 formats e4m3fn and e5m2 (torch's float8_e4m3fn and float8_e5m2, ml_dtypes' of the same
// names) and int8, symmetric. A cache element c with scale s stands for c * s (fp32 s).
//
// Decoding is exact (every 8-bit value is a float32). Encoding rounds to nearest, ties to even,
// and saturates: a finite value beyond the format's largest becomes the largest of its sign
// (e4m3fn 448, e5m2 57344, int8 127). e4m3fn has no infinity, so +-inf saturates too; e5m2 keeps
// it. NaN stays NaN in fp8. int8 has no NaN: callers refuse NaN before they encode (quantize_kv).
#ifndef FLASHCTE_SRC_CORE_KV8_H_
#define FLASHCTE_SRC_CORE_KV8_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "flashcte/flashcte.h"

namespace flashcte::kv8 {

// An fp8 format: exponent and mantissa bits, bias, its largest finite code (sign clear), and
// whether the all-ones exponent is infinity / NaN (IEEE-like, e5m2) or a normal binade whose
// only NaN is mantissa all ones (the "fn" formats).
struct Fp8Format {
  int exponent_bits, mantissa_bits, bias;
  uint8_t max_code;
  bool ieee_specials;
};
inline constexpr Fp8Format kE4M3 = {4, 3, 7, 0x7E, false};  // max 448
inline constexpr Fp8Format kE5M2 = {5, 2, 15, 0x7B, true};  // max 57344

inline float fp8_to_float(uint8_t code, const Fp8Format& f) {
  const bool negative = (code & 0x80u) != 0;
  const int e = (code >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int m = code & ((1 << f.mantissa_bits) - 1);
  const int all_ones = (1 << f.exponent_bits) - 1;
  float mag;
  if (f.ieee_specials && e == all_ones) {
    mag = m == 0 ? INFINITY : NAN;
  } else if (!f.ieee_specials && e == all_ones && m == (1 << f.mantissa_bits) - 1) {
    mag = NAN;
  } else if (e == 0) {  // subnormal: m * 2^(1 - bias - mantissa_bits)
    mag = std::ldexp(static_cast<float>(m), 1 - f.bias - f.mantissa_bits);
  } else {
    mag = std::ldexp(static_cast<float>(m + (1 << f.mantissa_bits)), e - f.bias - f.mantissa_bits);
  }
  return negative ? -mag : mag;
}

// x rounded to the format (nearest, ties to even), saturating; see the file comment. Taken as a
// double so that a quotient value / scale rounds once (quantize_kv divides in double).
inline uint8_t float_to_fp8(double x, const Fp8Format& f) {
  const uint8_t sign = std::signbit(x) ? 0x80u : 0x00u;
  if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN in both formats
  const double a = std::fabs(x);
  if (std::isinf(a)) {
    return static_cast<uint8_t>(sign | (f.ieee_specials ? f.max_code + 1 : f.max_code));
  }
  if (a == 0) return sign;
  const int mantissa = f.mantissa_bits, min_exponent = 1 - f.bias;
  int e = 0;
  std::frexp(a, &e);  // a = fraction * 2^e, fraction in [0.5, 1): the leading bit is 2^(e - 1)
  e -= 1;
  // The quantum at a's binade (the subnormal one below the smallest normal), and a in quanta
  // rounded to nearest even (nearbyint under the default rounding mode; the division by a power
  // of two is exact in double).
  const int quantum_exponent = std::max(e, min_exponent) - mantissa;
  const double q = std::nearbyint(std::ldexp(a, -quantum_exponent));
  // Codes are monotone in the value: (exponent field << mantissa) + mantissa field, where a
  // subnormal's exponent field is 0 and q already counts the hidden bit (q in [2^M, 2^(M+1)]),
  // so a carry out of the mantissa lands on the next binade's first code.
  int64_t code = 0;
  if (e < min_exponent) {
    code = static_cast<int64_t>(q);  // 2^M here is the smallest normal
  } else {
    code = (static_cast<int64_t>(quantum_exponent + mantissa + f.bias) << mantissa) +
           static_cast<int64_t>(q) - (int64_t{1} << mantissa);
  }
  if (code > f.max_code) code = f.max_code;
  return static_cast<uint8_t>(sign | static_cast<uint8_t>(code));
}

inline float e4m3_to_float(uint8_t code) { return fp8_to_float(code, kE4M3); }
inline float e5m2_to_float(uint8_t code) { return fp8_to_float(code, kE5M2); }
inline uint8_t float_to_e4m3(double x) { return float_to_fp8(x, kE4M3); }
inline uint8_t float_to_e5m2(double x) { return float_to_fp8(x, kE5M2); }

// x rounded to an int8 (nearest, ties to even), saturating at +-127 (-128 is never produced, so
// the format is symmetric). x must not be NaN.
inline int8_t float_to_int8(double x) {
  const double r = std::nearbyint(x);
  if (!(r < 127.0)) return 127;
  if (!(r > -127.0)) return -127;
  return static_cast<int8_t>(r);
}

// The largest finite magnitude of an 8-bit format: a per-token scale is absmax / this.
inline constexpr float kInt8Max = 127.0f, kE4M3Max = 448.0f, kE5M2Max = 57344.0f;

// `dtype` is an 8-bit KV cache format: int8, float8_e4m3fn or float8_e5m2.
inline bool is_8bit(DType dtype) {
  return dtype == DType::kInt8 || dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2;
}

// The three formats by DType (int8 as the byte of its two's complement code). Any other dtype is
// a caller's bug: validation keeps them away.
[[noreturn]] inline void not_8bit(DType dtype) {
  std::fprintf(stderr, "flashcte internal error: %s is not an 8-bit cache format\n",
               dtype_name(dtype));
  std::abort();
}

inline uint8_t encode(DType dtype, double x) {
  switch (dtype) {
    case DType::kInt8:
      return static_cast<uint8_t>(float_to_int8(x));
    case DType::kFloat8E4M3:
      return float_to_e4m3(x);
    case DType::kFloat8E5M2:
      return float_to_e5m2(x);
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  not_8bit(dtype);
}

inline float decode(DType dtype, uint8_t code) {
  switch (dtype) {
    case DType::kInt8:
      return static_cast<int8_t>(code);
    case DType::kFloat8E4M3:
      return e4m3_to_float(code);
    case DType::kFloat8E5M2:
      return e5m2_to_float(code);
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  not_8bit(dtype);
}

inline float format_max(DType dtype) {
  switch (dtype) {
    case DType::kInt8:
      return kInt8Max;
    case DType::kFloat8E4M3:
      return kE4M3Max;
    case DType::kFloat8E5M2:
      return kE5M2Max;
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  not_8bit(dtype);
}

// A per-token scale: the largest finite |row[c]| over the format's largest value, so that the
// row's largest element encodes to the format's largest; 1 for a row with no finite nonzero
// value; never 0 (a subnormal quotient that rounds to 0 becomes the smallest float).
inline float row_scale(DType dtype, const float* row, int64_t n) {
  float absmax = 0;
  for (int64_t c = 0; c < n; ++c) {
    if (std::isfinite(row[c])) absmax = std::max(absmax, std::fabs(row[c]));
  }
  if (absmax == 0) return 1.0f;
  const float s = absmax / format_max(dtype);
  return s > 0 ? s : std::numeric_limits<float>::denorm_min();
}

// dst[c * stride] = encode(row[c] / scale) for c < n, the quotient taken in double.
inline void encode_row(DType dtype, const float* row, int64_t n, float scale, uint8_t* dst,
                       int64_t stride) {
  for (int64_t c = 0; c < n; ++c) {
    dst[c * stride] = encode(dtype, static_cast<double>(row[c]) / scale);
  }
}

}  // namespace flashcte::kv8

#endif  // FLASHCTE_SRC_CORE_KV8_H_
