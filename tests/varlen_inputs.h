// A mixed batch for flash_attn_varlen_kvcache's tests (varlen_kvcache_test.cc,
// varlen_plan_test.cc): the case, its inputs (the same logical cache dense or in shuffled pages),
// and a run into fresh outputs.
#ifndef FLASHCTE_TESTS_VARLEN_INPUTS_H_
#define FLASHCTE_TESTS_VARLEN_INPUTS_H_

#include <algorithm>
#include <array>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "tests/test_util.h"

namespace flashcte::test {

struct VarlenCase {
  std::string name;
  DType dtype = DType::kFloat32;
  std::vector<int64_t> q_lens;  // per sequence; 0: a sequence without queries this step
  std::vector<int64_t> used;    // seqused_k per sequence
  int64_t heads = 4, kv_heads = 2, d = 32, dv = 0;
  int64_t capacity = 0;  // slots per sequence (0: the longest used)
  int64_t page = 0;      // > 0: a paged cache
  bool causal = true;
  int64_t left = -1, right = -1;
  float softcap = 0.0f;
  int alibi = 0;  // 0 none, 1 (heads,), 2 (batch, heads)
  bool sinks = false;
  int threads = 0;
  uint64_t seed = 1;

  int64_t batch() const { return static_cast<int64_t>(q_lens.size()); }
  int64_t value_dim() const { return dv > 0 ? dv : d; }
  int64_t total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0}); }
  int64_t longest() const {
    return std::max<int64_t>(capacity, *std::max_element(used.begin(), used.end()));
  }
  int64_t slots() const { return page > 0 ? (longest() + page - 1) / page * page : longest(); }
  int64_t pages_per_sequence() const { return page > 0 ? slots() / page : 1; }
};

inline void PrintTo(const VarlenCase& c, std::ostream* os) { *os << c.name; }

struct VarlenInputs {
  std::vector<int32_t> cu, used, table;
  HostTensor q, slopes, sinks;
  Tensor4 k_cache, v_cache;
  std::vector<std::vector<double>> logical_k, logical_v;  // [b][(j * kv_heads + h) * d + x]

  explicit VarlenInputs(const VarlenCase& c)
      : q(c.dtype, {c.total_q(), c.heads, c.d}),
        k_cache(c.dtype, cache_shape(c, c.d)),
        v_cache(c.dtype, cache_shape(c, c.value_dim())) {
    std::mt19937_64 rng(c.seed), placement(c.seed + 1000);
    std::uniform_real_distribution<double> u(-1.0, 1.0), u01(0.0, 1.0);
    cu.push_back(0);
    for (int64_t b = 0; b < c.batch(); ++b) {
      cu.push_back(static_cast<int32_t>(cu.back() + c.q_lens[b]));
      used.push_back(static_cast<int32_t>(c.used[b]));
    }
    // The same values for the dense and the paged forms of a case: the slots past the longest
    // sequence (the rest of a last page) hold zeros.
    const int64_t slots = c.slots(), dv = c.value_dim(), drawn = c.longest();
    for (int64_t b = 0; b < c.batch(); ++b) {
      logical_k.emplace_back(static_cast<size_t>(slots * c.kv_heads * c.d));
      logical_v.emplace_back(static_cast<size_t>(slots * c.kv_heads * dv));
      for (int64_t i = 0; i < drawn * c.kv_heads * c.d; ++i) {
        logical_k.back()[i] = reference::round_to_dtype(u(rng), c.dtype);
      }
      for (int64_t i = 0; i < drawn * c.kv_heads * dv; ++i) {
        logical_v.back()[i] = reference::round_to_dtype(u(rng), c.dtype);
      }
    }
    for (int64_t i = 0; i < c.total_q(); ++i) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t x = 0; x < c.d; ++x) q.set(i, h, x, u(rng));
      }
    }
    if (c.alibi > 0) {
      slopes = HostTensor(DType::kFloat32, c.alibi == 1 ? std::vector<int64_t>{c.heads}
                                                        : std::vector<int64_t>{c.batch(), c.heads});
      for (int64_t b = 0; b < (c.alibi == 1 ? 1 : c.batch()); ++b) {
        for (int64_t h = 0; h < c.heads; ++h) {
          if (c.alibi == 1) slopes.set(h, 0, 0, 0.5 * u01(rng));
          if (c.alibi == 2) slopes.set(b, h, 0, 0.5 * u01(rng));
        }
      }
    }
    if (c.sinks) {
      sinks = HostTensor(DType::kFloat32, {c.heads});
      for (int64_t h = 0; h < c.heads; ++h) sinks.set(h, 0, 0, 2.0 * u(rng));
    }
    if (c.page > 0) {
      std::vector<int32_t> place(static_cast<size_t>(c.batch() * c.pages_per_sequence() + 3));
      std::iota(place.begin(), place.end(), 0);
      std::shuffle(place.begin(), place.end(), placement);
      table.assign(place.begin(), place.begin() + c.batch() * c.pages_per_sequence());
    }
    for (int64_t b = 0; b < c.batch(); ++b) {
      for (int64_t j = 0; j < slots; ++j) {
        const auto [row, slot] = where(c, b, j);
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          for (int64_t x = 0; x < c.d; ++x) {
            k_cache.set(row, slot, h, x, logical_k[b][(j * c.kv_heads + h) * c.d + x]);
          }
          for (int64_t x = 0; x < dv; ++x) {
            v_cache.set(row, slot, h, x, logical_v[b][(j * c.kv_heads + h) * dv + x]);
          }
        }
      }
    }
  }

  static std::array<int64_t, 4> cache_shape(const VarlenCase& c, int64_t channels) {
    if (c.page > 0) return {c.batch() * c.pages_per_sequence() + 3, c.page, c.kv_heads, channels};
    return {c.batch(), c.slots(), c.kv_heads, channels};
  }
  std::array<int64_t, 2> where(const VarlenCase& c, int64_t b, int64_t j) const {
    if (c.page > 0) return {table[b * c.pages_per_sequence() + j / c.page], j % c.page};
    return {b, j};
  }

  VarlenKvCacheOptions options(const VarlenCase& c) const {
    VarlenKvCacheOptions o;
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {c.batch() + 1});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {c.batch()});
    if (c.page > 0) {
      o.block_table =
          TensorView::contiguous(table.data(), DType::kInt32, {c.batch(), c.pages_per_sequence()});
    }
    if (c.alibi > 0) o.alibi_slopes = slopes.view();
    if (c.sinks) o.sinks = sinks.view();
    o.causal = c.causal;
    o.window_left = c.left;
    o.window_right = c.right;
    o.softcap = c.softcap;
    o.num_threads = c.threads;
    return o;
  }
};

struct VarlenRun {
  Status status;
  HostTensor out;
  std::vector<float> lse;
};

inline VarlenRun run_varlen(const VarlenCase& c, const VarlenInputs& in) {
  VarlenRun r{Status::Ok(), HostTensor(c.dtype, {c.total_q(), c.heads, c.value_dim()}),
              nan_floats(c.heads * c.total_q())};
  r.status = flash_attn_varlen_kvcache(
      in.q.view(), in.k_cache.view(), in.v_cache.view(), r.out.mutable_view(),
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {c.heads, c.total_q()}),
      in.options(c));
  return r;
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_VARLEN_INPUTS_H_
