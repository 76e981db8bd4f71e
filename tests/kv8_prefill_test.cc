// 8-bit KV caches outside decode_attention: attention_cte over an 8-bit prior (prefix caching,
// chunked prefill), dense and paged, and flash_attn_with_kvcache / flash_attn_varlen_kvcache over
// 8-bit caches with the append quantizing the new tokens. Against the float64 reference on the
// dequantized cache (code x scale); a float32 prefill is bitwise the same call on the prior
// dequantized to float32 (the packer computes exactly that product), on every SIMD target.
// (flash_attn_with_kvcache and flash_attn_varlen_kvcache over 8-bit caches: kv8_kvcache_test.cc
// and kv8_refusals_test.cc.)
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
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/kvcache.h"
#include "src/core/kv8.h"
#include "src/reference/reference.h"
#include "tests/kv8_formats.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---------------------------------------------------------------------------------------------
// attention_cte with an 8-bit prior.

// One KV batch per head of one sequence, so that the dense prior (bs_kv, S_prior, d) and the
// paged one (num_blocks, kv_heads, block, d) hold the same rows.
constexpr int64_t kKvHeads = 2, kGroup = 2, kSq = 21, kSkv = 5, kSPrior = 38, kD = 40, kDv = 24;
constexpr int64_t kBlock = 4, kPages = (kSPrior + kBlock - 1) / kBlock;

// An 8-bit prior (kv_heads, S_prior, channels) with its scales.
struct Prior8 {
  DType format;
  int64_t channels;
  Granularity granularity;
  std::vector<uint8_t> codes;
  std::vector<float> scale;  // (1,), (kv_heads,) or (kv_heads, S_prior)

  Prior8(DType f, int64_t c, Granularity g, uint32_t seed, double scale_base = 0.01)
      : format(f), channels(c), granularity(g) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.5, 2.0);
    const int64_t n = g == kPerTensor ? 1 : g == kPerHead ? kKvHeads : kKvHeads * kSPrior;
    for (int64_t i = 0; i < n; ++i) scale.push_back(static_cast<float>(scale_base * u(rng)));
    std::normal_distribution<double> normal(0.0, format == DType::kInt8 ? 50.0 : 150.0);
    codes.resize(static_cast<size_t>(kKvHeads * kSPrior * c));
    for (uint8_t& code : codes) code = kv8::encode(format, normal(rng));
  }
  float slot_scale(int64_t h, int64_t j) const {
    if (granularity == kPerToken) return scale[static_cast<size_t>(h * kSPrior + j)];
    return scale[granularity == kPerHead ? h : 0];
  }
  // float32's product, as the packer forms it.
  float value(int64_t h, int64_t j, int64_t x) const {
    return kv8::decode(format, codes[static_cast<size_t>((h * kSPrior + j) * channels + x)]) *
           slot_scale(h, j);
  }
  TensorView view() const {
    return TensorView::contiguous(codes.data(), format, {kKvHeads, kSPrior, channels});
  }
  TensorView scale_view() const {
    if (granularity == kPerToken) {
      return TensorView::contiguous(scale.data(), DType::kFloat32, {kKvHeads, kSPrior});
    }
    return TensorView::contiguous(scale.data(), DType::kFloat32,
                                  {static_cast<int64_t>(scale.size())});
  }
  HostTensor dequantized() const {
    HostTensor t(DType::kFloat32, {kKvHeads, kSPrior, channels});
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < kSPrior; ++j) {
        for (int64_t x = 0; x < channels; ++x) t.set(h, j, x, value(h, j, x));
      }
    }
    return t;
  }
};

// The same rows in shuffled pages, the per-token scales in the pages too; unused rows hold codes
// that would poison a result that read them (NaN in fp8, the largest in int8).
struct PagedPrior8 {
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> table;
  const Prior8& prior;

  explicit PagedPrior8(const Prior8& p) : prior(p) {
    table.resize(kPages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(7));
    codes.assign(static_cast<size_t>(kPages * kKvHeads * kBlock * p.channels), 0x7F);
    scale.assign(static_cast<size_t>(kPages * kKvHeads * kBlock),
                 std::numeric_limits<float>::quiet_NaN());
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < kSPrior; ++j) {
        const int64_t row = (table[j / kBlock] * kKvHeads + h) * kBlock + j % kBlock;
        std::memcpy(&codes[static_cast<size_t>(row * p.channels)],
                    &p.codes[static_cast<size_t>((h * kSPrior + j) * p.channels)],
                    static_cast<size_t>(p.channels));
        scale[static_cast<size_t>(row)] = p.slot_scale(h, j);
      }
    }
  }
  TensorView view() const {
    return TensorView::contiguous(codes.data(), prior.format,
                                  {kPages, kKvHeads, kBlock, prior.channels});
  }
  TensorView scale_view() const {
    if (prior.granularity != kPerToken) return prior.scale_view();
    return TensorView::contiguous(scale.data(), DType::kFloat32, {kPages, kKvHeads, kBlock});
  }
  TensorView table_view() const {
    return TensorView::contiguous(table.data(), DType::kInt32, {1, kPages});
  }
};

