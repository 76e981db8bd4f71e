// flash_attn_with_kvcache (include/flashcte/kvcache.h) against the float64 oracle, with
// FlashAttention's test as the contract (tests/test_flash_attn.py, test_flash_attn_kvcache): the
// appended v equals the input exactly, the appended k is within 1e-3 of the float64 rotation,
// and out / lse err at most 3x a plain same-precision implementation, plus 1e-5. Each sequence's
// oracle problem is attention_cte's (src/reference): its query heads over the cache slots
// [0, seqlen_k) as they are after the append, with FlashAttention's masks written here as
// per-row packing bounds (its construct_local_mask: bottom-right causal alignment, the window,
// left padding) and its ALiBi distances through bottom_right. Paged results are bitwise the
// dense ones. (The call: kvcache_cases.h; bad input, refused by name with the caches byte for
// byte as they were, and attention_cte over a paged prior: kvcache_validation_test.cc.)
#include "flashcte/kvcache.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/kvcache_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// FlashAttention's rotation in float32 (its apply_rotary_emb computes in float32 and rounds to
// the tensor's dtype), written out here: pairs (2i, 2i + 1) or (i, i + rotary_dim / 2).
void rotate32(const KvCase& c, const KvInputs& in, int64_t pos, std::vector<float>& x) {
  const int64_t half = c.rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const auto cs = static_cast<float>(in.cos.get(pos, i)),
               sn = static_cast<float>(in.sin.get(pos, i));
    const int64_t a = c.interleaved ? 2 * i : i, b = c.interleaved ? 2 * i + 1 : i + half;
    const float x0 = x[a], x1 = x[b];
    x[a] = x0 * cs - x1 * sn;
    x[b] = x0 * sn + x1 * cs;
  }
}

