// Testers of the conversion micro-kernels (to_float, narrow_bf16, from_float to bfloat16 and
// float16, interleave_bf16, pair_bf16) on every SIMD target this CPU runs: every length where a
// vector loop has an edge, aligned and unaligned starts, canaries past the end (W4 of
// src/simd/ops.h: these touch exactly [0, n)), and the float64 oracle's rounding bit for bit.
// The arithmetic row ops: row_ops_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "src/reference/reference.h"
#include "src/simd/ops.h"
#include "tests/simd/row_cases.h"
#include "tests/simd/tester.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// The bits Ops::from_float must write for src in `dtype` (bfloat16 or float16), from the float64
// oracle rather than the library's own half:: conversions: a number rounds as
// reference::round_to_dtype does (to nearest, ties to even, subnormals kept, overflow to
// infinity), and the test encodes that value by hand (bfloat16: the high half of its float32 bits,
// exact since every bfloat16 value is a float32 one; float16: sign, biased exponent and fraction
// read off the value). A NaN is quieted keeping its sign and the top of its payload (ops.h:
// half::float_to_bf16's and float_to_f16's bits): bfloat16 the high half with the quiet bit
// 0x0040 set, float16 0x7E00 with payload bits 22..13.
uint16_t reference_half(float src, DType dtype) {
  uint32_t bits;
  std::memcpy(&bits, &src, sizeof bits);
  const auto sign = static_cast<uint16_t>(bits >> 16 & 0x8000u);
  if (std::isnan(src)) {
    return dtype == DType::kBFloat16
               ? static_cast<uint16_t>(bits >> 16 | 0x0040u)
               : static_cast<uint16_t>(sign | 0x7E00u | (bits >> 13 & 0x3FFu));
  }
  const double r = reference::round_to_dtype(src, dtype);
  if (dtype == DType::kBFloat16) {
    const auto f = static_cast<float>(r);  // exact: a bfloat16 value
    std::memcpy(&bits, &f, sizeof bits);
    EXPECT_EQ(bits & 0xFFFFu, 0u) << r << " is no bfloat16 value";
    return static_cast<uint16_t>(bits >> 16);
  }
  const double a = std::fabs(r);
  if (std::isinf(a)) return static_cast<uint16_t>(sign | 0x7C00u);
  if (a < 0x1p-14) {  // subnormal or zero: a multiple of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(a * 0x1p24));
  }
  int e;
  std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): the leading bit is 2^(e - 1)
  const auto fraction = static_cast<uint32_t>(std::ldexp(a, 1 - e) * 1024.0 - 1024.0);
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(e - 1 + 15) << 10 | fraction);
}

// Every dtype, exact (the conversions are exact), with source elements past n that decode to
// NaN, and the float32 destination guarded.
TEST(SimdToFloat, ExactEveryDtype) {
  std::mt19937 rng(6);
  std::normal_distribution<double> g(0.0, 100.0);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(dtype_name(dt));
      for_each_row(ops, [&](GuardedBuffer& dst, int64_t n) {
        const int64_t size = dtype_size(dt), total = n + 2 * ops.lanes;
        std::vector<uint8_t> src(static_cast<size_t>(total * size));
        std::vector<double> want(static_cast<size_t>(n));
        for (int64_t i = 0; i < total; ++i) {
          // Normal values, subnormals and zero signs among them; NaN past n.
          const double tiny = dt == DType::kFloat16 ? 1e-7 : 1e-40;  // subnormal in the dtype
          double x = i % 7 == 3 ? g(rng) * tiny : g(rng);
          if (i % 11 == 5) x = -0.0;
          x = i < n ? reference::round_to_dtype(x, dt) : std::nan("");
          if (dt == DType::kFloat32) {
            const float f = static_cast<float>(x);
            std::memcpy(&src[i * size], &f, sizeof f);
          } else {
            const uint16_t bits = reference_half(static_cast<float>(x), dt);  // x is exact
            std::memcpy(&src[i * size], &bits, sizeof bits);
          }
          if (i < n) want[i] = reference::load_element(src.data(), dt, i);
        }
        ops.to_float(src.data(), dt, n, dst.data());
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_EQ(dst.at(0, i), want[i]) << "element " << i;
          EXPECT_EQ(std::signbit(dst.at(0, i)), std::signbit(want[i])) << "sign of " << i;
        }
      });
    }
  });
}

