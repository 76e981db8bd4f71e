// 8-bit KV caches outside decode_attention: attention_cte over an 8-bit prior (prefix caching,
// chunked prefill), dense and paged, and flash_attn_with_kvcache / flash_attn_varlen_kvcache over
// 8-bit caches with the append quantizing the new tokens. Against the float64 reference on the
// dequantized cache (code x scale); a float32 prefill is bitwise the same call on the prior
// dequantized to float32 (the packer computes exactly that product), on every SIMD target.
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
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

const DType kFormats[] = {DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2};
enum Granularity { kPerTensor, kPerHead, kPerToken };

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

// ---------------------------------------------------------------------------------------------
// flash_attn_with_kvcache over 8-bit caches.

constexpr int64_t kBatch = 2, kHeads = 4, kCacheKvHeads = 2, kCacheLen = 48, kCd = 24;

struct Cache8 {
  DType format;
  Granularity granularity;
  std::vector<uint8_t> codes;  // (batch, cache_len, kv_heads, d)
  std::vector<float> scale;    // (1,), (kv_heads,) or (batch, cache_len, kv_heads)

  Cache8(DType f, Granularity g, uint32_t seed) : format(f), granularity(g) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(0.005, 0.02);
    const int64_t n = g == kPerTensor ? 1
                      : g == kPerHead ? kCacheKvHeads
                                      : kBatch * kCacheLen * kCacheKvHeads;
    for (int64_t i = 0; i < n; ++i) scale.push_back(static_cast<float>(u(rng)));
    std::normal_distribution<double> normal(0.0, format == DType::kInt8 ? 50.0 : 150.0);
    codes.resize(static_cast<size_t>(kBatch * kCacheLen * kCacheKvHeads * kCd));
    for (uint8_t& code : codes) code = kv8::encode(format, normal(rng));
  }
  float slot_scale(int64_t b, int64_t j, int64_t h) const {
    if (granularity == kPerToken) {
      return scale[static_cast<size_t>((b * kCacheLen + j) * kCacheKvHeads + h)];
    }
    return scale[granularity == kPerHead ? h : 0];
  }
  double value(int64_t b, int64_t j, int64_t h, int64_t x) const {
    return double{kv8::decode(
               format,
               codes[static_cast<size_t>(((b * kCacheLen + j) * kCacheKvHeads + h) * kCd + x)])} *
           slot_scale(b, j, h);
  }
  MutableTensorView view() {
    return MutableTensorView::contiguous(codes.data(), format,
                                         {kBatch, kCacheLen, kCacheKvHeads, kCd});
  }
  MutableTensorView scale_view() {
    if (granularity == kPerToken) {
      return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                           {kBatch, kCacheLen, kCacheKvHeads});
    }
    return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                         {static_cast<int64_t>(scale.size())});
  }
};

// q (batch, seqlen_q, heads, d) and new k, v (batch, seqlen_q, kv_heads, d), float32.
struct Step {
  int64_t seqlen;
  Tensor4 q, k, v;
  std::vector<int32_t> seqlens = {9, 17};
  Step(int64_t s, uint32_t seed)
      : seqlen(s),
        q(DType::kFloat32, {kBatch, s, kHeads, kCd}),
        k(DType::kFloat32, {kBatch, s, kCacheKvHeads, kCd}),
        v(DType::kFloat32, {kBatch, s, kCacheKvHeads, kCd}) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (Tensor4* t : {&q, &k, &v}) {
      const TensorView w = t->view();
      for (int64_t a = 0; a < w.shape[0]; ++a) {
        for (int64_t b = 0; b < w.shape[1]; ++b) {
          for (int64_t c = 0; c < w.shape[2]; ++c) {
            for (int64_t x = 0; x < w.shape[3]; ++x) t->set(a, b, c, x, u(rng));
          }
        }
      }
    }
  }
};

Status attend(Step& step, Cache8& kc, Cache8& vc, Tensor4& out, bool append) {
  KvCacheOptions o;
  if (append) {
    o.k = step.k.view();
    o.v = step.v.view();
  }
  o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
  o.k_scale = kc.scale_view();
  o.v_scale = vc.scale_view();
  o.causal = true;
  return flash_attn_with_kvcache(step.q.view(), kc.view(), vc.view(), out.mutable_view(), {}, o);
}

// A dense Cache8 as pages (num_blocks, kPageSlots, kv_heads, d) in shuffled order, the per-token
// scales in pages (num_blocks, kPageSlots, kv_heads); and back, to compare with the dense cache.
constexpr int64_t kPageSlots = 5, kSeqPages = (kCacheLen + kPageSlots - 1) / kPageSlots;

