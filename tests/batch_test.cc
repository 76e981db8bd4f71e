// attention_cte on rank-4 views (src/dispatch/batch.h): a batch of independent problems in one
// call. Each entry must be bitwise what the rank-3 call on that entry computes, and within the
// suite's tolerance of the float64 reference; a refused call writes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/reference/reference.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr int64_t kBatch = 3, kHeads = 4, kKvHeads = 2, kSq = 37, kSkv = 45, kD = 24, kDv = 20;

// Entry b of a rank-4 view along axis 0, as the rank-3 view the single call takes.
template <class View>
View entry(const View& v, int64_t b) {
  View r = v;
  r.rank = v.rank - 1;
  auto* base = static_cast<const unsigned char*>(v.data) + b * v.strides[0] * dtype_size(v.dtype);
  r.data = const_cast<unsigned char*>(base);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  for (int i = 0; i + 1 < kMaxRank; ++i) {
    r.shape[i] = i < r.rank ? v.shape[i + 1] : 0;
    r.strides[i] = i < r.rank ? v.strides[i + 1] : 0;
  }
  r.shape[kMaxRank - 1] = 0;
  r.strides[kMaxRank - 1] = 0;
  return r;
}

uint32_t bits(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// FlashAttention's layout, (batch, seqlen, heads, d), as the rank-4 (batch, heads, seqlen, d).
Tensor4 random_fa(DType dtype, int64_t seqlen, int64_t heads, int64_t d, uint32_t seed) {
  Tensor4 t(dtype, {kBatch, seqlen, heads, d});
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t s = 0; s < seqlen; ++s) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t x = 0; x < d; ++x) t.set(b, s, h, x, u(rng));
      }
    }
  }
  return t;
}

TensorView f32(const std::vector<float>& data, std::vector<int64_t> shape,
               std::vector<int64_t> strides) {
  TensorView t;
  t.data = data.data();
  t.dtype = DType::kFloat32;
  t.rank = static_cast<int>(shape.size());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

struct Batch {
  Tensor4 q, k, v, out, out_single;
  std::vector<float> lse, lse_single, slopes, bias, sink;
  std::vector<int32_t> lo, hi;
  Options options;
  Outputs outputs;

  explicit Batch(DType dtype)
      : q(random_fa(dtype, kSq, kHeads, kD, 1)),
        k(random_fa(dtype, kSkv, kKvHeads, kD, 2)),
        v(random_fa(dtype, kSkv, kKvHeads, kDv, 3)),
        out(dtype, {kBatch, kSq, kHeads, kDv}),
        out_single(dtype, {kBatch, kSq, kHeads, kDv}),
        lse(kBatch * kHeads * kSq, 7.0f),
        lse_single(kBatch * kHeads * kSq, 7.0f) {
    std::mt19937 rng(4);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int64_t i = 0; i < kBatch * kHeads; ++i) slopes.push_back(0.05f + 0.3f * u(rng));
    // One bias row per sequence, shared by its heads (stride 0), some keys masked.
    for (int64_t i = 0; i < kBatch * kSkv; ++i) {
      bias.push_back(i % 11 == 5 ? -INFINITY : u(rng) - 0.5f);
    }
    sink = {1.5f, -0.5f, 0.25f, 2.0f};  // one per head, shared by the batch (stride 0)
    // Per-sequence packing bounds: sequence b's rows see keys [b * 3, kSkv - b * 5).
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t i = 0; i < kSq; ++i) {
        lo.push_back(static_cast<int32_t>(b * 3));
        hi.push_back(static_cast<int32_t>(kSkv - b * 5));
      }
    }
    options.scale = 0.3f;
    options.causal_mask = true;
    options.bottom_right = true;
    options.tp_k = true;
    options.softcap = 4.0f;
    options.alibi_slopes = f32(slopes, {kBatch, kHeads}, {kHeads, 1});
    options.key_bias = f32(bias, {kBatch, kHeads, kSkv}, {kSkv, 0, 1});
    options.sink = f32(sink, {kBatch, kHeads}, {0, 1});
    options.bound_min = TensorView{lo.data(), DType::kInt32, 2, {kBatch, kSq}, {kSq, 1}};
    options.bound_max = TensorView{hi.data(), DType::kInt32, 2, {kBatch, kSq}, {kSq, 1}};
    options.num_threads = 2;
    outputs.out = swapped(out);
    outputs.lse = lse_view(lse);
  }
  static MutableTensorView swapped(Tensor4& t) {
    MutableTensorView m = t.mutable_view();
    std::swap(m.shape[1], m.shape[2]);
    std::swap(m.strides[1], m.strides[2]);
    return m;
  }
  static MutableTensorView lse_view(std::vector<float>& l) {
    return {l.data(), DType::kFloat32, 3, {kBatch, kHeads, kSq}, {kHeads * kSq, kSq, 1}};
  }
  // The rank-4 call's arguments of entry b, as the rank-3 call takes them.
  Options entry_options(int64_t b) const {
    Options o = options;
    o.alibi_slopes = entry(options.alibi_slopes, b);
    o.key_bias = entry(options.key_bias, b);
    o.sink = entry(options.sink, b);
    o.bound_min = entry(options.bound_min, b);
    o.bound_max = entry(options.bound_max, b);
    return o;
  }
};