// `base` with the prior K and V 8-bit (dense, or paged with K's block table), scales included.
Options with_prior(Options base, const Prior8& k, const Prior8& v) {
  base.k_prior = k.view();
  base.v_prior = v.view();
  base.k_prior_scale = k.scale_view();
  base.v_prior_scale = v.scale_view();
  return base;
}
Options with_prior(Options base, const PagedPrior8& k, const PagedPrior8& v) {
  base.k_prior = k.view();
  base.v_prior = v.view();
  base.k_prior_scale = k.scale_view();
  base.v_prior_scale = v.scale_view();
  base.prior_block_table = k.table_view();
  return base;
}

struct Prefill {
  HostTensor q, k, v;
  Options options;
  Prefill(DType dtype, uint32_t seed)
      : q(dtype, {kKvHeads * kGroup, kSq, kD}),
        k(dtype, {kKvHeads, kSkv, kD}),
        v(dtype, {kKvHeads, kSkv, kDv}) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (HostTensor* t : {&q, &k, &v}) {
      for (int64_t a = 0; a < t->shape()[0]; ++a) {
        for (int64_t b = 0; b < t->shape()[1]; ++b) {
          for (int64_t c = 0; c < t->shape()[2]; ++c) t->set(a, b, c, 2 * u(rng));
        }
      }
    }
    options.tp_k = true;
    options.scale = static_cast<float>(1.0 / std::sqrt(double{kD}));
    options.prior_used_len = {kSPrior - 3, kSPrior};  // per KV batch
    options.tiles.kv_tile = 16;                       // tiles that straddle the prior's end
  }
  struct Result {
    Status status;
    std::vector<uint8_t> out;
    std::vector<float> lse;
    // The largest |out - exact| over the largest |exact|.
    double relative_error(DType dtype, const reference::Result& exact) const {
      double top = 0, err = 0;
      for (int64_t b = 0; b < kKvHeads * kGroup; ++b) {
        for (int64_t i = 0; i < kSq; ++i) {
          for (int64_t x = 0; x < kDv; ++x) {
            const double y = reference::load_element(out.data(), dtype, (b * kSq + i) * kDv + x);
            top = std::max(top, std::fabs(exact.out_at(b, i, x)));
            err = std::max(err, abs_error(y, exact.out_at(b, i, x)));
          }
        }
      }
      return err / top;
    }
  };
  Result run(const Options& o) const {
    HostTensor out(q.dtype(), {kKvHeads * kGroup, kSq, kDv});
    Result r;
    r.lse = nan_floats(kKvHeads * kGroup * kSq);
    Outputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse =
        MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kKvHeads * kGroup, kSq});
    r.status = attention_cte(q.view(), k.view(), v.view(), outputs, o);
    r.out = out.bytes();
    return r;
  }
};

TEST(Kv8Prior, Float32IsBitwiseTheDequantizedPriorDenseAndPagedOnEveryTarget) {
  const Prefill call(DType::kFloat32, 3);
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      for (bool causal : {true, false}) {
        // K and V in different formats and granularities.
        const Prior8 kp(kFormats[f], kD, static_cast<Granularity>(g), 11);
        const Prior8 vp(kFormats[(f + 1) % 3], kDv, static_cast<Granularity>((g + 1) % 3), 12);
        const HostTensor kf = kp.dequantized(), vf = vp.dequantized();
        Options wide = call.options;
        wide.causal_mask = causal;
        wide.k_prior = kf.view();
        wide.v_prior = vf.view();
        const Options o = with_prior(wide, kp, vp);
        const PagedPrior8 kpp(kp), vpp(vp);
        const Options paged = with_prior(wide, kpp, vpp);

        // On each target: the float32 prior against the reference, then the 8-bit runs bitwise
        // it (targets differ in their summation order, so each is its own yardstick).
        reference::Result exact;
        ASSERT_TRUE(
            reference::attention(call.q.view(), call.k.view(), call.v.view(), wide, &exact).ok);
        for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
          hwy::SetSupportedTargetsForTest(target);
          SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", k " +
                       dtype_name(kp.format) + ", v " + dtype_name(vp.format) + ", granularities " +
                       std::to_string(g) + "/" + std::to_string((g + 1) % 3) +
                       (causal ? ", causal" : ""));
          const Prefill::Result want = call.run(wide);
          ASSERT_TRUE(want.status.ok) << want.status.message;
          EXPECT_LE(want.relative_error(DType::kFloat32, exact), 1e-5);
          const Prefill::Result dense = call.run(o), pages = call.run(paged);
          ASSERT_TRUE(dense.status.ok) << dense.status.message;
          ASSERT_TRUE(pages.status.ok) << pages.status.message;
          EXPECT_EQ(dense.out, want.out);
          EXPECT_EQ(dense.lse, want.lse);
          EXPECT_EQ(pages.out, want.out);
          EXPECT_EQ(pages.lse, want.lse);
        }
        hwy::SetSupportedTargetsForTest(0);
      }
    }
  }
}

