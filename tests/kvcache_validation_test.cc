// flash_attn_with_kvcache (include/flashcte/kvcache.h) on bad input: a valid paged call broken
// one argument at a time is refused by name with the caches byte for byte as they were. And
// attention_cte over a paged prior (Options::prior_block_table): bitwise the dense prior's result
// and within the float64 oracle's tolerance, bad block tables refused by name. The accuracy
// against the oracle: kvcache_test.cc; the call: kvcache_cases.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "tests/kvcache_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---- bad input: refused by name, the caches untouched ------------------------------------------

// A valid paged call with an append (2 sequences of 4/2 heads, d 8, pages of 4 slots, 3 pages
// each, 8 pages in the pool), to be broken one argument at a time.
struct ValidKv {
  KvCase c;
  std::unique_ptr<KvInputs> in;
  KvCacheOptions o;
  Tensor4 out{DType::kFloat32, {2, 2, 4, 8}};
  std::vector<float> lse = std::vector<float>(2 * 4 * 2);
  MutableTensorView lse_view;
  std::vector<int32_t> pad;   // cache_leftpad, when a case gives one
  std::vector<float> slopes;  // alibi_slopes, likewise
  ValidKv() {
    c = kv_case("valid", DType::kFloat32);
    c.batch = 2, c.heads = 4, c.kv_heads = 2, c.d = 8, c.seqlen_q = 2, c.seqlen_new = 2;
    c.capacity = 12, c.page = 4, c.rotary_dim = 4, c.causal = true;
    in = std::make_unique<KvInputs>(c);
    in->seqlens = {3, 10};
    o = make_options(c, *in);
    lse_view = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {2, 4, 2});
  }
  Status run() {
    return flash_attn_with_kvcache(in->q.view(), in->k_cache.mutable_view(),
                                   in->v_cache.mutable_view(), out.mutable_view(), lse_view, o);
  }
  // Every buffer of the call, out and lse filled with NaN first.
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("k_cache", in->k_cache.bytes()).add("v_cache", in->v_cache.bytes());
    snap.add("q", in->q.bytes()).add("k", in->k.bytes()).add("v", in->v.bytes());
    snap.add("rotary_cos", in->cos.bytes()).add("rotary_sin", in->sin.bytes());
    snap.add("cache_seqlens", in->seqlens).add("block_table", in->table);
    snap.add("cache_leftpad", pad).add("alibi_slopes", slopes);
    snap.add_output("out", out.bytes()).add_output("lse", lse);
    return snap;
  }
};

TEST(KvCacheValidation, TheValidCallSucceeds) {
  ValidKv call;
  const Status s = call.run();
  EXPECT_TRUE(s.ok) << s.message;
}

struct BadKv {
  const char* what;
  const char* argument;
  void (*breaks)(ValidKv&);
};

