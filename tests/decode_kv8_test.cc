// decode_attention over 8-bit caches (int8, float8_e4m3fn, float8_e5m2 with per-tensor or
// per-KV-head scales) against the float64 reference on the dequantized cache (code x scale), on
// every SIMD target, dense and paged (paged bitwise the dense result), with K and V in different
// formats, GQA, d and dv that end in vector tails; and the refusals of the scales.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashcte/decode.h"
#include "src/core/kv8.h"
#include "src/reference/reference.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr int64_t kBatch = 2, kQHeads = 8, kKvHeads = 2, kTokens = 2, kD = 40, kDv = 24;
constexpr int64_t kMaxLen = 37;

// One 8-bit cache (batch, kv_heads, max_len, channels), its codes and the scales.
struct Cache8 {
  DType format;
  int64_t channels;
  std::vector<uint8_t> codes;
  int granularity;           // 0 per tensor, 1 per KV head, 2 per token
  std::vector<float> scale;  // (1,), (kv_heads,) or (batch, kv_heads, max_len)

  Cache8(DType f, int64_t c, int g, uint32_t seed) : format(f), channels(c), granularity(g) {
    codes.resize(static_cast<size_t>(kBatch * kKvHeads * kMaxLen * c));
    std::mt19937 rng(seed);
    if (g == 2) {
      std::uniform_real_distribution<float> u(0.001f, 0.02f);
      for (int64_t i = 0; i < kBatch * kKvHeads * kMaxLen; ++i) scale.push_back(u(rng));
    } else {
      scale = g == 1 ? std::vector<float>{0.013f, 0.0021f} : std::vector<float>{0.007f};
    }
    std::normal_distribution<double> n(0.0, 1.0);
    // Codes spread over much of the format's range.
    const double top = format == DType::kInt8 ? 60.0 : 200.0;
    for (uint8_t& code : codes) code = kv8::encode(format, n(rng) * top);
  }
  double slot_scale(int64_t b, int64_t h, int64_t j) const {
    if (granularity == 2) return scale[static_cast<size_t>((b * kKvHeads + h) * kMaxLen + j)];
    return scale[scale.size() == 1 ? 0 : h];
  }
  double value(int64_t b, int64_t h, int64_t j, int64_t x) const {
    const uint8_t c = codes[static_cast<size_t>(((b * kKvHeads + h) * kMaxLen + j) * channels + x)];
    return reference::load_element(&c, format, 0) * slot_scale(b, h, j);
  }
  TensorView view() const {
    return {codes.data(),
            format,
            4,
            {kBatch, kKvHeads, kMaxLen, channels},
            {kKvHeads * kMaxLen * channels, kMaxLen * channels, channels, 1}};
  }
  TensorView scale_view() const {
    if (granularity == 2) {
      return TensorView::contiguous(scale.data(), DType::kFloat32, {kBatch, kKvHeads, kMaxLen});
    }
    return TensorView::contiguous(scale.data(), DType::kFloat32,
                                  {static_cast<int64_t>(scale.size())});
  }
};

// The same codes as pages of `block` slots, (num_blocks, kv_heads, block, channels), the pages
// of each sequence at shuffled places.
struct Pages8 {
  std::vector<uint8_t> codes;
  std::vector<float> scale;  // per token: (num_blocks, kv_heads, block), in the pages
  std::vector<int32_t> table;
  int64_t block, pages;
  Pages8(const Cache8& c, int64_t block_size) : block(block_size) {
    pages = (kMaxLen + block - 1) / block;
    table.resize(static_cast<size_t>(kBatch * pages));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(3));
    codes.assign(static_cast<size_t>(kBatch * pages * kKvHeads * block * c.channels), 0x7F);
    if (c.granularity == 2) {
      scale.assign(static_cast<size_t>(kBatch * pages * kKvHeads * block), NAN);
    }
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < kMaxLen; ++j) {
          const int64_t page = table[static_cast<size_t>(b * pages + j / block)];
          std::memcpy(
              &codes[static_cast<size_t>(((page * kKvHeads + h) * block + j % block) * c.channels)],
              &c.codes[static_cast<size_t>(((b * kKvHeads + h) * kMaxLen + j) * c.channels)],
              static_cast<size_t>(c.channels));
          if (c.granularity == 2) {
            scale[static_cast<size_t>((page * kKvHeads + h) * block + j % block)] =
                c.scale[static_cast<size_t>((b * kKvHeads + h) * kMaxLen + j)];
          }
        }
      }
    }
  }
  TensorView view(const Cache8& c) const {
    return {codes.data(),
            c.format,
            4,
            {kBatch * pages, kKvHeads, block, c.channels},
            {kKvHeads * block * c.channels, block * c.channels, c.channels, 1}};
  }
  TensorView scale_view(const Cache8& c) const {
    if (c.granularity != 2) return c.scale_view();
    return TensorView::contiguous(scale.data(), DType::kFloat32, {kBatch * pages, kKvHeads, block});
  }
  TensorView table_view() const {
    return TensorView::contiguous(table.data(), DType::kInt32, {kBatch, pages});
  }
};