struct Paged8 {
  Cache8& dense;
  std::vector<uint8_t> codes;
  std::vector<float> scale;
  std::vector<int32_t> table;

  explicit Paged8(Cache8& c) : dense(c) {
    table.resize(static_cast<size_t>(kBatch * kSeqPages));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(17));
    codes.resize(static_cast<size_t>(kBatch * kSeqPages * kPageSlots * kCacheKvHeads * kCd));
    scale.resize(static_cast<size_t>(kBatch * kSeqPages * kPageSlots * kCacheKvHeads));
    copy(true);
  }
  // Each slot's codes (and per-token scale) between the dense cache and its page row.
  void copy(bool to_pages) {
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t j = 0; j < kCacheLen; ++j) {
        const int64_t row =
            table[static_cast<size_t>(b * kSeqPages + j / kPageSlots)] * kPageSlots +
            j % kPageSlots;
        for (int64_t h = 0; h < kCacheKvHeads; ++h) {
          uint8_t* page = &codes[static_cast<size_t>((row * kCacheKvHeads + h) * kCd)];
          uint8_t* slot =
              &dense.codes[static_cast<size_t>(((b * kCacheLen + j) * kCacheKvHeads + h) * kCd)];
          std::memcpy(to_pages ? page : slot, to_pages ? slot : page, kCd);
          if (dense.granularity != kPerToken) continue;
          float& ps = scale[static_cast<size_t>(row * kCacheKvHeads + h)];
          float& ds = dense.scale[static_cast<size_t>((b * kCacheLen + j) * kCacheKvHeads + h)];
          (to_pages ? ps : ds) = to_pages ? ds : ps;
        }
      }
    }
  }
  MutableTensorView view() {
    return MutableTensorView::contiguous(codes.data(), dense.format,
                                         {kBatch * kSeqPages, kPageSlots, kCacheKvHeads, kCd});
  }
  MutableTensorView scale_view() {
    if (dense.granularity != kPerToken) return dense.scale_view();
    return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                         {kBatch * kSeqPages, kPageSlots, kCacheKvHeads});
  }
};

Status attend_paged(Step& step, Paged8& kc, Paged8& vc, Tensor4& out) {
  KvCacheOptions o;
  o.k = step.k.view();
  o.v = step.v.view();
  o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
  o.block_table = TensorView::contiguous(kc.table.data(), DType::kInt32, {kBatch, kSeqPages});
  o.k_scale = kc.scale_view();
  o.v_scale = vc.scale_view();
  o.causal = true;
  return flash_attn_with_kvcache(step.q.view(), kc.view(), vc.view(), out.mutable_view(), {}, o);
}

