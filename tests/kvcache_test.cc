// flash_attn_with_kvcache (include/flashcte/kvcache.h) against the float64 oracle, with
// FlashAttention's test as the contract (tests/test_flash_attn.py, test_flash_attn_kvcache): the
// appended v equals the input exactly, the appended k is within 1e-3 of the float64 rotation,
// and out / lse err at most 3x a plain same-precision implementation, plus 1e-5. Each sequence's
// oracle problem is attention_cte's (src/reference): its query heads over the cache slots
// [0, seqlen_k) as they are after the append, with FlashAttention's masks written here as
// per-row packing bounds (its construct_local_mask: bottom-right causal alignment, the window,
// left padding) and its ALiBi distances through bottom_right. Paged results are bitwise the
// dense ones; bad input is refused by name with the caches byte for byte as they were.
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

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

struct KvCase {
  std::string name;
  DType dtype = DType::kFloat32;
  int64_t batch = 2, seqlen_q = 1, seqlen_new = 1, heads = 4, kv_heads = 2, d = 64, dv = 0;
  int64_t capacity = 64;   // slots per sequence (paged: rounded up to whole pages)
  int64_t page = 0;        // > 0: a paged cache of pages of this many slots
  bool batch_idx = false;  // dense: twice the sequences' cache rows, picked by cache_batch_idx
  bool leftpad = false;
  int64_t rotary_dim = 0;
  bool interleaved = true;
  bool causal = false;
  int64_t left = -1, right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  bool lengths_given = true;  // false: no cache_seqlens (full caches; no append)
  int threads = 0;
  uint64_t seed = 1;

  int64_t value_dim() const { return dv > 0 ? dv : d; }
  int64_t pages_per_sequence() const { return (capacity + page - 1) / page; }
  int64_t slots() const { return page > 0 ? pages_per_sequence() * page : capacity; }
};

void PrintTo(const KvCase& c, std::ostream* os) { *os << c.name; }

// The inputs of one call, drawn from the case's seed: the logical cache of every sequence, the
// new tokens, the lengths, the rotary tables and the slopes.
struct KvInputs {
  std::vector<int32_t> seqlens, leftpad, batch_idx, table;
  Tensor4 q, k, v;
  Tensor4 k_cache, v_cache;  // dense (batch_cache, slots, kv_heads, d) or pages
  HostTensor cos, sin, slopes;
  std::vector<std::vector<double>> logical_k, logical_v;  // [b][(j * kv_heads + h) * d + x]

  explicit KvInputs(const KvCase& c)
      : q(c.dtype, {c.batch, c.seqlen_q, c.heads, c.d}),
        k(c.dtype, {c.batch, c.seqlen_new, c.kv_heads, c.d}),
        v(c.dtype, {c.batch, c.seqlen_new, c.kv_heads, c.value_dim()}),
        k_cache(c.dtype, cache_shape(c, c.d)),
        v_cache(c.dtype, cache_shape(c, c.value_dim())) {
    // Values from one stream and placement from another, so that the dense and the paged forms
    // of a case hold the same values.
    std::mt19937_64 rng(c.seed), placement(c.seed + 1000);
    std::uniform_real_distribution<double> u(-1.0, 1.0), u01(0.0, 1.0);
    const int64_t slots = c.slots(), dv = c.value_dim();
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t lo = c.seqlen_new > 0 || !c.lengths_given ? 0 : 1;
      std::uniform_int_distribution<int64_t> len(std::min(lo, c.capacity - c.seqlen_new),
                                                 c.capacity - c.seqlen_new);
      seqlens.push_back(static_cast<int32_t>(c.lengths_given ? len(rng) : slots));
      std::uniform_int_distribution<int64_t> pad(0, seqlens.back());
      leftpad.push_back(static_cast<int32_t>(c.leftpad ? pad(rng) : 0));
      // Slots past the capacity (the rest of a last page) hold zeros; no call reaches them.
      logical_k.emplace_back(static_cast<size_t>(slots * c.kv_heads * c.d));
      logical_v.emplace_back(static_cast<size_t>(slots * c.kv_heads * dv));
      for (int64_t i = 0; i < c.capacity * c.kv_heads * c.d; ++i) {
        logical_k.back()[i] = reference::round_to_dtype(u(rng), c.dtype);
      }
      for (int64_t i = 0; i < c.capacity * c.kv_heads * dv; ++i) {
        logical_v.back()[i] = reference::round_to_dtype(u(rng), c.dtype);
      }
    }
    fill(q, u, rng);
    fill(k, u, rng);
    fill(v, u, rng);
    if (c.rotary_dim > 0) {
      cos = HostTensor(c.dtype, {c.capacity, c.rotary_dim / 2});
      sin = HostTensor(c.dtype, {c.capacity, c.rotary_dim / 2});
      for (int64_t j = 0; j < c.capacity; ++j) {
        for (int64_t i = 0; i < c.rotary_dim / 2; ++i) {
          const double angle = 2 * M_PI * u01(rng);
          cos.set(j, i, 0, std::cos(angle));
          sin.set(j, i, 0, std::sin(angle));
        }
      }
    }
    if (c.alibi) {
      slopes = HostTensor(DType::kFloat32, {c.heads});
      for (int64_t h = 0; h < c.heads; ++h) slopes.set(h, 0, 0, 0.5 * u01(rng));
    }
    // Where sequence b's slots live: cache rows picked by a permutation, or shuffled pages.
    const int64_t rows = c.page > 0 ? c.batch * c.pages_per_sequence() + 3 : cache_rows(c);
    std::vector<int32_t> place(static_cast<size_t>(rows));
    std::iota(place.begin(), place.end(), 0);
    std::shuffle(place.begin(), place.end(), placement);
    if (c.page > 0) {
      table.assign(place.begin(), place.begin() + c.batch * c.pages_per_sequence());
    } else if (c.batch_idx) {
      batch_idx.assign(place.begin(), place.begin() + c.batch);
    }
    for (int64_t b = 0; b < c.batch; ++b) {
      for (int64_t j = 0; j < slots; ++j) {
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          for (int64_t x = 0; x < c.d; ++x) {
            set_cache(c, k_cache, b, j, h, x, logical_k[b][(j * c.kv_heads + h) * c.d + x]);
          }
          for (int64_t x = 0; x < dv; ++x) {
            set_cache(c, v_cache, b, j, h, x, logical_v[b][(j * c.kv_heads + h) * dv + x]);
          }
        }
      }
    }
  }

  static int64_t cache_rows(const KvCase& c) { return c.batch_idx ? 2 * c.batch : c.batch; }
  static std::array<int64_t, 4> cache_shape(const KvCase& c, int64_t channels) {
    if (c.page > 0) return {c.batch * c.pages_per_sequence() + 3, c.page, c.kv_heads, channels};
    return {cache_rows(c), c.slots(), c.kv_heads, channels};
  }
  // The cache element of sequence b's slot j, wherever the case keeps it.
  std::array<int64_t, 2> where(const KvCase& c, int64_t b, int64_t j) const {
    if (c.page > 0) return {table[b * c.pages_per_sequence() + j / c.page], j % c.page};
    return {c.batch_idx ? batch_idx[b] : b, j};
  }
  void set_cache(const KvCase& c, Tensor4& cache, int64_t b, int64_t j, int64_t h, int64_t x,
                 double value) const {
    const auto [row, slot] = where(c, b, j);
    cache.set(row, slot, h, x, value);
  }
  double cache_at(const KvCase& c, const Tensor4& cache, int64_t b, int64_t j, int64_t h,
                  int64_t x) const {
    const auto [row, slot] = where(c, b, j);
    return cache.get(row, slot, h, x);
  }
  static void fill(Tensor4& t, std::uniform_real_distribution<double>& u, std::mt19937_64& rng) {
    const TensorView view = t.view();
    for (int64_t a = 0; a < view.shape[0]; ++a) {
      for (int64_t b = 0; b < view.shape[1]; ++b) {
        for (int64_t h = 0; h < view.shape[2]; ++h) {
          for (int64_t x = 0; x < view.shape[3]; ++x) t.set(a, b, h, x, u(rng));
        }
      }
    }
  }
};