struct DecodeResult {
  Status status;
  std::vector<unsigned char> out;
  std::vector<float> lse;
};

DecodeResult decode(const Tensor4& q, const TensorView& k, const TensorView& v,
                    const TensorView& k_scale, const TensorView& v_scale,
                    const std::vector<int64_t>& positions, const TensorView& table) {
  Tensor4 out(q.view().dtype, {kBatch, kQHeads, kTokens, kDv});
  out.fill_nan();
  DecodeResult r;
  r.lse = nan_floats(kBatch * kQHeads * kTokens);
  DecodeOptions o;
  o.scale = static_cast<float>(1.0 / std::sqrt(double{kD}));
  o.k_scale = k_scale;
  o.v_scale = v_scale;
  o.block_table = table;
  DecodeOutputs outputs;
  outputs.out = out.mutable_view();
  outputs.lse =
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kBatch, kQHeads, kTokens});
  r.status = decode_attention(
      q.view(), k, v, TensorView::contiguous(positions.data(), DType::kInt64, {kBatch, kTokens}),
      outputs, o);
  r.out = out.bytes();
  return r;
}

TEST(DecodeKv8, MatchesTheReferenceOnTheDequantizedCacheOnEveryTarget) {
  const DType formats[] = {DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2};
  const std::vector<int64_t> positions = {kMaxLen - 2, kMaxLen - 1, 19, 20};
  for (DType q_dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int f = 0; f < 3; ++f) {
      for (int g = 0; g < 3; ++g) {
        // K in one format, V in the next, and in different granularities: both may differ.
        const Cache8 kc(formats[f], kD, g, 11), vc(formats[(f + 1) % 3], kDv, (g + f) % 3, 12);
        Tensor4 q(q_dtype, {kBatch, kQHeads, kTokens, kD});
        std::mt19937 rng(5);
        std::uniform_real_distribution<double> u(-1.0, 1.0);
        for (int64_t i = 0; i < kBatch * kQHeads * kTokens * kD; ++i) {
          q.set(i / (kQHeads * kTokens * kD), i / (kTokens * kD) % kQHeads, i / kD % kTokens,
                i % kD, 4 * u(rng));
        }
        // The reference per sequence: float64 attention over the dequantized rows up to the last
        // token's slot, causal at the tokens' positions.
        std::vector<double> want_out, want_lse;
        for (int64_t b = 0; b < kBatch; ++b) {
          const int64_t hi = positions[static_cast<size_t>(b * kTokens + kTokens - 1)] + 1;
          HostTensor qr(DType::kFloat32, {kQHeads, kTokens, kD});
          HostTensor kr(DType::kFloat32, {kKvHeads, hi, kD}),
              vr(DType::kFloat32, {kKvHeads, hi, kDv});
          for (int64_t h = 0; h < kQHeads; ++h) {
            for (int64_t t = 0; t < kTokens; ++t) {
              for (int64_t x = 0; x < kD; ++x) qr.set(h, t, x, q.get(b, h, t, x));
            }
          }
          for (int64_t h = 0; h < kKvHeads; ++h) {
            for (int64_t j = 0; j < hi; ++j) {
              for (int64_t x = 0; x < kD; ++x) kr.set(h, j, x, kc.value(b, h, j, x));
              for (int64_t x = 0; x < kDv; ++x) vr.set(h, j, x, vc.value(b, h, j, x));
            }
          }
          Options o;
          o.tp_k = true;
          o.scale = static_cast<float>(1.0 / std::sqrt(double{kD}));
          o.cp_offset = positions[static_cast<size_t>(b * kTokens)];
          reference::Result exact;
          ASSERT_TRUE(reference::attention(qr.view(), kr.view(), vr.view(), o, &exact).ok);
          for (int64_t h = 0; h < kQHeads; ++h) {
            for (int64_t t = 0; t < kTokens; ++t) {
              for (int64_t x = 0; x < kDv; ++x) want_out.push_back(exact.out_at(h, t, x));
              want_lse.push_back(exact.lse[static_cast<size_t>(h * kTokens + t)]);
            }
          }
        }
        double top = 0, top_v = 0;
        for (double x : want_out) top = std::max(top, std::fabs(x));
        for (int64_t i = 0; i < kBatch * kKvHeads * kMaxLen * kDv; ++i) {
          top_v = std::max(top_v, std::fabs(vc.value(i / (kKvHeads * kMaxLen * kDv),
                                                     i / (kMaxLen * kDv) % kKvHeads,
                                                     i / kDv % kMaxLen, i % kDv)));
        }
        // float32 arithmetic on exactly dequantized values (the scale folded into one product),
        // then the output rounded once to q's dtype (bfloat16's unit roundoff 2^-8 of it). A
        // bfloat16 q on the native kernels (AVX512_BF16) also rounds each P (times its per-token
        // V scale) to bfloat16, as a bfloat16 implementation does: 2^-8 of each P, so of the
        // largest |V| at most.
        const double tol = q_dtype == DType::kFloat32 ? 1e-5 * top + 1e-6
                                                      : std::ldexp(1.0, -8) * (top + top_v) + 1e-6;
        const Pages8 kp(kc, 4), vp(vc, 4);
        for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
          hwy::SetSupportedTargetsForTest(target);
          SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", q " +
                       dtype_name(q_dtype) + ", k " + dtype_name(kc.format) + ", v " +
                       dtype_name(vc.format) + ", granularities " + std::to_string(kc.granularity) +
                       "/" + std::to_string(vc.granularity));
          const DecodeResult dense =
              decode(q, kc.view(), vc.view(), kc.scale_view(), vc.scale_view(), positions, {});
          ASSERT_TRUE(dense.status.ok) << dense.status.message;
          Tensor4 got(q_dtype, {kBatch, kQHeads, kTokens, kDv});
          got.bytes() = dense.out;
          size_t i = 0;
          for (int64_t b = 0; b < kBatch; ++b) {
            for (int64_t h = 0; h < kQHeads; ++h) {
              for (int64_t t = 0; t < kTokens; ++t, ++i) {
                for (int64_t x = 0; x < kDv; ++x) {
                  ASSERT_NEAR(got.get(b, h, t, x), want_out[i * kDv + x], tol)
                      << b << " " << h << " " << t << " " << x;
                }
                ASSERT_NEAR(dense.lse[i], want_lse[i],
                            1e-5 * std::max(1.0, std::fabs(want_lse[i])));
              }
            }
          }
          const DecodeResult paged = decode(q, kp.view(kc), vp.view(vc), kp.scale_view(kc),
                                            vp.scale_view(vc), positions, kp.table_view());
          ASSERT_TRUE(paged.status.ok) << paged.status.message;
          EXPECT_EQ(paged.out, dense.out);
          EXPECT_EQ(paged.lse, dense.lse);
        }
        hwy::SetSupportedTargetsForTest(0);
      }
    }
  }
}