// The append writes quantize_kv's codes and per-token scales; the attention over the cache then
// matches the reference on its dequantized values, on the decode kernel (3 new tokens) and on
// attention_cte (20 > kDecodeMaxQueries).
TEST(KvCacheKv8, AppendQuantizesAndTheQueriesAttendTheDequantizedCache) {
  for (int64_t seqlen : {3, 20}) {
    for (int f = 0; f < 3; ++f) {
      for (int g = 0; g < 3; ++g) {
        Step step(seqlen, 31);
        Cache8 kc(kFormats[f], static_cast<Granularity>(g), 41);
        Cache8 vc(kFormats[(f + 2) % 3], static_cast<Granularity>((g + 2) % 3), 42);
        SCOPED_TRACE("seqlen_new " + std::to_string(seqlen) + ", k " + dtype_name(kc.format) +
                     ", v " + dtype_name(vc.format) + ", granularities " + std::to_string(g));
        // The oracle of the append: quantize_kv on each sequence's new rows, into the slots.
        Cache8 kw = kc, vw = vc;
        for (auto [cache, src] : {std::pair{&kw, &step.k}, std::pair{&vw, &step.v}}) {
          for (int64_t b = 0; b < kBatch; ++b) {
            const int64_t slot = step.seqlens[static_cast<size_t>(b)];
            TensorView rows = src->view();
            rows.rank = 3;
            rows.data = static_cast<const float*>(rows.data) + b * rows.strides[0];
            rows.shape = {seqlen, kCacheKvHeads, kCd, 0};
            rows.strides = {rows.strides[1], rows.strides[2], rows.strides[3], 0};
            MutableTensorView dst = cache->view();
            dst.rank = 3;
            dst.data = static_cast<uint8_t*>(dst.data) + (b * kCacheLen + slot) * dst.strides[1];
            dst.shape = {seqlen, kCacheKvHeads, kCd, 0};
            dst.strides = {dst.strides[1], dst.strides[2], dst.strides[3], 0};
            MutableTensorView scale = cache->scale_view();
            if (cache->granularity == kPerToken) {
              scale.rank = 2;
              scale.data = static_cast<float*>(scale.data) + (b * kCacheLen + slot) * kCacheKvHeads;
              scale.shape = {seqlen, kCacheKvHeads, 0, 0};
              scale.strides = {kCacheKvHeads, 1, 0, 0};
            }
            ASSERT_TRUE(quantize_kv(rows, dst, scale).ok);
          }
        }
        // The same caches in pages (copied before the dense call appends).
        Cache8 kpd = kc, vpd = vc;
        Paged8 kp(kpd), vp(vpd);
        vp.table = kp.table;
        vp.copy(true);
        Tensor4 out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
        const Status s = attend(step, kc, vc, out, true);
        ASSERT_TRUE(s.ok) << s.message;
        EXPECT_EQ(kc.codes, kw.codes);
        EXPECT_EQ(vc.codes, vw.codes);
        EXPECT_EQ(kc.scale, kw.scale);
        EXPECT_EQ(vc.scale, vw.scale);
        // Paged: bitwise the dense call, the same codes and scales written into the pages.
        Tensor4 paged_out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
        const Status ps = attend_paged(step, kp, vp, paged_out);
        ASSERT_TRUE(ps.ok) << ps.message;
        EXPECT_EQ(paged_out.bytes(), out.bytes());
        kp.copy(false);
        vp.copy(false);
        EXPECT_EQ(kpd.codes, kc.codes);
        EXPECT_EQ(vpd.codes, vc.codes);
        EXPECT_EQ(kpd.scale, kc.scale);
        EXPECT_EQ(vpd.scale, vc.scale);
        // The reference per sequence on the dequantized cache, bottom-right causal.
        for (int64_t b = 0; b < kBatch; ++b) {
          const int64_t seqlen_k = step.seqlens[static_cast<size_t>(b)] + seqlen;
          HostTensor q(DType::kFloat32, {kHeads, seqlen, kCd});
          HostTensor k(DType::kFloat32, {kCacheKvHeads, seqlen_k, kCd});
          HostTensor v(DType::kFloat32, {kCacheKvHeads, seqlen_k, kCd});
          for (int64_t h = 0; h < kHeads; ++h) {
            for (int64_t i = 0; i < seqlen; ++i) {
              for (int64_t x = 0; x < kCd; ++x) q.set(h, i, x, step.q.get(b, i, h, x));
            }
          }
          for (int64_t h = 0; h < kCacheKvHeads; ++h) {
            for (int64_t j = 0; j < seqlen_k; ++j) {
              for (int64_t x = 0; x < kCd; ++x) {
                k.set(h, j, x, kc.value(b, j, h, x));
                v.set(h, j, x, vc.value(b, j, h, x));
              }
            }
          }
          Options o;
          o.tp_k = true;
          o.bottom_right = true;
          o.scale = static_cast<float>(1.0 / std::sqrt(double{kCd}));
          reference::Result exact;
          ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &exact).ok);
          for (int64_t h = 0; h < kHeads; ++h) {
            for (int64_t i = 0; i < seqlen; ++i) {
              for (int64_t x = 0; x < kCd; ++x) {
                ASSERT_NEAR(out.get(b, i, h, x), exact.out_at(h, i, x),
                            4e-6 + 1e-5 * std::fabs(exact.out_at(h, i, x)))
                    << b << " " << h << " " << i << " " << x;
              }
            }
          }
        }
      }
    }
  }
}