struct KvRun {
  Status status;
  std::vector<unsigned char> out_bytes, lse_bytes;
  std::vector<double> out, lse;  // (batch, seqlen_q, heads, dv), (batch, heads, seqlen_q)
};

KvCacheOptions make_options(const KvCase& c, KvInputs& in) {
  KvCacheOptions o;
  if (c.seqlen_new > 0) {
    o.k = in.k.view();
    o.v = in.v.view();
  }
  if (c.lengths_given) {
    o.cache_seqlens = TensorView::contiguous(in.seqlens.data(), DType::kInt32, {c.batch});
  }
  if (c.leftpad) {
    o.cache_leftpad = TensorView::contiguous(in.leftpad.data(), DType::kInt32, {c.batch});
  }
  if (c.batch_idx) {
    o.cache_batch_idx = TensorView::contiguous(in.batch_idx.data(), DType::kInt32, {c.batch});
  }
  if (c.page > 0) {
    o.block_table =
        TensorView::contiguous(in.table.data(), DType::kInt32, {c.batch, c.pages_per_sequence()});
  }
  if (c.rotary_dim > 0) {
    o.rotary_cos = in.cos.view();
    o.rotary_sin = in.sin.view();
    o.rotary_interleaved = c.interleaved;
  }
  if (c.alibi) o.alibi_slopes = in.slopes.view();
  o.causal = c.causal;
  o.window_left = c.left;
  o.window_right = c.right;
  o.softcap = c.softcap;
  o.num_threads = c.threads;
  return o;
}

KvRun run_kvcache(const KvCase& c, KvInputs& in) {
  Tensor4 out(c.dtype, {c.batch, c.seqlen_q, c.heads, c.value_dim()});
  out.fill_nan();
  std::vector<float> lse = nan_floats(c.batch * c.heads * c.seqlen_q);
  KvRun r;
  r.status = flash_attn_with_kvcache(
      in.q.view(), in.k_cache.mutable_view(), in.v_cache.mutable_view(), out.mutable_view(),
      MutableTensorView::contiguous(lse.data(), DType::kFloat32, {c.batch, c.heads, c.seqlen_q}),
      make_options(c, in));
  r.out_bytes = out.bytes();
  r.lse_bytes.resize(lse.size() * sizeof(float));
  std::memcpy(r.lse_bytes.data(), lse.data(), r.lse_bytes.size());
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.seqlen_q; ++i) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t x = 0; x < c.value_dim(); ++x) r.out.push_back(out.get(b, i, h, x));
      }
    }
  }
  r.lse.assign(lse.begin(), lse.end());
  return r;
}

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

KvCase kv_case(std::string name, DType dtype) {
  KvCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  return c;
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

}  // namespace
}  // namespace flashcte::test

namespace flashcte::test {
namespace {

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
