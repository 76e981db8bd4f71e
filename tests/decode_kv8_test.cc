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
#include <limits>
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
  std::vector<float> lse(static_cast<size_t>(kBatch * kQHeads * kTokens));
  DecodeOutputs outputs;
  outputs.out = out.mutable_view();
  outputs.lse =
      MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kQHeads, kTokens});
  const TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {kBatch, kTokens});
  std::vector<float> bad;
  std::vector<float> tokens(static_cast<size_t>(kBatch * kKvHeads * (kMaxLen - 1)), 1.0f);
  Tensor4 vf(DType::kFloat32, {kBatch, kKvHeads, kMaxLen, kDv});
  Tensor4 vh(DType::kFloat16, {kBatch, kKvHeads, kMaxLen, kDv});
  // Refused for `argument` with every buffer of the call as it was, out and lse included.
  const auto refuses = [&](const TensorView& v, const DecodeOptions& o, const std::string& argument,
                           const std::string& what) {
    BufferSnapshot snap;
    snap.add("q", q.bytes()).add("positions", positions);
    snap.add("k_cache", kc.codes).add("k_scale", kc.scale);
    snap.add("v_cache", vc.codes).add("v_scale", vc.scale);
    snap.add("bad scale", bad).add("per-token scale", tokens);
    snap.add("float32 v_cache", vf.bytes()).add("float16 v_cache", vh.bytes());
    snap.add_output("out", out.bytes()).add_output("lse", lse);
    EXPECT_TRUE(refused_for(decode_attention(q.view(), kc.view(), v, pos, outputs, o), argument))
        << what;
    EXPECT_TRUE(snap.unchanged()) << what;
  };
  DecodeOptions o;
  o.v_scale = vc.scale_view();
  refuses(vc.view(), o, "k_scale", "missing");
  bad = {0.5f, 0.0f};
  o.k_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {2});
  refuses(vc.view(), o, "k_scale", "an entry 0");
  bad = {0.5f, 0.5f, 0.5f};
  o.k_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {3});
  refuses(vc.view(), o, "k_scale", "neither (1,) nor (kv_heads,)");
  // Per token, but not the cache's shape without its last axis.
  o.k_scale =
      TensorView::contiguous(tokens.data(), DType::kFloat32, {kBatch, kKvHeads, kMaxLen - 1});
  refuses(vc.view(), o, "k_scale", "per token, one slot short");
  // A scale for a float cache.
  o.k_scale = kc.scale_view();
  refuses(vf.view(), o, "v_scale", "a scale beside a float32 cache");
  // A float cache in another dtype than q's is still refused.
  o.v_scale = {};
  refuses(vh.view(), o, "v_cache", "a float16 cache beside float32 q");
}

// Paged 8-bit caches (K int8 with per-token scales in the pages, V e5m2 with per-head scales):
// bad pages, scales, block sizes, positions and outputs over a cache's memory are refused by
// name, with every buffer of the call (codes, scales, the table, positions, q, out, lse) byte for
// byte as it was.
struct PagedDecode8 {
  Cache8 kc{DType::kInt8, kD, 2, 1}, vc{DType::kFloat8E5M2, kDv, 1, 2};
  Pages8 kp{kc, 4}, vp{vc, 4};  // the same shuffle: one table for both
  Tensor4 q{DType::kFloat32, {kBatch, kQHeads, kTokens, kD}};
  Tensor4 out{DType::kFloat32, {kBatch, kQHeads, kTokens, kDv}};
  std::vector<float> lse = std::vector<float>(static_cast<size_t>(kBatch * kQHeads * kTokens));
  // Sequence 0 reads all its pages, sequence 1 its pages 0 to 5.
  std::vector<int64_t> positions = {kMaxLen - 2, kMaxLen - 1, 19, 20};
  std::vector<float> three = {0.5f, 0.5f, 0.5f};
  TensorView k, v, pos;
  DecodeOptions options;
  DecodeOutputs outputs;