// A refused call leaves every buffer of the call byte for byte as it was: the caches, their
// scales, q, the new k and v, the lengths, out and lse. A NaN for an int8 cache in sequence 1's
// last new token (found before anything is written: the K rows and sequence 0 would go first), a
// bad scale, scales sharing memory with each other or with a cache, lse over a scale, lengths past
// the cache, a scale beside a float cache.
TEST(KvCacheKv8, RefusedCallsLeaveCachesAndScalesAlone) {
  for (int64_t seqlen : {3, 20}) {
    SCOPED_TRACE("seqlen_new " + std::to_string(seqlen));
    Step step(seqlen, 51);
    Cache8 kc(DType::kFloat8E4M3, kPerToken, 61), vc(DType::kInt8, kPerToken, 62);
    Cache8 vh(DType::kInt8, kPerHead, 63), vs(DType::kInt8, kPerToken, 64);
    Tensor4 float_cache(DType::kFloat32, {kBatch, kCacheLen, kCacheKvHeads, kCd});
    Tensor4 out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
    std::vector<float> lse(static_cast<size_t>(kBatch * kHeads * seqlen));
    const MutableTensorView lse_view =
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, seqlen});
    // The append of step's k and v into k_cache / v_cache with their scales.
    const auto append_into = [&](Cache8& k_cache, Cache8& v_cache) {
      KvCacheOptions o;
      o.k = step.k.view();
      o.v = step.v.view();
      o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
      o.k_scale = k_cache.scale_view();
      o.v_scale = v_cache.scale_view();
      o.causal = true;
      return o;
    };
    const auto refuses = [&](const MutableTensorView& k_cache, const MutableTensorView& v_cache,
                             const KvCacheOptions& o, const MutableTensorView& lse_out,
                             const std::string& argument, const char* what) {
      BufferSnapshot snap;
      snap.add("q", step.q.bytes()).add("k", step.k.bytes()).add("v", step.v.bytes());
      snap.add("cache_seqlens", step.seqlens);
      for (const auto& [name, cache] : {std::pair{"kc", &kc}, std::pair{"vc", &vc},
                                        std::pair{"vh", &vh}, std::pair{"vs", &vs}}) {
        snap.add(std::string(name) + " codes", cache->codes);
        snap.add(std::string(name) + " scales", cache->scale);
      }
      snap.add("float32 cache", float_cache.bytes());
      snap.add_output("out", out.bytes()).add_output("lse", lse);
      EXPECT_TRUE(refused_for(
          flash_attn_with_kvcache(step.q.view(), k_cache, v_cache, out.mutable_view(), lse_out, o),
          argument))
          << what;
      EXPECT_TRUE(snap.unchanged()) << what;
    };
    {
      Cache8 k_copy = kc, v_copy = vc;
      const Status s =
          flash_attn_with_kvcache(step.q.view(), k_copy.view(), v_copy.view(), out.mutable_view(),
                                  lse_view, append_into(k_copy, v_copy));
      ASSERT_TRUE(s.ok) << s.message;
    }
    step.v.set(1, seqlen - 1, 1, 5, std::numeric_limits<double>::quiet_NaN());
    refuses(kc.view(), vc.view(), append_into(kc, vc), lse_view, "v",
            "a NaN in sequence 1's last new v row, int8 cache");
    step.v.set(1, seqlen - 1, 1, 5, 0.25);
    vh.scale[1] = 0;
    refuses(kc.view(), vh.view(), append_into(kc, vh), lse_view, "v_scale", "a per-head scale 0");
    vh.scale[1] = std::numeric_limits<float>::quiet_NaN();
    refuses(kc.view(), vh.view(), append_into(kc, vh), lse_view, "v_scale", "a per-head scale NaN");
    // Per-token K and V scales in one tensor: the append would write each over the other.
    KvCacheOptions o = append_into(kc, vs);
    o.v_scale = kc.scale_view();
    refuses(kc.view(), vs.view(), o, lse_view, "v_scale", "k_scale and v_scale in one tensor");
    // Per-token K scales over V's codes.
    o = append_into(kc, vc);
    o.k_scale.data = vc.codes.data();
    refuses(kc.view(), vc.view(), o, lse_view, "k_scale", "k_scale over v_cache's codes");
    // lse over the per-token K scales the append writes.
    MutableTensorView lse_over = lse_view;
    lse_over.data = kc.scale.data();
    refuses(kc.view(), vc.view(), append_into(kc, vc), lse_over, "lse", "lse over k_scale");
    // Sequence 1's new tokens past the cache.
    step.seqlens[1] = static_cast<int32_t>(kCacheLen - seqlen + 1);
    refuses(kc.view(), vc.view(), append_into(kc, vc), lse_view, "cache_seqlens",
            "sequence 1 past the cache");
    step.seqlens[1] = 17;
    // Without the scale.
    o = KvCacheOptions{};
    o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
    o.v_scale = vc.scale_view();
    refuses(kc.view(), vc.view(), o, lse_view, "k_scale", "k_scale missing");
    // A scale beside a float cache.
    o.k_scale = kc.scale_view();
    refuses(kc.view(), float_cache.mutable_view(), o, lse_view, "v_scale",
            "a scale beside a float32 cache");
  }
}

// flash_attn_with_kvcache appending into paged 8-bit caches (pages of 5 slots, shuffled), with
// every buffer of the call in the snapshot: the pages' codes and scales, the table, q, the new k
// and v, the lengths, out and lse.
struct PagedAppend8 {
  Step step;
  Cache8 kd, vd;  // the pages' contents, dense (and per-head / per-tensor scales)
  Paged8 kp, vp;
  Tensor4 out;
  std::vector<float> lse;
  KvCacheOptions o;
  MutableTensorView k_cache, v_cache, lse_view;