TEST(RankFourBatch, EachEntryIsTheRankThreeCallBitwiseAndTheReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_name(dtype));
    Batch t(dtype);
    const TensorView q = t.q.view_swapping_axes_1_2(), k = t.k.view_swapping_axes_1_2();
    const TensorView v = t.v.view_swapping_axes_1_2();
    ASSERT_TRUE(attention_cte(q, k, v, t.outputs, t.options).ok);
    for (int64_t b = 0; b < kBatch; ++b) {
      SCOPED_TRACE("entry " + std::to_string(b));
      const Options o = t.entry_options(b);
      Outputs single;
      single.out = entry(Batch::swapped(t.out_single), b);
      single.lse = entry(Batch::lse_view(t.lse_single), b);
      const Status s = attention_cte(entry(q, b), entry(k, b), entry(v, b), single, o);
      ASSERT_TRUE(s.ok) << s.message;
      reference::Result ref;
      ASSERT_TRUE(reference::attention(entry(q, b), entry(k, b), entry(v, b), o, &ref).ok);
      const double tol = dtype == DType::kFloat32 ? 2e-5 : dtype == DType::kFloat16 ? 4e-3 : 3e-2;
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < kSq; ++i) {
          const size_t l = static_cast<size_t>((b * kHeads + h) * kSq + i);
          ASSERT_EQ(bits(t.lse[l]), bits(t.lse_single[l])) << h << " " << i;
          const double want = ref.lse[static_cast<size_t>(h * kSq + i)];
          if (std::isinf(want)) {
            EXPECT_EQ(t.lse[l], want);
          } else {
            EXPECT_NEAR(t.lse[l], want, tol * 4);
          }
          for (int64_t c = 0; c < kDv; ++c) {
            const double got = t.out.get(b, i, h, c);
            ASSERT_EQ(got, t.out_single.get(b, i, h, c)) << h << " " << i << " " << c;
            EXPECT_NEAR(got, ref.out_at(h, i, c), tol) << h << " " << i << " " << c;
          }
        }
      }
    }
  }
}

