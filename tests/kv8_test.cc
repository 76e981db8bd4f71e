// The 8-bit KV cache formats' scalar conversions (src/core/kv8.h) against the reference's own
// decoding and rounding (src/reference, written apart from them): every code decoded, and a sweep
// of float32 values (every float16 value, the formats' rounding ties, overflow, underflow,
// infinities and NaN) encoded.
#include "src/core/kv8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/half.h"
#include "src/reference/reference.h"

namespace flashcte {
namespace {

using kv8::decode;
using kv8::encode;

bool same(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

constexpr DType kFormats[] = {DType::kFloat8E4M3, DType::kFloat8E5M2, DType::kInt8};

TEST(Kv8, EveryCodeDecodesAsTheReferenceReadsIt) {
  for (DType dtype : kFormats) {
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const double want = reference::load_element(&code, dtype, 0);
      EXPECT_TRUE(same(decode(dtype, code), want))
          << dtype_name(dtype) << " code " << c << ": " << decode(dtype, code) << " vs " << want;
    }
  }
  // The formats' landmarks.
  EXPECT_EQ(kv8::e4m3_to_float(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(kv8::e4m3_to_float(0x7F)));
  EXPECT_EQ(kv8::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(kv8::e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(kv8::e5m2_to_float(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_EQ(kv8::e5m2_to_float(0x01), std::ldexp(1.0f, -16));
}

TEST(Kv8, EncodingRoundsToNearestEvenAndSaturatesAsTheReference) {
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x10000; ++h) xs.push_back(half::f16_to_float(static_cast<uint16_t>(h)));
  // Every format value, the midpoints between neighbours (ties) and a hair either side of them.
  for (DType dtype : kFormats) {
    for (int c = 0; c < 255; ++c) {
      const double a = decode(dtype, static_cast<uint8_t>(c));
      const double b = decode(dtype, static_cast<uint8_t>(c + 1));
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const auto mid = static_cast<float>((a + b) / 2);
      xs.insert(xs.end(), {static_cast<float>(a), mid, std::nextafter(mid, 0.0f),
                           std::nextafter(mid, 1e9f), std::nextafter(mid, -1e9f)});
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  xs.insert(xs.end(), {inf, -inf, 1e30f, -1e30f, 448.0f, 464.0f, 465.0f, 57344.0f, 61440.0f, 126.5f,
                       127.5f, 128.0f, -127.5f, -200.0f, 1e-30f, -1e-30f, 0.0f, -0.0f});
  for (DType dtype : kFormats) {
    for (float x : xs) {
      if (dtype == DType::kInt8 && std::isnan(x)) continue;  // int8 has no NaN: callers refuse it
      const double want = reference::round_to_dtype(x, dtype);
      const float got = decode(dtype, encode(dtype, x));
      // int8 keeps no sign of zero.
      const bool ok = dtype == DType::kInt8 ? got == want : same(got, want);
      ASSERT_TRUE(ok) << dtype_name(dtype) << " x " << x << ": " << got << " vs " << want;
    }
  }
  // Saturation, by name: past the largest finite value, and infinities where the format has none.
  EXPECT_EQ(kv8::e4m3_to_float(kv8::float_to_e4m3(1e6f)), 448.0f);
  EXPECT_EQ(kv8::e4m3_to_float(kv8::float_to_e4m3(-inf)), -448.0f);
  EXPECT_EQ(kv8::e5m2_to_float(kv8::float_to_e5m2(1e6f)), 57344.0f);
  EXPECT_EQ(kv8::e5m2_to_float(kv8::float_to_e5m2(inf)), inf);
  EXPECT_EQ(kv8::float_to_int8(1000.0f), 127);
  EXPECT_EQ(kv8::float_to_int8(-1000.0f), -127);
  EXPECT_EQ(kv8::float_to_int8(2.5f), 2);  // ties to even
  EXPECT_EQ(kv8::float_to_int8(-3.5f), -4);
}

}  // namespace
}  // namespace flashcte