  PagedAppend8(int64_t seqlen, DType k_format, Granularity k_granularity, DType v_format,
               Granularity v_granularity)
      : step(seqlen, 111),
        kd(k_format, k_granularity, 112),
        vd(v_format, v_granularity, 113),
        kp(kd),
        vp(vd),
        out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd}),
        lse(static_cast<size_t>(kBatch * kHeads * seqlen)) {
    vp.table = kp.table;
    vp.copy(true);
    o.k = step.k.view();
    o.v = step.v.view();
    o.cache_seqlens = TensorView::contiguous(step.seqlens.data(), DType::kInt32, {kBatch});
    o.block_table = TensorView::contiguous(kp.table.data(), DType::kInt32, {kBatch, kSeqPages});
    o.k_scale = kp.scale_view();
    o.v_scale = vp.scale_view();
    o.causal = true;
    k_cache = kp.view();
    v_cache = vp.view();
    lse_view = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, seqlen});
  }
  Status run() {
    return flash_attn_with_kvcache(step.q.view(), k_cache, v_cache, out.mutable_view(), lse_view,
                                   o);
  }
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("k_cache pages", kp.codes).add("k_scale pages", kp.scale);
    snap.add("v_cache pages", vp.codes).add("v_scale pages", vp.scale);
    snap.add("k_scale", kd.scale).add("v_scale", vd.scale);
    snap.add("dense k_cache", kd.codes).add("dense v_cache", vd.codes);
    snap.add("block_table", kp.table).add("cache_seqlens", step.seqlens);
    snap.add("q", step.q.bytes()).add("k", step.k.bytes()).add("v", step.v.bytes());
    snap.add_output("out", out.bytes()).add_output("lse", lse);
    return snap;
  }
};

struct BadAppend8 {
  const char* what;
  const char* argument;
  void (*breaks)(PagedAppend8&);
};

// Sequence 1 holds 17 tokens: its new ones go to slots 17, 18, ... of its pages 3, 4, ...
const BadAppend8 kBadAppend8[] = {
    {"a NaN in sequence 1's last new v row (int8 V)", "v",
     [](PagedAppend8& c) {
       c.step.v.set(1, c.step.seqlen - 1, 1, 5, std::numeric_limits<double>::quiet_NaN());
     }},
    {"a page sequence 1 writes past num_blocks", "block_table",
     [](PagedAppend8& c) { c.kp.table[kSeqPages + 3] = static_cast<int32_t>(kBatch * kSeqPages); }},
    {"a negative page sequence 1 writes", "block_table",
     [](PagedAppend8& c) { c.kp.table[kSeqPages + 3] = -1; }},
    {"a page sequence 1 writes that sequence 0 reads", "block_table",
     [](PagedAppend8& c) { c.kp.table[kSeqPages + 3] = c.kp.table[0]; }},
    {"sequence 1's new tokens past its pages", "cache_seqlens",
     [](PagedAppend8& c) {
       c.step.seqlens[1] = static_cast<int32_t>(kSeqPages * kPageSlots - c.step.seqlen + 1);
     }},
    {"per-token k_scale of another page_block_size", "k_scale",
     [](PagedAppend8& c) { c.o.k_scale.shape[1] = kPageSlots - 1; }},
    {"per-token k_scale in the dense cache's shape", "k_scale",
     [](PagedAppend8& c) { c.o.k_scale = c.kd.scale_view(); }},
    {"k_scale bfloat16", "k_scale", [](PagedAppend8& c) { c.o.k_scale.dtype = DType::kBFloat16; }},
    {"v_scale per head with a NaN", "v_scale",
     [](PagedAppend8& c) { c.vd.scale[1] = std::numeric_limits<float>::quiet_NaN(); }},
    {"v_scale per head with an entry 0", "v_scale", [](PagedAppend8& c) { c.vd.scale[0] = 0.0f; }},
    {"v_scale missing", "v_scale", [](PagedAppend8& c) { c.o.v_scale = {}; }},
    {"v_cache of another page_block_size", "v_cache",
     [](PagedAppend8& c) { c.v_cache.shape[1] = kPageSlots - 1; }},
    {"per-token k_scale over v_cache's pages", "k_scale",
     [](PagedAppend8& c) { c.o.k_scale.data = c.vp.codes.data(); }},
    {"lse over a K page", "lse", [](PagedAppend8& c) { c.lse_view.data = c.kp.codes.data(); }},
    {"lse over the per-token k_scale", "lse",
     [](PagedAppend8& c) { c.lse_view.data = c.kp.scale.data(); }},
    {"cache_batch_idx with a paged cache", "cache_batch_idx",
     [](PagedAppend8& c) { c.o.cache_batch_idx = c.o.cache_seqlens; }},
};

