// One flash_attn_with_kvcache call of the KV-cache tests (kvcache_test.cc,
// kvcache_validation_test.cc): the case, its inputs drawn from the case's seed (the logical cache
// of every sequence, dense or paged, the new tokens, lengths, rotary tables and slopes), the
// options and a run into fresh outputs.
#ifndef FLASHCTE_TESTS_KVCACHE_CASES_H_
#define FLASHCTE_TESTS_KVCACHE_CASES_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/kvcache.h"
#include "tests/test_util.h"

namespace flashcte::test {

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

inline void PrintTo(const KvCase& c, std::ostream* os) { *os << c.name; }

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

inline KvCacheOptions make_options(const KvCase& c, KvInputs& in) {
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

inline KvRun run_kvcache(const KvCase& c, KvInputs& in) {
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

inline KvCase kv_case(std::string name, DType dtype) {
  KvCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  return c;
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_KVCACHE_CASES_H_