TEST(RankFourBatch, PriorsPerEntryDenseAndFromOneSharedPool) {
  // Dense priors (batch, kv_heads, S_prior, d) and the same rows as pages of one pool, each
  // entry with its own block table: both bitwise the rank-3 call of each entry, the dense one
  // within tolerance of the reference (which reads dense priors) and the paged one bitwise the
  // dense one.
  const int64_t prior = 19, block = 4, pages_per = (prior + block - 1) / block;
  const DType dtype = DType::kBFloat16;
  Batch t(dtype);
  Tensor4 kp(dtype, {kBatch, kKvHeads, prior, kD}), vp(dtype, {kBatch, kKvHeads, prior, kDv});
  const int64_t pool_pages = kBatch * pages_per + 2;
  Tensor4 kpool(dtype, {pool_pages, kKvHeads, block, kD});
  Tensor4 vpool(dtype, {pool_pages, kKvHeads, block, kDv});
  std::vector<int32_t> table(static_cast<size_t>(kBatch * pages_per));
  for (size_t i = 0; i < table.size(); ++i) {
    table[i] = static_cast<int32_t>((i * 5 + 1) % static_cast<size_t>(pool_pages));
  }
  std::mt19937 rng(9);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < prior; ++j) {
        const int64_t page = table[static_cast<size_t>(b * pages_per + j / block)];
        for (int64_t x = 0; x < kD; ++x) {
          kp.set(b, h, j, x, u(rng));
          kpool.set(page, h, j % block, x, kp.get(b, h, j, x));
        }
        for (int64_t x = 0; x < kDv; ++x) {
          vp.set(b, h, j, x, u(rng));
          vpool.set(page, h, j % block, x, vp.get(b, h, j, x));
        }
      }
    }
  }
  t.options.key_bias = {};  // sized for Skv without a prior
  t.options.bound_min = {};
  t.options.bound_max = {};
  const TensorView q = t.q.view_swapping_axes_1_2(), k = t.k.view_swapping_axes_1_2();
  const TensorView v = t.v.view_swapping_axes_1_2();
  std::vector<unsigned char> dense_out;
  for (bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "dense");
    Options o = t.options;
    if (paged) {
      o.k_prior = kpool.view();
      o.v_prior = vpool.view();
      o.prior_block_table =
          TensorView{table.data(), DType::kInt32, 3, {kBatch, 1, pages_per}, {pages_per, 0, 1}};
    } else {
      o.k_prior = kp.view();
      o.v_prior = vp.view();
    }
    o.tp_k = true;
    o.prior_used_len = {prior - 3};
    ASSERT_TRUE(attention_cte(q, k, v, t.outputs, o).ok);
    for (int64_t b = 0; b < kBatch; ++b) {
      Options ob = t.entry_options(b);
      ob.key_bias = {};
      ob.bound_min = {};
      ob.bound_max = {};
      ob.k_prior = paged ? o.k_prior : entry(o.k_prior, b);
      ob.v_prior = paged ? o.v_prior : entry(o.v_prior, b);
      if (paged) ob.prior_block_table = entry(o.prior_block_table, b);
      ob.prior_used_len = o.prior_used_len;
      Outputs single;
      single.out = entry(Batch::swapped(t.out_single), b);
      single.lse = entry(Batch::lse_view(t.lse_single), b);
      const Status s = attention_cte(entry(q, b), entry(k, b), entry(v, b), single, ob);
      ASSERT_TRUE(s.ok) << s.message;
      if (paged) continue;
      reference::Result ref;
      ASSERT_TRUE(reference::attention(entry(q, b), entry(k, b), entry(v, b), ob, &ref).ok);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < kSq; ++i) {
          for (int64_t c = 0; c < kDv; ++c) {
            EXPECT_NEAR(t.out.get(b, i, h, c), ref.out_at(h, i, c), 3e-2);
          }
        }
      }
    }
    EXPECT_EQ(t.out.bytes(), t.out_single.bytes());
    if (paged) {
      EXPECT_EQ(t.out.bytes(), dense_out);
    } else {
      dense_out = t.out.bytes();
    }
  }
}