// Refused appends into paged 8-bit caches write nothing: K e4m3 with per-token scales in the
// pages, V int8 with per-head scales, on the decode kernel (3 new tokens) and on attention_cte
// (20).
TEST(KvCacheKv8, PagedAppendRefusalsWriteNothing) {
  for (int64_t seqlen : {3, 20}) {
    SCOPED_TRACE("seqlen_new " + std::to_string(seqlen));
    {
      PagedAppend8 valid(seqlen, DType::kFloat8E4M3, kPerToken, DType::kInt8, kPerHead);
      const Status s = valid.run();
      ASSERT_TRUE(s.ok) << s.message;
    }
    for (const BadAppend8& bad : kBadAppend8) {
      PagedAppend8 call(seqlen, DType::kFloat8E4M3, kPerToken, DType::kInt8, kPerHead);
      bad.breaks(call);
      const BufferSnapshot snap = call.snapshot();
      EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
      EXPECT_TRUE(snap.unchanged()) << bad.what;
    }
  }
}

// The same with the formats the other way round: K int8 with per-head scales, V e5m2 with
// per-token scales in the pages. A NaN in sequence 1's last new k row is refused with the V pages
// and their scales (written after K's) untouched too; K and V per-token scales in one tensor are
// refused.
TEST(KvCacheKv8, PagedAppendRefusalsWriteNothingInt8Keys) {
  for (int64_t seqlen : {3, 20}) {
    SCOPED_TRACE("seqlen_new " + std::to_string(seqlen));
    const auto check = [&](void (*breaks)(PagedAppend8&), const char* argument, const char* what) {
      PagedAppend8 call(seqlen, DType::kInt8, kPerHead, DType::kFloat8E5M2, kPerToken);
      breaks(call);
      const BufferSnapshot snap = call.snapshot();
      EXPECT_TRUE(refused_for(call.run(), argument)) << what;
      EXPECT_TRUE(snap.unchanged()) << what;
    };
    check(
        [](PagedAppend8& c) {
          c.step.k.set(1, c.step.seqlen - 1, 1, 7, std::numeric_limits<double>::quiet_NaN());
        },
        "k", "a NaN in sequence 1's last new k row (int8 K)");
    check(
        [](PagedAppend8& c) {
          c.step.k.set(0, 0, 0, 0, std::numeric_limits<double>::quiet_NaN());
          c.kp.table[kSeqPages + 3] = c.kp.table[1];
        },
        "block_table", "a NaN and a shared page: the page is found first");
    check([](PagedAppend8& c) { c.kd.scale[1] = -1.0f; }, "k_scale", "a negative k_scale");
    check(
        [](PagedAppend8& c) {
          c.step.seqlens[1] = static_cast<int32_t>(kSeqPages * kPageSlots - c.step.seqlen + 1);
        },
        "cache_seqlens", "sequence 1's new tokens past its pages");
  }
  // Both per token, in one tensor.
  PagedAppend8 call(3, DType::kInt8, kPerToken, DType::kFloat8E5M2, kPerToken);
  call.o.v_scale = call.o.k_scale;
  const BufferSnapshot snap = call.snapshot();
  EXPECT_TRUE(refused_for(call.run(), "v_scale"));
  EXPECT_TRUE(snap.unchanged());
}

// flash_attn_varlen_kvcache over paged 8-bit caches (K e5m2 with per-token scales in the pages,
// V int8 with per-head scales; a decode sequence and a prefill chunk): bad pages, lengths, scales
// and outputs over the caches are refused by name with every buffer of the call as it was.
struct PagedVarlen8 {
  Cache8 kd{DType::kFloat8E5M2, kPerToken, 121}, vd{DType::kInt8, kPerHead, 122};
  Paged8 kp{kd}, vp{vd};
  std::vector<int32_t> cu = {0, 2, 21}, used = {30, 40};
  HostTensor q{DType::kFloat32, {21, kHeads, kCd}};
  HostTensor out{DType::kFloat32, {21, kHeads, kCd}};
  std::vector<float> lse = std::vector<float>(static_cast<size_t>(kHeads * 21));
  VarlenKvCacheOptions o;
  TensorView k_cache, v_cache;
  MutableTensorView lse_view;