// bfloat16 q, k, v over an 8-bit prior, every format and granularity, on every target: where the
// native bfloat16 kernels run (AVX512_BF16), the prior's codes are packed as bfloat16 (exact) and
// the scores and P take the scales, P rounded to bfloat16 once; elsewhere the float32 kernels
// read the dequantized prior. Against the reference on the dequantized prior, within what a
// bfloat16 implementation's roundings allow: each P to bfloat16 (2^-8 of it, so of the largest
// |V| at most) and the output (2^-8 of the largest); paged bitwise dense. Scales of 2^-20 and
// 2^20 included: the products stay exact in float32.
TEST(Kv8Prior, Bfloat16MatchesTheReferenceOnTheDequantizedPriorOnEveryTarget) {
  const Prefill call(DType::kBFloat16, 4);
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      for (double base : {0.01, std::ldexp(1.0, -20), std::ldexp(1.0, 20)}) {
        const Prior8 kp(kFormats[f], kD, static_cast<Granularity>(g), 21, base);
        const Prior8 vp(kFormats[(f + 1) % 3], kDv, static_cast<Granularity>((g + 1) % 3), 22,
                        base);
        const Options o = with_prior(call.options, kp, vp);
        const PagedPrior8 kpp(kp), vpp(vp);
        const Options paged = with_prior(call.options, kpp, vpp);
        // The reference reads the dequantized prior.
        const HostTensor kf = kp.dequantized(), vf = vp.dequantized();
        Options wide = call.options;
        wide.k_prior = kf.view();
        wide.v_prior = vf.view();
        reference::Result exact;
        ASSERT_TRUE(
            reference::attention(call.q.view(), call.k.view(), call.v.view(), wide, &exact).ok);
        double top = 0, top_v = 0;
        for (double x : exact.out) top = std::max(top, std::fabs(x));
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t x = 0; x < kDv; ++x) {
            for (int64_t j = 0; j < kSPrior; ++j)
              top_v = std::max(top_v, std::fabs(vf.get(h, j, x)));
            for (int64_t j = 0; j < call.v.shape()[1]; ++j) {
              top_v = std::max(top_v, std::fabs(call.v.get(h, j, x)));
            }
          }
        }
        for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
          hwy::SetSupportedTargetsForTest(target);
          SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", k " +
                       dtype_name(kp.format) + ", v " + dtype_name(vp.format) + ", granularities " +
                       std::to_string(g) + "/" + std::to_string((g + 1) % 3) + ", base " +
                       std::to_string(base));
          const Prefill::Result got = call.run(o), pages = call.run(paged);
          ASSERT_TRUE(got.status.ok) << got.status.message;
          ASSERT_TRUE(pages.status.ok) << pages.status.message;
          EXPECT_LE(got.relative_error(DType::kBFloat16, exact) * top,
                    std::ldexp(1.0, -8) * (top + top_v));
          EXPECT_EQ(pages.out, got.out);
          EXPECT_EQ(pages.lse, got.lse);
        }
        hwy::SetSupportedTargetsForTest(0);
      }
    }
  }
}

