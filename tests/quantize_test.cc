// quantize_kv (include/flashcte/kvcache.h) against the reference's rounding: every 8-bit format x
// every scale granularity x every source dtype, strided views, saturation, extreme scales, the
// special values, and refusals that leave dst and scale as they were.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/core/half.h"
#include "src/reference/reference.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr int64_t kTokens = 7, kHeads = 3, kD = 19;
constexpr DType kFormats[] = {DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2};

double format_max(DType dtype) {
  return dtype == DType::kInt8 ? 127.0 : dtype == DType::kFloat8E4M3 ? 448.0 : 57344.0;
}

// src as (tokens, kv_heads, d) with d strided by 2 and padded rows; dst as rows of a larger
// buffer (d contiguous, heads 32 bytes apart, tokens 128 bytes apart) filled with a sentinel.
struct Buffers {
  HostTensor src;
  std::vector<uint8_t> dst = std::vector<uint8_t>(kTokens * 128, 0xA5);
  std::vector<float> scale;

  Buffers(DType src_dtype, const std::vector<float>& values)
      : src(src_dtype, {kTokens, kHeads, kD}, Layout::kPadded) {
    for (int64_t i = 0; i < kTokens * kHeads * kD; ++i) {
      src.set(i / (kHeads * kD), (i / kD) % kHeads, i % kD, values[static_cast<size_t>(i)]);
    }
  }
  MutableTensorView dst_view(DType format) {
    return {dst.data(), format, 3, {kTokens, kHeads, kD, 0}, {128, 32, 1, 0}};
  }
  MutableTensorView scale_view(int rank) {
    if (rank == 2) {
      return {scale.data(), DType::kFloat32, 2, {kTokens, kHeads, 0, 0}, {kHeads, 1, 0, 0}};
    }
    return {scale.data(),
            DType::kFloat32,
            1,
            {static_cast<int64_t>(scale.size()), 0, 0, 0},
            {1, 0, 0, 0}};
  }
  uint8_t code(int64_t t, int64_t h, int64_t x) const {
    return dst[static_cast<size_t>(t * 128 + h * 32 + x)];
  }
};

// Checks every element of dst against src / scale rounded by the reference, and the computed
// per-token scales against the definition.
void expect_quantized(const Buffers& b, DType format, int granularity) {
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t h = 0; h < kHeads; ++h) {
      double s = 0;
      if (granularity == 0) s = b.scale[0];
      if (granularity == 1) s = b.scale[static_cast<size_t>(h)];
      if (granularity == 2) {
        double absmax = 0;
        for (int64_t x = 0; x < kD; ++x) {
          const double v = b.src.get(t, h, x);
          if (std::isfinite(v)) absmax = std::max(absmax, std::fabs(v));
        }
        s = b.scale[static_cast<size_t>(t * kHeads + h)];
        const double want = absmax > 0 ? absmax / format_max(format) : 1.0;
        ASSERT_NEAR(s, want, want * 1.2e-7) << "scale of token " << t << " head " << h;
      }
      for (int64_t x = 0; x < kD; ++x) {
        const double want = reference::round_to_dtype(b.src.get(t, h, x) / s, format);
        const uint8_t c = b.code(t, h, x);
        const double got = reference::load_element(&c, format, 0);
        const bool same = (std::isnan(got) && std::isnan(want)) || got == want;
        ASSERT_TRUE(same) << dtype_name(format) << " granularity " << granularity << " at (" << t
                          << ", " << h << ", " << x << "): src " << b.src.get(t, h, x) << " scale "
                          << s << " got " << got << " want " << want;
      }
    }
  }
}

std::vector<float> random_values(uint32_t seed, float spread) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, spread);
  std::vector<float> v(kTokens * kHeads * kD);
  for (float& x : v) x = n(rng);
  return v;
}

TEST(QuantizeKv, EveryFormatGranularityAndSourceDtypeMatchesTheReference) {
  for (DType src_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType format : kFormats) {
      for (int granularity = 0; granularity < 3; ++granularity) {
        SCOPED_TRACE(std::string(dtype_name(src_dtype)) + " -> " + dtype_name(format) +
                     " granularity " + std::to_string(granularity));
        std::vector<float> values = random_values(3, 4.0f);
        values[5] = 0.0f;
        values[6] = -0.0f;
        Buffers b(src_dtype, values);
        b.scale = granularity == 0   ? std::vector<float>{0.03f}
                  : granularity == 1 ? std::vector<float>{0.01f, 0.02f, 0.5f}
                                     : std::vector<float>(kTokens * kHeads, -7.0f);
        const Status s =
            quantize_kv(b.src.view(), b.dst_view(format), b.scale_view(granularity == 2 ? 2 : 1));
        ASSERT_TRUE(s.ok) << s.message;
        expect_quantized(b, format, granularity);
        // Nothing written outside dst's elements.
        for (int64_t t = 0; t < kTokens; ++t) {
          for (int64_t h = 0; h < 4; ++h) {
            for (int64_t x = h < kHeads ? kD : 0; x < 32; ++x) {
              ASSERT_EQ(b.dst[static_cast<size_t>(t * 128 + h * 32 + x)], 0xA5);
            }
          }
        }
      }
    }
  }
}