TEST(RankFourBatch, RefusedCallsNameTheArgumentAndWriteNothing) {
  Batch t(DType::kFloat32);
  const TensorView q = t.q.view_swapping_axes_1_2(), k = t.k.view_swapping_axes_1_2();
  const TensorView v = t.v.view_swapping_axes_1_2();
  // A paged prior from one pool for the last case.
  const int64_t prior = 19, block = 4, pages_per = (prior + block - 1) / block;
  const int64_t pool_pages = kBatch * pages_per + 2;
  Tensor4 kpool(DType::kFloat32, {pool_pages, kKvHeads, block, kD});
  Tensor4 vpool(DType::kFloat32, {pool_pages, kKvHeads, block, kDv});
  std::vector<int32_t> table(static_cast<size_t>(kBatch * pages_per));
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>(i);
  // Refused for `argument` with every buffer of the call as it was, out and lse included (filled
  // with NaN first).
  const auto refuses = [&](const TensorView& keys, const Outputs& outputs, const Options& o,
                           const std::string& argument, const char* what) {
    BufferSnapshot snap;
    snap.add("q", t.q.bytes()).add("k", t.k.bytes()).add("v", t.v.bytes());
    snap.add("alibi_slopes", t.slopes).add("key_bias", t.bias).add("sink", t.sink);
    snap.add("bound_min", t.lo).add("bound_max", t.hi);
    snap.add("k_prior pool", kpool.bytes()).add("v_prior pool", vpool.bytes());
    snap.add("prior_block_table", table);
    snap.add_output("out", t.out.bytes()).add_output("lse", t.lse);
    const Status s = attention_cte(q, keys, v, outputs, o);
    EXPECT_TRUE(refused_for(s, argument)) << what;
    EXPECT_TRUE(snap.unchanged()) << what;
    return s.message;
  };

  refuses(entry(k, 0), t.outputs, t.options, "k", "k without its batch axis");
  Options o = t.options;
  o.key_bias.shape[0] = 2;
  refuses(k, t.outputs, o, "key_bias", "key_bias of 2 entries");
  o = t.options;
  o.alibi_slopes = entry(t.options.alibi_slopes, 0);  // (heads,): no batch axis
  refuses(k, t.outputs, o, "alibi_slopes", "alibi_slopes without the batch axis");
  // Entry 2 only: a bound past the keys.
  t.hi[static_cast<size_t>(2 * kSq + 5)] = static_cast<int32_t>(kSkv + 1);
  std::string message =
      refuses(k, t.outputs, t.options, "bound_max", "entry 2's bound past the keys");
  EXPECT_NE(message.find("(batch entry 2)"), std::string::npos) << message;
  t.hi[static_cast<size_t>(2 * kSq + 5)] = static_cast<int32_t>(kSkv - 10);
  // An output over an input, its entries and heads on one row (so also overlapping itself).
  Outputs over = t.outputs;
  over.lse = {const_cast<float*>(t.bias.data()),  // NOLINT(cppcoreguidelines-pro-type-const-cast)
              DType::kFloat32,
              3,
              {kBatch, kHeads, kSq},
              {0, 0, 1}};
  refuses(k, over, t.options, "lse", "lse on one row over key_bias");
  // Two entries writing the same output rows.
  Outputs shared = t.outputs;
  shared.out.strides[0] = 0;
  refuses(k, shared, t.options, "out", "entries sharing out");
  // A paged prior whose table names a page past the pool for entry 2 only.
  o = t.options;
  o.key_bias = {};  // sized for Skv without a prior
  o.bound_min = {};
  o.bound_max = {};
  o.k_prior = kpool.view();
  o.v_prior = vpool.view();
  o.prior_block_table =
      TensorView{table.data(), DType::kInt32, 3, {kBatch, 1, pages_per}, {pages_per, 0, 1}};
  o.prior_used_len = {prior - 3};
  {
    const Status ok = attention_cte(q, k, v, t.outputs, o);
    ASSERT_TRUE(ok.ok) << ok.message;
  }
  table[static_cast<size_t>(2 * pages_per + 1)] = static_cast<int32_t>(pool_pages);
  message = refuses(k, t.outputs, o, "prior_block_table", "entry 2's page past the pool");
  EXPECT_NE(message.find("(batch entry 2)"), std::string::npos) << message;
}

}  // namespace
}  // namespace flashcte::test
