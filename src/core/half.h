// Scalar conversions between float32/float64 and the 16-bit float formats the kernel computes
// in: the one copy for the kernel (packing and write-back), the CLI (whole input files) and the
// tests. They round exactly as numpy does (round to nearest, ties to even) and never trap on
// NaN, infinity or subnormals. Packing converts each element once per tile (O(tile * d)) against
// O(rows * tile * d) arithmetic, so scalar code is not the kernel's cost. Our own because
// Highway 1.0.3's scalar BF16FromF32 truncates, and it has no scalar float16 conversion.
#ifndef FLASHCTE_SRC_CORE_HALF_H_
#define FLASHCTE_SRC_CORE_HALF_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace flashcte::half {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// float32 -> bfloat16, round to nearest even. NaN stays NaN (quieted): adding the rounding
// bias to a NaN whose payload lives in the low bits could otherwise turn it into infinity.
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// float32 -> IEEE binary16, round to nearest even, overflow to infinity, gradual underflow.
inline uint16_t float_to_f16(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u | ((ax >> 13) & 0x3ffu);  // quiet NaN
  if (ax >= 0x47800000u) return sign | 0x7c00u;  // >= 65536 (or inf): infinity
  if (ax >= 0x38800000u) {                       // a normal half (>= 2^-14)
    uint32_t r = ax - 0x38000000u;               // rebias the exponent from 127 to 15
    r += 0xfffu + ((r >> 13) & 1u);              // a carry here correctly reaches infinity
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (ax <= 0x33000000u) return sign;  // <= 2^-25: rounds to zero (2^-25 is a tie to even 0)
  // Subnormal half: the value is m * 2^(e-150); in units of 2^-24 that is m >> (126 - e).
  const uint32_t e = ax >> 23;
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // a carry into 0x400 is the smallest normal
  return static_cast<uint16_t>(sign | q);
}

inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Zero or subnormal: man * 2^-24 is exact in float.
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}

// float64 -> float32 rounded to odd: truncate, then set the last bit when inexact. Rounding the
// result again to a format with at least two fewer mantissa bits (bf16, f16) then gives the
// correctly rounded value, which rounding to nearest twice would not (double rounding).
inline float double_to_float_round_odd(double d) {
  float f = static_cast<float>(d);
  if (std::isnan(d) || static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return bits_float(float_bits(f) | 1u);
}

inline uint16_t double_to_bf16(double d) { return float_to_bf16(double_to_float_round_odd(d)); }
inline uint16_t double_to_f16(double d) { return float_to_f16(double_to_float_round_odd(d)); }

}  // namespace flashcte::half

#endif  // FLASHCTE_SRC_CORE_HALF_H_
