// The oracle's reading and rounding of every dtype in float64 (reference.h): bit patterns
// decoded exactly, and rounding to nearest even by the formats' definitions, with nothing shared
// with the library's own conversions (src/core/half.h, kv8.h), which the tests check against it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "src/reference/reference.h"

namespace flashcte::reference {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double half_to_double(uint16_t h) {
  const int sign = h >> 15;
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);  // zero or subnormal: mantissa * 2^-24
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : kInf;
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);  // 1.m * 2^(e-15)
  }
  return sign ? -magnitude : magnitude;
}

double bfloat16_to_double(uint16_t h) {
  // bfloat16 is the upper half of a float32.
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rounds to a binary format with `precision` significant bits (implicit bit included) whose
// smallest normal is 2^min_exp: the spacing near x is 2^(e - precision) for x in [2^(e-1), 2^e),
// and never finer than the subnormal spacing 2^(min_exp + 1 - precision).
double round_to_precision(double x, int precision, int min_exp, double max_finite) {
  if (!std::isfinite(x) || x == 0) return x;
  int e;
  std::frexp(x, &e);
  const int quantum_exp = std::max(e, min_exp + 1) - precision;
  // nearbyint rounds ties to even in the default rounding mode; ldexp is exact here.
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -quantum_exp)), quantum_exp);
  if (std::fabs(r) > max_finite) return std::copysign(kInf, x);
  return r;
}

// round_to_precision for the fp8 formats, which saturate: a finite value past max_finite becomes
// max_finite of its sign, and so does an infinity unless the format keeps infinities.
double round_saturating(double x, int precision, int min_exp, double max_finite, bool keeps_inf) {
  if (std::isnan(x) || (std::isinf(x) && keeps_inf)) return x;
  if (std::isinf(x)) return std::copysign(max_finite, x);
  const double r = round_to_precision(x, precision, min_exp, max_finite);
  return std::isinf(r) ? std::copysign(max_finite, x) : r;
}

// OCP float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN and
// there is no infinity.
double e4m3_to_double(uint8_t b) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  if (e == 0xF && m == 0x7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(m / 8.0, -6);
  return sign * std::ldexp(1.0 + m / 8.0, e - 7);
}

}  // namespace

double load_element(const void* data, DType dtype, int64_t offset) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[offset];
    case DType::kBFloat16:
      return bfloat16_to_double(static_cast<const uint16_t*>(data)[offset]);
    case DType::kFloat16:
      return half_to_double(static_cast<const uint16_t*>(data)[offset]);
    case DType::kInt32:
      return static_cast<const int32_t*>(data)[offset];
    case DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(data)[offset]);
    case DType::kInt8:
      return static_cast<const int8_t*>(data)[offset];
    case DType::kFloat8E4M3:
      return e4m3_to_double(static_cast<const uint8_t*>(data)[offset]);
    case DType::kFloat8E5M2:  // binary16's upper byte
      return half_to_double(static_cast<uint16_t>(static_cast<const uint8_t*>(data)[offset] << 8));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

double round_to_dtype(double x, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      // 8 significant bits, float32's exponent range; largest finite 0x7F7F = (2 - 2^-7) * 2^127.
      return round_to_precision(x, 8, -126, std::ldexp(255.0, 120));
    case DType::kFloat16:
      // 11 significant bits, smallest normal 2^-14, largest finite 65504.
      return round_to_precision(x, 11, -14, 65504.0);
    case DType::kFloat32:
      return static_cast<float>(x);  // the C++ conversion rounds to nearest even
    case DType::kFloat8E4M3:
      // 4 significant bits, smallest normal 2^-6, largest finite 448, no infinity.
      return round_saturating(x, 4, -6, 448.0, false);
    case DType::kFloat8E5M2:
      // 3 significant bits, smallest normal 2^-14, largest finite 57344.
      return round_saturating(x, 3, -14, 57344.0, true);
    case DType::kInt8:
      return std::isnan(x) ? x : std::clamp(std::nearbyint(x), -127.0, 127.0);
    case DType::kInt32:
    case DType::kInt64:
      return std::nearbyint(x);
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace flashcte::reference