const BadKv kBadKv[] = {
    {"a page index past num_blocks", "block_table", [](ValidKv& v) { v.in->table[1] = 9; }},
    {"a negative page that is written", "block_table", [](ValidKv& v) { v.in->table[0] = -1; }},
    {"a page written by one sequence and read by another", "block_table",
     [](ValidKv& v) { v.in->table[5] = v.in->table[0]; }},
    {"a page written twice by one sequence", "block_table",
     [](ValidKv& v) { v.in->table[1] = v.in->table[0]; }},
    {"block_table int64", "block_table", [](ValidKv& v) { v.o.block_table.dtype = DType::kInt64; }},
    {"block_table of another batch", "block_table",
     [](ValidKv& v) { v.o.block_table.shape[0] = 1; }},
    {"page_block_size 0", "k_cache",
     [](ValidKv& v) {
       v.in->k_cache = Tensor4(DType::kFloat32, {8, 0, 2, 8});
       v.in->v_cache = Tensor4(DType::kFloat32, {8, 0, 2, 8});
     }},
    {"cache_seqlens + new past the capacity", "cache_seqlens",
     [](ValidKv& v) { v.in->seqlens[1] = 11; }},
    {"a negative cache_seqlens", "cache_seqlens", [](ValidKv& v) { v.in->seqlens[0] = -1; }},
    {"cache_seqlens int64", "cache_seqlens",
     [](ValidKv& v) { v.o.cache_seqlens.dtype = DType::kInt64; }},
    {"cache_seqlens missing while appending", "cache_seqlens",
     [](ValidKv& v) { v.o.cache_seqlens = {}; }},
    {"cache_leftpad past cache_seqlens", "cache_leftpad",
     [](ValidKv& v) {
       v.pad = {4, 0};
       v.o.cache_leftpad = TensorView::contiguous(v.pad.data(), DType::kInt32, {2});
     }},
    {"cache_batch_idx with a paged cache", "cache_batch_idx",
     [](ValidKv& v) { v.o.cache_batch_idx = v.o.cache_seqlens; }},
    {"k without v", "v", [](ValidKv& v) { v.o.v = {}; }},
    {"k of other kv_heads", "k", [](ValidKv& v) { v.o.k.shape[2] = 1; }},
    {"k of another dtype", "k", [](ValidKv& v) { v.o.k.dtype = DType::kBFloat16; }},
    {"v of another seqlen_new", "v", [](ValidKv& v) { v.o.v.shape[1] = 1; }},
    {"v_cache of another dtype", "v_cache",
     [](ValidKv& v) {
       v.in->v_cache = Tensor4(DType::kFloat16, {11, 4, 2, 8});
     }},
    {"k_cache of other kv_heads", "v_cache",
     [](ValidKv& v) {
       v.in->k_cache = Tensor4(DType::kFloat32, {11, 4, 1, 8});
     }},
    {"heads not a multiple of kv_heads", "q",
     [](ValidKv& v) {
       v.in->q = Tensor4(DType::kFloat32, {2, 2, 3, 8});
     }},
    {"rotary_cos without rotary_sin", "rotary_sin", [](ValidKv& v) { v.o.rotary_sin = {}; }},
    {"rotary_dim past d", "rotary_cos",
     [](ValidKv& v) { v.o.rotary_cos.shape[1] = v.o.rotary_sin.shape[1] = 5; }},
    {"too few rotary positions", "rotary_cos",
     [](ValidKv& v) { v.o.rotary_cos.shape[0] = v.o.rotary_sin.shape[0] = 11; }},
    {"rotary without new k", "rotary_cos",
     [](ValidKv& v) {
       v.o.k = {};
       v.o.v = {};
     }},
    {"alibi of kv_heads", "alibi_slopes",
     [](ValidKv& v) {
       v.slopes = {0.5f, 0.25f};
       v.o.alibi_slopes = TensorView::contiguous(v.slopes.data(), DType::kFloat32, {2});
     }},
    {"alibi NaN", "alibi_slopes",
     [](ValidKv& v) {
       v.slopes = {0.5f, NAN, 0.5f, 0.5f};
       v.o.alibi_slopes = TensorView::contiguous(v.slopes.data(), DType::kFloat32, {4});
     }},
    {"window below -1", "window_size", [](ValidKv& v) { v.o.window_left = -2; }},
    {"softcap negative", "softcap", [](ValidKv& v) { v.o.softcap = -1.0f; }},
    {"softmax_scale inf", "softmax_scale",
     [](ValidKv& v) { v.o.softmax_scale = std::numeric_limits<float>::infinity(); }},
    {"out of another dv", "out",
     [](ValidKv& v) {
       v.out = Tensor4(DType::kFloat32, {2, 2, 4, 4});
     }},
    {"out aliasing k_cache", "out",
     [](ValidKv& v) {
       v.out = Tensor4(DType::kFloat32, {2, 2, 4, 8});
     }},
    {"lse of rank 2", "lse", [](ValidKv& v) { v.lse_view.rank = 2; }},
    {"num_threads negative", "num_threads", [](ValidKv& v) { v.o.num_threads = -1; }},
};