// The 8-bit cache formats: every code (NaN codes NaN, e5m2's infinities infinite, the rest exact,
// signs kept) at every row length, codes past n that decode to NaN.
TEST(SimdToFloat, EveryCodeOfThe8BitFormats) {
  for_each_target([&](const simd::Ops& ops) {
    for (DType dt : {DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
      SCOPED_TRACE(dtype_name(dt));
      for (int shift = 0; shift < 256; shift += 37) {
        for_each_row(ops, [&](GuardedBuffer& dst, int64_t n) {
          std::vector<uint8_t> src(static_cast<size_t>(n + 2 * ops.lanes), 0x7F);
          for (int64_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>((i + shift) % 256);
          ops.to_float(src.data(), dt, n, dst.data());
          for (int64_t i = 0; i < n; ++i) {
            const double want = reference::load_element(src.data(), dt, i);
            if (std::isnan(want)) {
              EXPECT_TRUE(std::isnan(dst.at(0, i))) << "code " << int{src[i]};
              continue;
            }
            EXPECT_EQ(dst.at(0, i), want) << "code " << int{src[i]};
            EXPECT_EQ(std::signbit(dst.at(0, i)), std::signbit(want)) << "code " << int{src[i]};
          }
        });
      }
    }
  });
}

// float32 values that hold bfloat16 ones (the only inputs the contract allows): random normals,
// subnormals, zeros of both signs, infinities and a NaN payload, whose high halves must come
// through bit for bit.
std::vector<float> bf16_values(int64_t n, std::mt19937& rng) {
  std::normal_distribution<double> g(0.0, 10.0);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    double v = g(rng);
    if (i % 7 == 3) v *= 1e-39;
    if (i % 11 == 5) v = -0.0;
    if (i % 13 == 6) v = i % 2 ? kInf : -kInf;
    x[i] = static_cast<float>(reference::round_to_dtype(v, DType::kBFloat16));
    if (i % 17 == 8) {
      const uint32_t nan_bits = 0x7FA10000u;  // a NaN with a payload in its high half
      std::memcpy(&x[i], &nan_bits, sizeof nan_bits);
    }
  }
  return x;
}
uint16_t high_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// Destinations of uint16_t / uint32_t elements with canaries past n (the float canaries' bit
// pattern, so GuardedBuffer checks them).
TEST(SimdNarrowBf16, ExactHighHalves) {
  std::mt19937 rng(7);
  for_each_target([&](const simd::Ops& ops) {
    for (int64_t n : edge_lengths(ops.lanes)) {
      SCOPED_TRACE("n " + std::to_string(n));
      const std::vector<float> src = bf16_values(n, rng);
      GuardedBuffer out(1, n / 2 + ops.lanes, 1);  // n uint16_t fit in n / 2 + 1 floats
      auto* dst = reinterpret_cast<uint16_t*>(out.data());
      ops.narrow_bf16(src.data(), n, dst);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dst[i], high_half(src[i])) << "element " << i;
      // The uint16_t at n shares a float with dst[n - 1] when n is odd: it must be unchanged.
      if (n % 2) {
        EXPECT_EQ(dst[n], static_cast<uint16_t>(kCanaryBits >> 16)) << "element n";
      }
      EXPECT_EQ(out.untouched_outside(1, (n + 1) / 2), "") << "written past n";
    }
  });
}

// Ops::from_float to `dtype` (bfloat16 or float16) against reference_half, bit for bit, on every
// target and every edge length (plus a long row): the planted bit patterns first, then draw() for
// the rest. An odd n must leave the half after the last element alone.
template <class Draw>
void ExpectRoundsAsTheReference(DType dtype, const std::vector<uint32_t>& planted, Draw draw) {
  for_each_target([&](const simd::Ops& ops) {
    std::vector<int64_t> lengths = edge_lengths(ops.lanes);
    lengths.push_back(4099);
    for (int64_t n : lengths) {
      SCOPED_TRACE("n " + std::to_string(n));
      std::vector<float> src(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = i < static_cast<int64_t>(planted.size()) ? planted[i] : draw(i);
        std::memcpy(&src[i], &bits, sizeof bits);
      }
      GuardedBuffer out(1, n / 2 + ops.lanes, 1);
      auto* dst = reinterpret_cast<uint16_t*>(out.data());
      ops.from_float(src.data(), dtype, n, dst);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(dst[i], reference_half(src[i], dtype)) << "element " << i << ", " << src[i];
      }
      if (n % 2) {
        EXPECT_EQ(dst[n], static_cast<uint16_t>(kCanaryBits >> 16)) << "element n";
      }
      EXPECT_EQ(out.untouched_outside(1, (n + 1) / 2), "") << "written past n";
    }
  });
}

// from_float to bfloat16 rounds to nearest even and quiets NaNs as the reference does, over random
// bit patterns (every class: zeros, subnormals, normals, the ties, overflow to inf, inf, NaN).
TEST(SimdRoundBf16, AsTheReferenceRoundingBitForBit) {
  std::mt19937 rng(8);
  std::uniform_int_distribution<uint32_t> any_bits;
  ExpectRoundsAsTheReference(
      DType::kBFloat16,
      {0x00000000u, 0x80000000u, 0x00000001u, 0x007FFFFFu, 0x3F808000u, 0x3F818000u, 0x3F80FFFFu,
       0x7F7FFFFFu, 0xFF7F8000u, 0x7F800000u, 0xFF800000u, 0x7F800001u, 0xFFC00000u, 0x7FFFFFFFu},
      [&](int64_t) { return any_bits(rng); });
}