TEST(QuantizeKv, SaturatesAndKeepsTheSpecialValuesAsTheFormatCan) {
  const float inf = std::numeric_limits<float>::infinity();
  for (DType format : kFormats) {
    for (float scale : {std::ldexp(1.0f, -20), 1.0f, std::ldexp(1.0f, 20)}) {
      SCOPED_TRACE(std::string(dtype_name(format)) + " scale " + std::to_string(scale));
      std::vector<float> values =
          random_values(5, 3.0f * scale * static_cast<float>(format_max(format)));
      values[1] = inf;
      values[2] = -inf;
      if (format != DType::kInt8) values[3] = std::numeric_limits<float>::quiet_NaN();
      Buffers b(DType::kFloat32, values);
      b.scale = {scale};
      ASSERT_TRUE(quantize_kv(b.src.view(), b.dst_view(format), b.scale_view(1)).ok);
      expect_quantized(b, format, 0);
      const auto value = [&](int64_t i) {
        const uint8_t c = b.code(0, 0, i);
        return reference::load_element(&c, format, 0);
      };
      const double top = format_max(format);
      EXPECT_EQ(value(1), format == DType::kFloat8E5M2 ? inf : top);
      EXPECT_EQ(value(2), format == DType::kFloat8E5M2 ? -inf : -top);
      if (format != DType::kInt8) {
        EXPECT_TRUE(std::isnan(value(3)));
      }
      // Per token: the scale ignores the infinities and NaN, so the finite values keep their
      // resolution.
      b.scale.assign(kTokens * kHeads, 0.0f);
      ASSERT_TRUE(quantize_kv(b.src.view(), b.dst_view(format), b.scale_view(2)).ok);
      expect_quantized(b, format, 2);
    }
  }
}

// Every refusal leaves src, dst and scale byte for byte as they were (dst holds its 0xA5 sentinel,
// per-token scales NaN), the NaN into int8 included: it sits in the last row, so a call that wrote
// rows (or their per-token scales) before looking would show.
TEST(QuantizeKv, RefusesBadArgumentsByNameAndWritesNothing) {
  std::vector<float> values = random_values(9, 1.0f);
  Buffers b(DType::kFloat32, values);
  const auto refuses = [&](Buffers& on, const MutableTensorView& dst,
                           const MutableTensorView& scale, const std::string& argument,
                           const char* what) {
    BufferSnapshot snap;
    snap.add("src", on.src.bytes()).add("dst", on.dst).add("scale", on.scale);
    const Status s = quantize_kv(on.src.view(), dst, scale);
    EXPECT_TRUE(refused_for(s, argument)) << what;
    EXPECT_TRUE(snap.unchanged()) << what;
    return s.message;
  };
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    b.scale = {0.5f, bad, 0.25f};
    refuses(b, b.dst_view(DType::kInt8), b.scale_view(1), "scale", "a bad per-head scale");
  }
  b.scale = {0.5f, 0.5f};  // neither (1,) nor (kv_heads,)
  refuses(b, b.dst_view(DType::kInt8), b.scale_view(1), "scale", "2 scales for 3 heads");
  b.scale = {0.5f};
  refuses(b, b.dst_view(DType::kBFloat16), b.scale_view(1), "dst", "a bfloat16 dst");
  MutableTensorView short_dst = b.dst_view(DType::kInt8);
  short_dst.shape[2] = kD - 1;
  refuses(b, short_dst, b.scale_view(1), "dst", "dst one channel short");
  MutableTensorView float_scale = b.scale_view(1);
  float_scale.dtype = DType::kFloat16;
  refuses(b, b.dst_view(DType::kInt8), float_scale, "scale", "a float16 scale");
  // Per-token scales over dst, which the call writes.
  MutableTensorView scale_over_dst = b.scale_view(2);
  scale_over_dst.data = b.dst.data();
  b.scale.assign(kTokens * kHeads, std::numeric_limits<float>::quiet_NaN());
  refuses(b, b.dst_view(DType::kFloat8E4M3), scale_over_dst, "dst", "per-token scales over dst");
  // Per-token scales whose rows overlap each other.
  MutableTensorView overlapping = b.scale_view(2);
  overlapping.strides[0] = 1;
  refuses(b, b.dst_view(DType::kFloat8E5M2), overlapping, "scale", "overlapping per-token scales");
  // NaN into int8, found before any row is written (the NaN sits in the last row), with the
  // scale per tensor and per token (which the call writes).
  values.back() = std::numeric_limits<float>::quiet_NaN();
  Buffers nan(DType::kFloat32, values);
  nan.scale = {0.5f};
  const std::string message =
      refuses(nan, nan.dst_view(DType::kInt8), nan.scale_view(1), "src", "a NaN into int8");
  EXPECT_NE(message.find("(6, 2, 18)"), std::string::npos) << message;
  nan.scale.assign(kTokens * kHeads, std::numeric_limits<float>::quiet_NaN());
  refuses(nan, nan.dst_view(DType::kInt8), nan.scale_view(2), "src",
          "a NaN into int8 with per-token scales");
}

}  // namespace
}  // namespace flashcte::test