  PagedDecode8()
      : k(kp.view(kc)),
        v(vp.view(vc)),
        pos(TensorView::contiguous(positions.data(), DType::kInt64, {kBatch, kTokens})) {
    options.k_scale = kp.scale_view(kc);
    options.v_scale = vp.scale_view(vc);
    options.block_table = kp.table_view();
    outputs.out = out.mutable_view();
    outputs.lse =
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kQHeads, kTokens});
  }
  Status run() const { return decode_attention(q.view(), k, v, pos, outputs, options); }
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("q", q.bytes()).add("positions", positions).add("block_table", kp.table);
    snap.add("k_cache pages", kp.codes).add("k_scale pages", kp.scale);
    snap.add("v_cache pages", vp.codes).add("v_scale", vc.scale);
    snap.add("dense k_cache", kc.codes).add("dense k_scale", kc.scale);
    snap.add("dense v_cache", vc.codes).add("three scales", three);
    snap.add_output("out", out.bytes()).add_output("lse", lse);
    return snap;
  }
};

struct BadPaged8 {
  const char* what;
  const char* argument;
  void (*breaks)(PagedDecode8&);
};

const BadPaged8 kBadPaged8[] = {
    {"a page past num_blocks that sequence 1 reads", "block_table",
     [](PagedDecode8& c) {
       c.kp.table[static_cast<size_t>(c.kp.pages + 5)] = static_cast<int32_t>(kBatch * c.kp.pages);
     }},
    {"a negative page that sequence 1 reads", "block_table",
     [](PagedDecode8& c) { c.kp.table[static_cast<size_t>(c.kp.pages)] = -1; }},
    {"block_table int64", "block_table",
     [](PagedDecode8& c) { c.options.block_table.dtype = DType::kInt64; }},
    {"a position past sequence 1's pages", "positions",
     [](PagedDecode8& c) { c.positions[3] = 40; }},
    {"v_cache of another block size", "v_cache", [](PagedDecode8& c) { c.v.shape[2] = 2; }},
    {"block_size 0", "k_cache", [](PagedDecode8& c) { c.k.shape[2] = c.v.shape[2] = 0; }},
    {"per-token k_scale in the dense cache's shape", "k_scale",
     [](PagedDecode8& c) { c.options.k_scale = c.kc.scale_view(); }},
    {"per-token k_scale of another block size", "k_scale",
     [](PagedDecode8& c) { c.options.k_scale.shape[2] = 3; }},
    {"k_scale float16", "k_scale",
     [](PagedDecode8& c) { c.options.k_scale.dtype = DType::kFloat16; }},
    {"v_scale missing", "v_scale", [](PagedDecode8& c) { c.options.v_scale = {}; }},
    {"v_scale with a NaN entry", "v_scale",
     [](PagedDecode8& c) { c.vc.scale[1] = std::numeric_limits<float>::quiet_NaN(); }},
    {"v_scale with an entry 0", "v_scale", [](PagedDecode8& c) { c.vc.scale[0] = 0.0f; }},
    {"v_scale of 3 entries for 2 KV heads", "v_scale",
     [](PagedDecode8& c) {
       c.options.v_scale = TensorView::contiguous(c.three.data(), DType::kFloat32, {3});
     }},
    {"out over a K page", "out", [](PagedDecode8& c) { c.outputs.out.data = c.kp.codes.data(); }},
    {"lse over the per-token k_scale", "lse",
     [](PagedDecode8& c) { c.outputs.lse.data = c.kp.scale.data(); }},
};

TEST(DecodeKv8, PagedRefusalsWriteNothing) {
  {
    PagedDecode8 valid;
    const Status s = valid.run();
    ASSERT_TRUE(s.ok) << s.message;
  }
  for (const BadPaged8& bad : kBadPaged8) {
    PagedDecode8 call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

}  // namespace
}  // namespace flashcte::test