// The caches after the call hold the new v exactly and the new k rotated (within 1e-3 of the
// float64 rotation), every other element as it was; then the oracle on the caches as they are.
void check_against_reference(const KvCase& c, KvInputs& in, const KvRun& r) {
  const int64_t dv = c.value_dim();
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < c.slots(); ++j) {
      const int64_t t = j - in.seqlens[b];
      const bool appended = c.lengths_given && t >= 0 && t < c.seqlen_new;
      for (int64_t h = 0; h < c.kv_heads; ++h) {
        for (int64_t x = 0; x < dv; ++x) {
          const double want =
              appended ? in.v.get(b, t, h, x) : in.logical_v[b][(j * c.kv_heads + h) * dv + x];
          ASSERT_EQ(in.cache_at(c, in.v_cache, b, j, h, x), want)
              << "v_cache of sequence " << b << ", slot " << j;
        }
        // The new k: FlashAttention's reference rotation (float32, rounded to the dtype) within
        // its 1e-3, and the float64 rotation within one rounding of the dtype.
        std::vector<float> turned(static_cast<size_t>(c.d));
        if (appended) {
          for (int64_t x = 0; x < c.d; ++x) turned[x] = static_cast<float>(in.k.get(b, t, h, x));
          if (c.rotary_dim > 0) rotate32(c, in, j, turned);
        }
        for (int64_t x = 0; x < c.d; ++x) {
          const double got = in.cache_at(c, in.k_cache, b, j, h, x);
          if (!appended) {
            ASSERT_EQ(got, in.logical_k[b][(j * c.kv_heads + h) * c.d + x])
                << "k_cache of sequence " << b << ", slot " << j << " changed";
            continue;
          }
          const double want = reference::round_to_dtype(turned[x], c.dtype);
          EXPECT_NEAR(got, want, 1e-3 + 1e-3 * std::fabs(want))
              << "appended k of sequence " << b << ", slot " << j;
          double exact = in.k.get(b, t, h, x);
          if (x < c.rotary_dim) {
            const int64_t half = c.rotary_dim / 2, i = c.interleaved ? x / 2 : x % half;
            const int64_t mate = c.interleaved ? x ^ 1 : (x < half ? x + half : x - half);
            const bool first = c.interleaved ? x % 2 == 0 : x < half;
            const double cs = in.cos.get(j, i), sn = in.sin.get(j, i);
            const double other = in.k.get(b, t, h, mate);
            exact = first ? exact * cs - other * sn : other * sn + exact * cs;
          }
          EXPECT_NEAR(got, exact, 2 * unit_roundoff(c.dtype) * (std::fabs(exact) + 1))
              << "appended k of sequence " << b << ", slot " << j << " vs float64";
        }
      }
    }
  }
  std::vector<double> exact_out, plain_out, exact_lse, plain_lse;
  std::vector<std::vector<double>> per_b_out_exact, per_b_out_plain;
  exact_out.assign(r.out.size(), 0.0);
  plain_out = exact_out;
  exact_lse.assign(r.lse.size(), -std::numeric_limits<double>::infinity());
  plain_lse = exact_lse;
  const bool per_token = c.causal || c.left >= 0 || c.right >= 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t seqlen_k = in.seqlens[b] + (c.lengths_given ? c.seqlen_new : 0);
    if (seqlen_k == 0) continue;
    HostTensor qr(c.dtype, {c.heads, c.seqlen_q, c.d}), kr(c.dtype, {c.kv_heads, seqlen_k, c.d});
    HostTensor vr(c.dtype, {c.kv_heads, seqlen_k, dv});
    HostTensor lo(DType::kInt64, {c.seqlen_q, 1}), hi(DType::kInt64, {c.seqlen_q, 1});
    std::vector<float> row(static_cast<size_t>(c.d));
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t i = 0; i < c.seqlen_q; ++i) {
        for (int64_t x = 0; x < c.d; ++x) row[x] = static_cast<float>(in.q.get(b, i, h, x));
        if (c.rotary_dim > 0) rotate32(c, in, in.seqlens[b] + (per_token ? i : 0), row);
        for (int64_t x = 0; x < c.d; ++x) qr.set(h, i, x, row[x]);
      }
    }
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      for (int64_t j = 0; j < seqlen_k; ++j) {
        for (int64_t x = 0; x < c.d; ++x) kr.set(h, j, x, in.cache_at(c, in.k_cache, b, j, h, x));
        for (int64_t x = 0; x < dv; ++x) vr.set(h, j, x, in.cache_at(c, in.v_cache, b, j, h, x));
      }
    }
    // construct_local_mask of FlashAttention's tests, with its key_leftpad.
    const int64_t right = c.causal ? 0 : c.right;
    for (int64_t i = 0; i < c.seqlen_q; ++i) {
      const int64_t diagonal = seqlen_k - c.seqlen_q + i;
      int64_t first = in.leftpad[b], end = seqlen_k;
      if (right >= 0) end = std::min(end, diagonal + right + 1);
      if (c.left >= 0) first = std::max(first, diagonal - c.left);
      lo.set_raw_int(i, 0, std::min(first, std::max<int64_t>(end, 0)));
      hi.set_raw_int(i, 0, std::max<int64_t>(end, 0));
    }
    Options o;
    o.tp_k = true;
    o.causal_mask = false;
    o.bottom_right = true;  // ALiBi's distance |i + seqlen_k - seqlen_q - j|
    o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    o.softcap = c.softcap;
    o.bound_min = lo.view();
    o.bound_max = hi.view();
    if (c.alibi) o.alibi_slopes = in.slopes.view();
    reference::Result exact, plain;
    ASSERT_TRUE(reference::attention(qr.view(), kr.view(), vr.view(), o, &exact).ok);
    ASSERT_TRUE(reference::attention_plain(qr.view(), kr.view(), vr.view(), o, &plain).ok);
    for (int64_t i = 0; i < c.seqlen_q; ++i) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t x = 0; x < dv; ++x) {
          const size_t at = static_cast<size_t>(((b * c.seqlen_q + i) * c.heads + h) * dv + x);
          exact_out[at] = exact.out_at(h, i, x);
          plain_out[at] = plain.out_at(h, i, x);
        }
        const size_t at = static_cast<size_t>((b * c.heads + h) * c.seqlen_q + i);
        exact_lse[at] = exact.lse[h * c.seqlen_q + i];
        plain_lse[at] = plain.lse[h * c.seqlen_q + i];
      }
    }
  }
  EXPECT_TRUE(within_plain_error(r.out, plain_out, exact_out, 3, 1e-5)) << "out";
  EXPECT_TRUE(within_plain_error(r.lse, plain_lse, exact_lse, 3, 1e-5)) << "lse";
  for (size_t i = 0; i < r.lse.size(); ++i) {
    ASSERT_EQ(std::isinf(r.lse[i]), std::isinf(exact_lse[i])) << "lse[" << i << "]: empty rows";
  }
}