TEST(KvCacheValidation, EveryBadInputIsRefusedByNameWithTheCachesUntouched) {
  for (const BadKv& bad : kBadKv) {
    ValidKv call;
    bad.breaks(call);
    MutableTensorView out_view = call.out.mutable_view();
    if (std::string(bad.what) == "out aliasing k_cache") {
      out_view.data = call.in->k_cache.bytes().data();
    }
    const BufferSnapshot snap = call.snapshot();
    const Status s =
        flash_attn_with_kvcache(call.in->q.view(), call.in->k_cache.mutable_view(),
                                call.in->v_cache.mutable_view(), out_view, call.lse_view, call.o);
    EXPECT_TRUE(refused_for(s, bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

// ---- attention_cte over a paged prior (Options::prior_block_table) -----------------------------

// One prefill call over a prior of `prior` tokens per sequence plus `skv` new keys, the prior
// dense ((bs_kv, S_prior, d), tp_k) or in pages of `page` slots at shuffled places of a pool.
struct PriorCall {
  DType dtype;
  int64_t batch = 2, heads = 8, kv_heads = 2, d = 64, sq = 33, skv = 33, prior = 150, page = 0;
  HostTensor q, k, v, out, lse;
  Tensor4 pool_k, pool_v;
  HostTensor dense_k, dense_v;
  std::vector<int32_t> table;
  int64_t pages = 0;

  PriorCall(DType dt, int64_t page_size)
      : dtype(dt), page(page_size), pool_k(dt, {1, 1, 1, 1}), pool_v(dt, {1, 1, 1, 1}) {
    std::mt19937_64 rng(11);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    const int64_t bs = batch * heads, bs_kv = batch * kv_heads;
    q = HostTensor(dtype, {bs, sq, d});
    k = HostTensor(dtype, {bs_kv, skv, d});
    v = HostTensor(dtype, {bs_kv, skv, d});
    dense_k = HostTensor(dtype, {bs_kv, prior, d});
    dense_v = HostTensor(dtype, {bs_kv, prior, d});
    for (HostTensor* t : {&q, &k, &v, &dense_k, &dense_v}) {
      for (int64_t a = 0; a < t->shape()[0]; ++a) {
        for (int64_t b = 0; b < t->shape()[1]; ++b) {
          for (int64_t x = 0; x < d; ++x) t->set(a, b, x, u(rng));
        }
      }
    }
    out = HostTensor(dtype, {bs, sq, d});
    lse = HostTensor(DType::kFloat32, {bs, sq});
    if (page == 0) return;
    pages = (prior + page - 1) / page;
    std::vector<int32_t> place(static_cast<size_t>(batch * pages + 1));
    std::iota(place.begin(), place.end(), 0);
    std::shuffle(place.begin(), place.end(), std::mt19937_64(5));
    table.assign(place.begin(), place.begin() + batch * pages);
    pool_k = Tensor4(dtype, {batch * pages + 1, kv_heads, page, d});
    pool_v = Tensor4(dtype, {batch * pages + 1, kv_heads, page, d});
    for (int64_t s = 0; s < batch; ++s) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t j = 0; j < prior; ++j) {
          const int64_t pg = table[s * pages + j / page];
          for (int64_t x = 0; x < d; ++x) {
            pool_k.set(pg, h, j % page, x, dense_k.get(s * kv_heads + h, j, x));
            pool_v.set(pg, h, j % page, x, dense_v.get(s * kv_heads + h, j, x));
          }
        }
      }
    }
  }
  Options options() const {
    Options o;
    o.tp_k = true;
    o.causal_mask = true;
    o.scale = 0.125f;
    o.prior_used_len = {prior, prior - 7, prior - 40, prior};  // per KV batch
    if (page == 0) {
      o.k_prior = dense_k.view();
      o.v_prior = dense_v.view();
    } else {
      o.k_prior = pool_k.view();
      o.v_prior = pool_v.view();
      o.prior_block_table = TensorView::contiguous(table.data(), DType::kInt32, {batch, pages});
    }
    return o;
  }
  Status run(const Options& o) {
    Outputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse = lse.mutable_view();
    return attention_cte(q.view(), k.view(), v.view(), outputs, o);
  }
};

TEST(PagedPrior, BitwiseTheDensePriorAndTheReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    PriorCall dense(dtype, 0);
    ASSERT_TRUE(dense.run(dense.options()).ok);
    // The float64 oracle on the dense prior.
    reference::Result exact;
    ASSERT_TRUE(reference::attention(dense.q.view(), dense.k.view(), dense.v.view(),
                                     dense.options(), &exact)
                    .ok);
    double worst = 0;
    for (int64_t b = 0; b < dense.batch * dense.heads; ++b) {
      for (int64_t i = 0; i < dense.sq; ++i) {
        for (int64_t x = 0; x < dense.d; ++x) {
          worst = std::max(worst, abs_error(dense.out.get(b, i, x), exact.out_at(b, i, x)));
        }
      }
    }
    EXPECT_LE(worst, 8 * unit_roundoff(dtype) + 1e-5) << dtype_name(dtype);
    for (int64_t page : {1, 3, 16, 64}) {
      PriorCall paged(dtype, page);
      const Status s = paged.run(paged.options());
      ASSERT_TRUE(s.ok) << s.message;
      EXPECT_TRUE(paged.out.bytes() == dense.out.bytes()) << dtype_name(dtype) << " page " << page;
      EXPECT_TRUE(paged.lse.bytes() == dense.lse.bytes()) << dtype_name(dtype) << " page " << page;
    }
  }
}

TEST(PagedPrior, BadTablesAreRefusedByName) {
  PriorCall call(DType::kFloat32, 16);
  // Refused for `argument` with every buffer of the call as it was, out and lse included.
  const auto refuses = [&](const Options& o, const std::string& argument, const char* what) {
    BufferSnapshot snap;
    snap.add("q", call.q.bytes()).add("k", call.k.bytes()).add("v", call.v.bytes());
    snap.add("k_prior pages", call.pool_k.bytes()).add("v_prior pages", call.pool_v.bytes());
    snap.add("prior_block_table", call.table);
    snap.add_output("out", call.out.mutable_view().data, call.out.bytes().size());
    snap.add_output("lse", call.lse.mutable_view().data, call.lse.bytes().size());
    EXPECT_TRUE(refused_for(call.run(o), argument)) << what;
    EXPECT_TRUE(snap.unchanged()) << what;
  };
  Options o = call.options();
  call.table[3] = static_cast<int32_t>(call.batch * call.pages + 1);  // past num_blocks
  refuses(o, "prior_block_table", "a page past num_blocks");
  call.table[3] = -1;
  refuses(o, "prior_block_table", "a negative page");
  call.table[3] = 0;
  o.prior_block_table.dtype = DType::kInt64;
  refuses(o, "prior_block_table", "int64");
  o = call.options();
  o.prior_block_table.shape[0] = 3;
  refuses(o, "prior_block_table", "3 sequences");
  o = call.options();
  o.k_prior.rank = 3;
  refuses(o, "k_prior", "rank 3 pages");
}

}  // namespace
}  // namespace flashcte::test