  PagedVarlen8() {
    vp.table = kp.table;
    vp.copy(true);
    std::mt19937 rng(123);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t i = 0; i < 21; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kCd; ++x) q.set(i, h, x, u(rng));
      }
    }
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {3});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {kBatch});
    o.block_table = TensorView::contiguous(kp.table.data(), DType::kInt32, {kBatch, kSeqPages});
    o.k_scale = as_input(kp.scale_view());
    o.v_scale = as_input(vp.scale_view());
    o.causal = true;
    k_cache = as_input(kp.view());
    v_cache = as_input(vp.view());
    lse_view = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, 21});
  }
  static TensorView as_input(const MutableTensorView& m) {
    return {m.data, m.dtype, m.rank, m.shape, m.strides};
  }
  Status run() {
    return flash_attn_varlen_kvcache(q.view(), k_cache, v_cache, out.mutable_view(), lse_view, o);
  }
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("k_cache pages", kp.codes).add("k_scale pages", kp.scale);
    snap.add("v_cache pages", vp.codes).add("v_scale", vd.scale);
    snap.add("dense k_cache", kd.codes).add("dense k_scale", kd.scale);
    snap.add("dense v_cache", vd.codes).add("block_table", kp.table);
    snap.add("cu_seqlens_q", cu).add("seqused_k", used).add("q", q.bytes());
    snap.add_output("out", out.mutable_view().data, out.bytes().size()).add_output("lse", lse);
    return snap;
  }
};

struct BadVarlen8 {
  const char* what;
  const char* argument;
  void (*breaks)(PagedVarlen8&);
};

// Sequence 1 uses 40 slots: its pages 0 to 7.
const BadVarlen8 kBadVarlen8[] = {
    {"a page of sequence 1 past num_blocks", "block_table",
     [](PagedVarlen8& c) { c.kp.table[kSeqPages + 7] = static_cast<int32_t>(kBatch * kSeqPages); }},
    {"a negative page of sequence 1", "block_table",
     [](PagedVarlen8& c) { c.kp.table[kSeqPages + 2] = -1; }},
    {"seqused_k of sequence 1 past its pages", "seqused_k",
     [](PagedVarlen8& c) { c.used[1] = static_cast<int32_t>(kSeqPages * kPageSlots + 1); }},
    {"per-token k_scale in the dense cache's shape", "k_scale",
     [](PagedVarlen8& c) { c.o.k_scale = PagedVarlen8::as_input(c.kd.scale_view()); }},
    {"per-token k_scale of another page_block_size", "k_scale",
     [](PagedVarlen8& c) { c.o.k_scale.shape[1] = kPageSlots - 1; }},
    {"k_scale float16", "k_scale", [](PagedVarlen8& c) { c.o.k_scale.dtype = DType::kFloat16; }},
    {"v_scale per head with a NaN", "v_scale",
     [](PagedVarlen8& c) { c.vd.scale[1] = std::numeric_limits<float>::quiet_NaN(); }},
    {"v_scale missing", "v_scale", [](PagedVarlen8& c) { c.o.v_scale = {}; }},
    {"v_cache of another page_block_size", "v_cache",
     [](PagedVarlen8& c) { c.v_cache.shape[1] = kPageSlots - 1; }},
    {"lse over a K page", "lse", [](PagedVarlen8& c) { c.lse_view.data = c.kp.codes.data(); }},
    {"lse over the per-token k_scale", "lse",
     [](PagedVarlen8& c) { c.lse_view.data = c.kp.scale.data(); }},
};

TEST(VarlenKv8, PagedRefusalsWriteNothing) {
  {
    PagedVarlen8 valid;
    const Status s = valid.run();
    ASSERT_TRUE(s.ok) << s.message;
  }
  for (const BadVarlen8& bad : kBadVarlen8) {
    PagedVarlen8 call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

// e4m3 saturates an appended value beyond 448 x scale; e5m2 keeps an Inf, which reaches only
// the rows that attend its slot (as a float cache's would).
TEST(KvCacheKv8, AppendSaturatesAndAnInfReachesOnlyTheRowsThatSeeIt) {
  Step step(3, 71);
  Cache8 kc(DType::kFloat8E4M3, kPerHead, 81), vc(DType::kFloat8E5M2, kPerHead, 82);
  step.k.set(0, 0, 1, 3, 1e6);
  step.v.set(1, 2, 0, 7, std::numeric_limits<double>::infinity());
  Tensor4 out(DType::kFloat32, {kBatch, 3, kHeads, kCd});
  ASSERT_TRUE(attend(step, kc, vc, out, true).ok);
  const size_t k_at = static_cast<size_t>(((0 * kCacheLen + 9) * kCacheKvHeads + 1) * kCd + 3);
  EXPECT_EQ(kv8::decode(kc.format, kc.codes[k_at]), 448.0f);
  const size_t v_at = static_cast<size_t>(((1 * kCacheLen + 19) * kCacheKvHeads + 0) * kCd + 7);
  EXPECT_TRUE(std::isinf(kv8::decode(vc.format, vc.codes[v_at])));
  // Sequence 1's new token 2 sits at slot 19: only its own query row (causal) sees it, and only
  // the query heads of KV head 0 (heads 0 and 1).
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        const bool sees = b == 1 && i == 2 && h / (kHeads / kCacheKvHeads) == 0;
        for (int64_t x = 0; x < kCd; ++x) {
          const double y = out.get(b, i, h, x);
          if (!sees) {
            ASSERT_TRUE(std::isfinite(y)) << b << " " << i << " " << h << " " << x;
          } else if (x == 7) {
            EXPECT_FALSE(std::isfinite(y));
          }
        }
      }
    }
  }
}