TEST(DecodeKv8, ScalesAreCheckedByName) {
  const Cache8 kc(DType::kInt8, kD, 1, 1), vc(DType::kFloat8E4M3, kDv, 0, 2);
  Tensor4 q(DType::kFloat32, {kBatch, kQHeads, kTokens, kD});
  const std::vector<int64_t> positions = {1, 2, 3, 4};
  Tensor4 out(DType::kFloat32, {kBatch, kQHeads, kTokens, kDv});
  const std::vector<unsigned char> before = out.bytes();
  DecodeOutputs outputs;
  outputs.out = out.mutable_view();
  const TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {kBatch, kTokens});
  DecodeOptions o;
  o.v_scale = vc.scale_view();
  EXPECT_TRUE(refused_for(decode_attention(q.view(), kc.view(), vc.view(), pos, outputs, o),
                          "k_scale"));  // missing
  std::vector<float> bad = {0.5f, 0.0f};
  o.k_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {2});
  EXPECT_TRUE(
      refused_for(decode_attention(q.view(), kc.view(), vc.view(), pos, outputs, o), "k_scale"));
  bad = {0.5f, 0.5f, 0.5f};
  o.k_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {3});
  EXPECT_TRUE(
      refused_for(decode_attention(q.view(), kc.view(), vc.view(), pos, outputs, o), "k_scale"));
  // Per token, but not the cache's shape without its last axis.
  std::vector<float> tokens(static_cast<size_t>(kBatch * kKvHeads * (kMaxLen - 1)), 1.0f);
  o.k_scale =
      TensorView::contiguous(tokens.data(), DType::kFloat32, {kBatch, kKvHeads, kMaxLen - 1});
  EXPECT_TRUE(
      refused_for(decode_attention(q.view(), kc.view(), vc.view(), pos, outputs, o), "k_scale"));
  // A scale for a float cache.
  Tensor4 vf(DType::kFloat32, {kBatch, kKvHeads, kMaxLen, kDv});
  o.k_scale = kc.scale_view();
  EXPECT_TRUE(
      refused_for(decode_attention(q.view(), kc.view(), vf.view(), pos, outputs, o), "v_scale"));
  // A float cache in another dtype than q's is still refused.
  Tensor4 vh(DType::kFloat16, {kBatch, kKvHeads, kMaxLen, kDv});
  o.v_scale = {};
  EXPECT_TRUE(
      refused_for(decode_attention(q.view(), kc.view(), vh.view(), pos, outputs, o), "v_cache"));
  EXPECT_EQ(out.bytes(), before);
}

}  // namespace
}  // namespace flashcte::test