std::vector<KvCase> accuracy_cases() {
  std::vector<KvCase> shapes;
  KvCase c;
  // Decode: one token appended and attended, GQA 32/8 at d = 128, dense and paged.
  c = kv_case("decode_gqa32_8_d128", DType::kFloat32);
  c.heads = 32, c.kv_heads = 8, c.d = 128, c.capacity = 300, c.causal = true;
  shapes.push_back(c);
  c.name = "decode_gqa32_8_d128_page16";
  c.page = 16;
  shapes.push_back(c);
  // Rotary, both styles and a partial rotary_dim, with a few new tokens, causal and not.
  for (bool interleaved : {true, false}) {
    for (bool causal : {true, false}) {
      c = kv_case(std::string("rotary_") + (interleaved ? "gptj" : "neox") +
                      (causal ? "_causal" : "_noncausal"),
                  DType::kFloat32);
      c.seqlen_q = 3, c.seqlen_new = 3, c.rotary_dim = causal ? 64 : 32;
      c.interleaved = interleaved, c.causal = causal, c.page = causal ? 3 : 0;
      shapes.push_back(c);
    }
  }
  // A prefill chunk longer than the new tokens, and more queries than keys (rows that see none).
  c = kv_case("chunk_q8_new5_leftpad_window", DType::kFloat32);
  c.seqlen_q = 8, c.seqlen_new = 5, c.leftpad = true, c.left = 6, c.causal = true, c.capacity = 40;
  shapes.push_back(c);
  c = kv_case("no_append_q5_causal_batch_idx", DType::kFloat32);
  c.seqlen_q = 5, c.seqlen_new = 0, c.causal = true, c.batch_idx = true, c.batch = 3;
  c.capacity = 7;
  shapes.push_back(c);
  c = kv_case("full_cache_no_lengths", DType::kFloat32);
  c.seqlen_new = 0, c.lengths_given = false, c.capacity = 33, c.page = 1;
  shapes.push_back(c);
  // Windows both sides, softcap, ALiBi, MQA, d and dv apart.
  c = kv_case("window_both_softcap_alibi_mqa", DType::kFloat32);
  c.heads = 6, c.kv_heads = 1, c.d = 80, c.dv = 48, c.seqlen_q = 4, c.seqlen_new = 2;
  c.left = 9, c.right = 2, c.softcap = 4.0f, c.alibi = true, c.capacity = 50, c.page = 7;
  shapes.push_back(c);
  c = kv_case("alibi_causal_leftpad_batch_idx_rotary", DType::kFloat32);
  c.seqlen_q = 2, c.seqlen_new = 2, c.alibi = true, c.causal = true, c.leftpad = true;
  c.batch_idx = true, c.rotary_dim = 16, c.interleaved = false, c.batch = 3;
  shapes.push_back(c);
  // Chunks longer than kDecodeMaxQueries run on attention_cte with the cache as its prior.
  c = kv_case("prefill_q40_new40_page16_rotary", DType::kFloat32);
  c.seqlen_q = 40, c.seqlen_new = 40, c.causal = true, c.page = 16, c.capacity = 120;
  c.rotary_dim = 32, c.heads = 8, c.kv_heads = 2;
  shapes.push_back(c);
  c = kv_case("prefill_q24_leftpad_alibi_batch_idx", DType::kFloat32);
  c.seqlen_q = 24, c.seqlen_new = 0, c.causal = true, c.leftpad = true, c.alibi = true;
  c.batch_idx = true, c.capacity = 60;
  shapes.push_back(c);
  c = kv_case("prefill_q20_window_softcap_page5", DType::kFloat32);
  c.seqlen_q = 20, c.seqlen_new = 20, c.left = 30, c.right = 3, c.softcap = 5.0f, c.page = 5;
  c.capacity = 100;
  shapes.push_back(c);
  return in_every_dtype(shapes);
}

class KvCacheAccuracy : public ::testing::TestWithParam<KvCase> {};

TEST_P(KvCacheAccuracy, MatchesTheReference) {
  const KvCase& c = GetParam();
  for (uint64_t seed : {1, 2, 3}) {
    KvCase s = c;
    s.seed = seed;
    SCOPED_TRACE("seed " + std::to_string(seed));
    KvInputs in(s);
    const KvRun r = run_kvcache(s, in);
    ASSERT_TRUE(r.status.ok) << r.status.message;
    check_against_reference(s, in, r);
  }
}

std::string case_name(const ::testing::TestParamInfo<KvCase>& param) { return param.param.name; }
INSTANTIATE_TEST_SUITE_P(KvCache, KvCacheAccuracy, ::testing::ValuesIn(accuracy_cases()),
                         case_name);

// The same call over a paged cache (any page size) gives the bytes of the dense one, for any
// thread count and SIMD target.
TEST(KvCachePaged, BitwiseTheDenseResult) {
  for (auto [dtype, chunk] : {std::pair{DType::kFloat32, 2}, std::pair{DType::kBFloat16, 2},
                              std::pair{DType::kFloat16, 2}, std::pair{DType::kFloat32, 40},
                              std::pair{DType::kBFloat16, 40}}) {
    KvCase c = kv_case("paged", dtype);
    c.batch = 3, c.heads = 8, c.kv_heads = 2, c.d = 64, c.seqlen_q = chunk, c.seqlen_new = chunk;
    c.capacity = 1200, c.causal = true, c.rotary_dim = 32, c.left = 700, c.alibi = true;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(std::string(hwy::TargetName(target)) + " " + dtype_name(dtype) + ", chunk " +
                   std::to_string(chunk));
      c.page = 0;
      KvInputs dense_in(c);
      const KvRun dense = run_kvcache(c, dense_in);
      ASSERT_TRUE(dense.status.ok) << dense.status.message;
      for (int64_t page : {1, 3, 16, 256}) {
        for (int threads : {1, 3}) {
          c.page = page;
          c.threads = threads;
          KvInputs in(c);
          const KvRun paged = run_kvcache(c, in);
          ASSERT_TRUE(paged.status.ok) << paged.status.message;
          EXPECT_TRUE(paged.out_bytes == dense.out_bytes) << "page " << page << ": out differs";
          EXPECT_TRUE(paged.lse_bytes == dense.lse_bytes) << "page " << page << ": lse differs";
        }
      }
      c.threads = 0;
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

}  // namespace
}  // namespace flashcte::test