// NaN and Inf in q against an 8-bit cache reach only their own rows.
TEST(KvCacheKv8, NonFiniteQueriesStayInTheirRows) {
  for (int64_t seqlen : {3, 20}) {
    Step step(seqlen, 91);
    Cache8 kc(DType::kInt8, kPerToken, 92), vc(DType::kFloat8E4M3, kPerTensor, 93);
    step.q.set(0, 1, 2, 0, std::numeric_limits<double>::quiet_NaN());
    step.q.set(1, 0, 3, 4, std::numeric_limits<double>::infinity());
    Tensor4 out(DType::kFloat32, {kBatch, seqlen, kHeads, kCd});
    ASSERT_TRUE(attend(step, kc, vc, out, false).ok);
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t i = 0; i < seqlen; ++i) {
        for (int64_t h = 0; h < kHeads; ++h) {
          const bool poisoned = (b == 0 && i == 1 && h == 2) || (b == 1 && i == 0 && h == 3);
          for (int64_t x = 0; x < kCd; ++x) {
            if (!poisoned) {
              ASSERT_TRUE(std::isfinite(out.get(b, i, h, x))) << b << i << h << x;
            }
          }
        }
      }
    }
  }
}

// flash_attn_varlen_kvcache over the same 8-bit caches: each sequence bitwise its
// flash_attn_with_kvcache call (a decode sequence and a prefill chunk in one batch).
TEST(KvCacheKv8, VarlenIsBitwiseThePerSequenceCalls) {
  Cache8 kc(DType::kFloat8E5M2, kPerToken, 101), vc(DType::kInt8, kPerHead, 102);
  const std::vector<int64_t> lens = {2, 19};
  const std::vector<int32_t> cu = {0, 2, 21}, used = {30, 40};
  HostTensor q(DType::kFloat32, {21, kHeads, kCd});
  std::mt19937 rng(103);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < 21; ++i) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t x = 0; x < kCd; ++x) q.set(i, h, x, u(rng));
    }
  }
  HostTensor out(DType::kFloat32, {21, kHeads, kCd});
  VarlenKvCacheOptions o;
  o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {3});
  o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {2});
  const MutableTensorView ks = kc.scale_view(), vs = vc.scale_view();
  o.k_scale = {ks.data, ks.dtype, ks.rank, ks.shape, ks.strides};
  o.v_scale = {vs.data, vs.dtype, vs.rank, vs.shape, vs.strides};
  o.causal = true;
  const MutableTensorView kv = kc.view(), vv = vc.view();
  const Status s = flash_attn_varlen_kvcache(q.view(), {kv.data, kv.dtype, 4, kv.shape, kv.strides},
                                             {vv.data, vv.dtype, 4, vv.shape, vv.strides},
                                             out.mutable_view(), {}, o);
  ASSERT_TRUE(s.ok) << s.message;
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t n = lens[static_cast<size_t>(b)];
    Tensor4 qb(DType::kFloat32, {kBatch, n, kHeads, kCd}),
        ob(DType::kFloat32, {kBatch, n, kHeads, kCd});
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kCd; ++x) qb.set(b, i, h, x, q.get(cu[b] + i, h, x));
      }
    }
    // Both sequences' cache lengths as they were before the queries' own tokens.
    std::vector<int32_t> seqlens = {used[0], used[1]};
    KvCacheOptions ko;
    ko.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {kBatch});
    ko.k_scale = kc.scale_view();
    ko.v_scale = vc.scale_view();
    ko.causal = true;
    ASSERT_TRUE(
        flash_attn_with_kvcache(qb.view(), kc.view(), vc.view(), ob.mutable_view(), {}, ko).ok);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kCd; ++x) {
          ASSERT_EQ(ob.get(b, i, h, x), out.get(cu[b] + i, h, x)) << b << " " << i << " " << h;
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashcte::test