// from_float to float16 rounds as the reference does: random bit patterns, random values across
// float16's range (where most random bits overflow or vanish), and planted edges: signed zeros,
// the ties at 2^-25 (to zero) and between subnormals, the smallest normal and the largest
// subnormal, 1 + half an ulp (even) and 1 + 3 half ulps (odd), 65504, 65520 (a tie that reaches
// infinity), infinities and NaNs, signalling ones included.
TEST(SimdRoundF16, AsTheReferenceRoundingBitForBit) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_int_distribution<uint32_t> exponent(100, 145), mantissa(0, 0x7FFFFFu);
  ExpectRoundsAsTheReference(
      DType::kFloat16,
      {0x00000000u, 0x80000000u, 0x00000001u, 0x33000000u, 0x33000001u, 0xB3000000u, 0x33800000u,
       0x33C00000u, 0x34200000u, 0x387FC000u, 0x387FE000u, 0x38800000u, 0x3F801000u, 0x3F803000u,
       0x3F801001u, 0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0xC77FF000u, 0x7F800000u, 0xFF800000u,
       0x7F800001u, 0x7FA00000u, 0xFFC00000u, 0x7FFFFFFFu},
      [&](int64_t i) {
        const uint32_t bits = any_bits(rng);
        return i % 2 ? bits : (bits & 0x80000000u) | exponent(rng) << 23 | mantissa(rng);
      });
}

TEST(SimdInterleaveBf16, PairsLowHalfFirst) {
  std::mt19937 rng(8);
  for_each_target([&](const simd::Ops& ops) {
    for (int64_t n : edge_lengths(ops.lanes)) {
      for (int nulls = 0; nulls < 3; ++nulls) {  // 0: both rows, 1: no odd row, 2: no even row
        SCOPED_TRACE("n " + std::to_string(n) + ", nulls " + std::to_string(nulls));
        const std::vector<float> lo = bf16_values(n, rng), hi = bf16_values(n, rng);
        GuardedBuffer out(1, n + ops.lanes, 2);
        auto* dst = reinterpret_cast<uint32_t*>(out.data());
        ops.interleave_bf16(nulls == 2 ? nullptr : lo.data(), nulls == 1 ? nullptr : hi.data(), n,
                            dst);
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t want_lo = nulls == 2 ? 0u : high_half(lo[i]);
          const uint32_t want_hi = nulls == 1 ? 0u : high_half(hi[i]);
          EXPECT_EQ(dst[i], want_lo | want_hi << 16) << "element " << i;
        }
        EXPECT_EQ(out.untouched_outside(1, n), "") << "written past n";
      }
    }
  });
}

// pair_bf16 pairs rows of bfloat16 bits exactly and tells whether it read a non-finite value
// (exponent all ones) or a subnormal one (exponent zero, mantissa not), at any position.
TEST(SimdPairBf16, ExactPairsAndFindings) {
  std::mt19937 rng(10);
  std::uniform_int_distribution<int> bits(0, 0xFFFF);
  for_each_target([&](const simd::Ops& ops) {
    for (int64_t n : edge_lengths(ops.lanes)) {
      for (int nulls = 0; nulls < 3; ++nulls) {  // 0: both rows, 1: no odd row, 2: no even row
        SCOPED_TRACE("n " + std::to_string(n) + ", nulls " + std::to_string(nulls));
        // Normal values only (exponent 1..254), then one unusual value planted at a time.
        auto normal = [&] {
          const int b = bits(rng);
          return static_cast<uint16_t>((b & 0x807F) | ((1 + b % 254) << 7));
        };
        std::vector<uint16_t> lo(static_cast<size_t>(n)), hi(lo.size());
        for (int64_t i = 0; i < n; ++i) {
          lo[i] = normal();
          hi[i] = normal();
        }
        const uint16_t* lo_row = nulls == 2 ? nullptr : lo.data();
        const uint16_t* hi_row = nulls == 1 ? nullptr : hi.data();
        GuardedBuffer out(1, n + ops.lanes, 2);
        auto* dst = reinterpret_cast<uint32_t*>(out.data());
        EXPECT_FALSE(ops.pair_bf16(lo_row, hi_row, n, dst)) << "normal values";
        for (int64_t i = 0; i < n; ++i) {
          const uint32_t want = (lo_row ? lo[i] : 0u) | (hi_row ? uint32_t{hi[i]} << 16 : 0u);
          EXPECT_EQ(dst[i], want) << "element " << i;
        }
        EXPECT_EQ(out.untouched_outside(1, n), "") << "written past n";
        std::vector<uint16_t>& planted = nulls == 2 ? hi : lo;
        for (int64_t at = 0; at < n; ++at) {
          const uint16_t saved = planted[at];
          for (uint16_t odd : {uint16_t{0x7F80}, uint16_t{0xFFC1}, uint16_t{0x0001},
                               uint16_t{0x807F}, uint16_t{0x0000}, uint16_t{0x8000}}) {
            planted[at] = odd;
            const bool want =
                (odd & 0x7F80u) == 0x7F80u || ((odd & 0x7F80u) == 0 && (odd & 0x7Fu) != 0);
            EXPECT_EQ(ops.pair_bf16(lo_row, hi_row, n, dst), want) << odd << " at " << at;
          }
          planted[at] = saved;
        }
      }
    }
  });
}

}  // namespace
}  // namespace flashcte::test