// Bad prior scales (and, paged, a bad table) are refused by name, with every buffer of the call
// (q, k, v, the priors' codes and scales, the table, out and lse) byte for byte as it was.
TEST(Kv8Prior, ScalesAreCheckedByName) {
  const Prefill call(DType::kFloat32, 5);
  Prior8 kp(DType::kInt8, kD, kPerHead, 1), vp(DType::kFloat8E5M2, kDv, kPerToken, 2);
  PagedPrior8 kpp(kp), vpp(vp);
  std::vector<float> bad;
  std::vector<float> slots(static_cast<size_t>(kKvHeads * (kSPrior - 1)), 1.0f);
  const HostTensor vf = vp.dequantized();
  // attention_cte refusing `o` for `argument`; lse_over: where lse points instead of its own
  // buffer (an alias of an input).
  const auto refuses = [&](const Options& o, const std::string& argument, const char* what,
                           void* lse_over = nullptr) {
    HostTensor out(DType::kFloat32, {kKvHeads * kGroup, kSq, kDv});
    std::vector<float> lse(static_cast<size_t>(kKvHeads * kGroup * kSq));
    Outputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse = MutableTensorView::contiguous(lse_over != nullptr ? lse_over : lse.data(),
                                                DType::kFloat32, {kKvHeads * kGroup, kSq});
    BufferSnapshot snap;
    snap.add("q", call.q.bytes()).add("k", call.k.bytes()).add("v", call.v.bytes());
    snap.add("k_prior", kp.codes).add("k_prior_scale", kp.scale);
    snap.add("v_prior", vp.codes).add("v_prior_scale", vp.scale);
    snap.add("k_prior pages", kpp.codes).add("k_prior_scale pages", kpp.scale);
    snap.add("v_prior pages", vpp.codes).add("v_prior_scale pages", vpp.scale);
    snap.add("prior_block_table", kpp.table).add("bad scale", bad).add("per-slot scale", slots);
    snap.add("float32 v_prior", vf.bytes());
    snap.add_output("out", outputs.out.data, out.bytes().size()).add_output("lse", lse);
    EXPECT_TRUE(refused_for(attention_cte(call.q.view(), call.k.view(), call.v.view(), outputs, o),
                            argument))
        << what;
    EXPECT_TRUE(snap.unchanged()) << what;
  };
  Options o = call.options;
  o.k_prior = kp.view();
  o.v_prior = vp.view();
  o.v_prior_scale = vp.scale_view();
  refuses(o, "k_prior_scale", "missing");
  bad = {0.5f, -1.0f};
  o.k_prior_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {2});
  refuses(o, "k_prior_scale", "a negative entry");
  bad = {0.5f, std::numeric_limits<float>::infinity()};
  refuses(o, "k_prior_scale", "an infinite entry");
  bad = {0.5f, 0.5f, 0.5f};
  o.k_prior_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {3});
  refuses(o, "k_prior_scale", "3 entries for 2 KV batches");
  // Per slot, but not the prior's shape without its channel axis.
  o.k_prior_scale = TensorView::contiguous(slots.data(), DType::kFloat32, {kKvHeads, kSPrior - 1});
  refuses(o, "k_prior_scale", "per slot, one slot short");
  o.k_prior_scale = kp.scale_view();
  ASSERT_TRUE(call.run(o).status.ok);
  o.k_prior_scale.dtype = DType::kFloat16;
  refuses(o, "k_prior_scale", "float16");
  o.k_prior_scale = kp.scale_view();
  // A scale beside a float prior.
  o.v_prior = vf.view();
  refuses(o, "v_prior_scale", "a scale beside a float32 prior");

  // Paged.
  const Options paged = with_prior(call.options, kpp, vpp);
  ASSERT_TRUE(call.run(paged).status.ok);
  o = paged;
  o.v_prior_scale = vp.scale_view();
  refuses(o, "v_prior_scale", "per slot in the dense prior's shape");
  o = paged;
  o.v_prior_scale.shape[2] = kBlock - 1;
  refuses(o, "v_prior_scale", "per slot of another block size");
  o = paged;
  bad = {0.5f, std::numeric_limits<float>::quiet_NaN()};
  o.k_prior_scale = TensorView::contiguous(bad.data(), DType::kFloat32, {2});
  refuses(o, "k_prior_scale", "per KV head with a NaN");
  o = paged;
  o.v_prior.shape[2] = kBlock - 1;
  refuses(o, "v_prior", "v_prior of another block size");
  const std::vector<int32_t> table = kpp.table;
  kpp.table[7] = static_cast<int32_t>(kPages);
  refuses(paged, "prior_block_table", "a page past num_blocks");
  kpp.table[7] = -1;
  refuses(paged, "prior_block_table", "a negative page");
  kpp.table = table;
  refuses(paged, "lse", "lse over a K page", kpp.codes.data());
}

}  // namespace
}  // namespace flashcte::test
