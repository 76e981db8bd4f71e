// The machinery of decode_attention's tests (decode_test.cc, decode_paged_test.cc): a decode
// case, its caches as pools of pages, a run of decode_attention with each sequence's prefill
// problem through the float64 oracle, the plain implementation and attention_cte, and the
// tolerances of tests/test_util.cc's compare() for out and lse.
#ifndef FLASHCTE_TESTS_DECODE_CASES_H_
#define FLASHCTE_TESTS_DECODE_CASES_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "src/core/half.h"
#include "tests/test_util.h"

namespace flashcte::test {

// One decode_attention call. Sequence b's tokens sit at last[b] - (T - 1) ... last[b]
// (consecutive), or at positions[b] when given; empty `last` puts every sequence at the end.
struct DecodeCase {
  std::string name;
  DType dtype = DType::kFloat32;
  int64_t batch = 1, q_heads = 4, kv_heads = 1, tokens = 1, d = 64, dv = 0, max_len = 64;
  std::vector<int64_t> last;
  std::vector<std::vector<int64_t>> positions;
  int64_t window = 0;
  bool sink = false;
  float softcap = 0.0f;
  bool strided = false;  // channel stride 2 in the caches, padded rows in q and out
  // > 0: the caches are pools of pages of this many slots behind a block table, the pages in a
  // shuffled order (paged_caches); nhd: laid out (num_blocks, block_size, kv_heads, d).
  int64_t block_size = 0;
  bool nhd = false;
  int threads = 0;
  uint64_t seed = 1;

  int64_t value_dim() const { return dv > 0 ? dv : d; }
  int64_t position(int64_t b, int64_t t) const {
    if (!positions.empty()) return positions[b][t];
    return (last.empty() ? max_len - 1 : last[b]) - (tokens - 1) + t;
  }
  bool consecutive() const { return positions.empty(); }
};

// Failures name the case instead of dumping its bytes.
inline void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

inline DecodeCase shape(std::string name, int64_t batch, int64_t q_heads, int64_t kv_heads,
                        int64_t tokens, int64_t d, int64_t dv, int64_t max_len,
                        std::vector<int64_t> last, DType dtype = DType::kFloat32) {
  DecodeCase c;
  c.name = std::move(name);
  c.dtype = dtype;
  c.batch = batch;
  c.q_heads = q_heads;
  c.kv_heads = kv_heads;
  c.tokens = tokens;
  c.d = d;
  c.dv = dv;
  c.max_len = max_len;
  c.last = std::move(last);
  return c;
}

// The dense caches of a case as pools of pages, (num_blocks, kv_heads, block_size, d) (or NHD),
// sequence b's page i at a shuffled place, two spare pages, and the block table; the entries of
// the pages no token reads are -1 (never looked at).
struct PagedCaches {
  Tensor4 k, v;
  std::vector<int32_t> table;
  int64_t pages_per_sequence = 0;

  PagedCaches(const DecodeCase& c, const Tensor4& dense_k, const Tensor4& dense_v)
      : k(make_pool(c, c.d)), v(make_pool(c, c.value_dim())) {
    pages_per_sequence = (c.max_len + c.block_size - 1) / c.block_size;
    const int64_t pages = c.batch * pages_per_sequence;
    std::vector<int32_t> place(static_cast<size_t>(pages));
    for (int64_t i = 0; i < pages; ++i) place[i] = static_cast<int32_t>(i + 1);  // page 0 spare
    std::shuffle(place.begin(), place.end(), std::mt19937_64(c.seed + 7));
    table.assign(place.begin(), place.end());
    for (int64_t b = 0; b < c.batch; ++b) {
      int64_t lo = c.max_len, hi = 0;
      for (int64_t t = 0; t < c.tokens; ++t) {
        const int64_t pos = c.position(b, t);
        lo = std::min(lo, c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0);
        hi = std::max(hi, pos + 1);
      }
      for (int64_t i = 0; i < pages_per_sequence; ++i) {
        int32_t& entry = table[b * pages_per_sequence + i];
        const int64_t page = entry;
        if ((i + 1) * c.block_size <= lo || i * c.block_size >= hi) entry = -1;
        for (int64_t h = 0; h < c.kv_heads; ++h) {
          for (int64_t r = 0; r < c.block_size && i * c.block_size + r < c.max_len; ++r) {
            const int64_t j = i * c.block_size + r;
            for (int64_t x = 0; x < c.d; ++x) set(c, k, page, h, r, x, dense_k.get(b, h, j, x));
            for (int64_t x = 0; x < c.value_dim(); ++x) {
              set(c, v, page, h, r, x, dense_v.get(b, h, j, x));
            }
          }
        }
      }
    }
  }
  TensorView view(const DecodeCase& c, const Tensor4& pool) const {
    return c.nhd ? pool.view_swapping_axes_1_2() : pool.view();
  }
  TensorView block_table(const DecodeCase& c) const {
    return TensorView::contiguous(table.data(), DType::kInt32, {c.batch, pages_per_sequence});
  }

 private:
  static Tensor4 make_pool(const DecodeCase& c, int64_t channels) {
    const int64_t pages = c.batch * ((c.max_len + c.block_size - 1) / c.block_size) + 2;
    return c.nhd ? Tensor4(c.dtype, {pages, c.block_size, c.kv_heads, channels}, c.strided)
                 : Tensor4(c.dtype, {pages, c.kv_heads, c.block_size, channels}, c.strided);
  }
  static void set(const DecodeCase& c, Tensor4& pool, int64_t page, int64_t h, int64_t r, int64_t x,
                  double value) {
    if (c.nhd) {
      pool.set(page, r, h, x, value);
    } else {
      pool.set(page, h, r, x, value);
    }
  }
};

struct DecodeRun {
  Status status;
  std::vector<unsigned char> out_bytes, lse_bytes;
  // (batch, q_heads, T, dv) / (batch, q_heads, T) as doubles, for decode, the float64 oracle, the
  // plain same-precision implementation and attention_cte.
  std::vector<double> out, lse, exact_out, exact_lse, plain_out, plain_lse, cte_out, cte_lse;
};

// Sequence b of the case as a prefill problem over its slots [0, hi), the caches' values read
// back exactly; runs the oracle, the plain implementation and attention_cte on it.
inline void run_prefill_problems(const DecodeCase& c, const Tensor4& q, const Tensor4& k,
                                 const Tensor4& v, const std::vector<float>& sink, DecodeRun* r) {
  const int64_t dv = c.value_dim(), T = c.tokens;
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t hi = 0;
    for (int64_t t = 0; t < T; ++t) hi = std::max(hi, c.position(b, t) + 1);
    HostTensor qr(c.dtype, {c.q_heads, T, c.d}), kr(c.dtype, {c.kv_heads, hi, c.d});
    HostTensor vr(c.dtype, {c.kv_heads, hi, dv}), sr(DType::kFloat32, {c.q_heads, 1});
    HostTensor lo_bound(DType::kInt64, {T, 1}), hi_bound(DType::kInt64, {T, 1});
    for (int64_t h = 0; h < c.q_heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t x = 0; x < c.d; ++x) qr.set(h, t, x, q.get(b, h, t, x));
      }
      if (c.sink) sr.set(h, 0, 0, sink[h]);
    }
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      for (int64_t j = 0; j < hi; ++j) {
        for (int64_t x = 0; x < c.d; ++x)
          kr.set(h, j, x, std::isnan(k.get(b, h, j, x)) ? 0 : k.get(b, h, j, x));
        for (int64_t x = 0; x < dv; ++x)
          vr.set(h, j, x, std::isnan(v.get(b, h, j, x)) ? 0 : v.get(b, h, j, x));
      }
    }
    Options o;
    o.tp_k = true;
    o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    o.softcap = c.softcap;
    if (c.sink) o.sink = sr.view();
    if (c.consecutive()) {
      o.cp_offset = c.position(b, 0);
      o.sliding_window = c.window;
    } else {
      o.causal_mask = false;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t pos = c.position(b, t);
        lo_bound.set_raw_int(t, 0, c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0);
        hi_bound.set_raw_int(t, 0, pos + 1);
      }
      o.bound_min = lo_bound.view();
      o.bound_max = hi_bound.view();
    }
    reference::Result exact, plain;
    ASSERT_TRUE(reference::attention(qr.view(), kr.view(), vr.view(), o, &exact).ok);
    ASSERT_TRUE(reference::attention_plain(qr.view(), kr.view(), vr.view(), o, &plain).ok);
    HostTensor out(c.dtype, {c.q_heads, T, dv}), lse(DType::kFloat32, {c.q_heads, T});
    Outputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse = lse.mutable_view();
    const Status s = attention_cte(qr.view(), kr.view(), vr.view(), outputs, o);
    ASSERT_TRUE(s.ok) << s.message;
    for (int64_t h = 0; h < c.q_heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t x = 0; x < dv; ++x) {
          r->exact_out.push_back(exact.out_at(h, t, x));
          r->plain_out.push_back(plain.out_at(h, t, x));
          r->cte_out.push_back(out.get(h, t, x));
        }
        r->exact_lse.push_back(exact.lse[h * T + t]);
        r->plain_lse.push_back(plain.lse[h * T + t]);
        r->cte_lse.push_back(lse.get(h, t));
      }
    }
  }
}

// Builds the case's tensors (uniform in [-1, 1); cache slots no token attends hold NaN), runs
// decode_attention and, with_reference, the prefill problems.
inline DecodeRun run_decode_case(const DecodeCase& c, bool with_reference = true) {
  const int64_t dv = c.value_dim(), T = c.tokens;
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  Tensor4 q(c.dtype, {c.batch, c.q_heads, T, c.d}, c.strided);
  Tensor4 k(c.dtype, {c.batch, c.kv_heads, c.max_len, c.d}, c.strided);
  Tensor4 v(c.dtype, {c.batch, c.kv_heads, c.max_len, dv}, c.strided);
  Tensor4 out(c.dtype, {c.batch, c.q_heads, T, dv}, c.strided);
  out.fill_nan();
  std::vector<float> lse = nan_floats(c.batch * c.q_heads * T);
  std::vector<float> sink(static_cast<size_t>(c.q_heads));
  std::vector<int64_t> positions;
  for (int64_t b = 0; b < c.batch; ++b) {
    int64_t lo = c.max_len, hi = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = c.position(b, t);
      positions.push_back(pos);
      lo = std::min(lo, c.window > 0 ? std::max<int64_t>(0, pos - c.window + 1) : 0);
      hi = std::max(hi, pos + 1);
    }
    for (int64_t h = 0; h < c.q_heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t x = 0; x < c.d; ++x) q.set(b, h, t, x, u(rng));
      }
    }
    for (int64_t h = 0; h < c.kv_heads; ++h) {
      for (int64_t j = 0; j < c.max_len; ++j) {
        const bool attended = j >= lo && j < hi;
        const double nan = std::numeric_limits<double>::quiet_NaN();
        for (int64_t x = 0; x < c.d; ++x) k.set(b, h, j, x, attended ? u(rng) : nan);
        for (int64_t x = 0; x < dv; ++x) v.set(b, h, j, x, attended ? u(rng) : nan);
      }
    }
  }
  // Sinks around the logits' scale, and one head without (-inf).
  for (int64_t h = 0; h < c.q_heads; ++h) {
    sink[h] = h == 1 ? -std::numeric_limits<float>::infinity() : static_cast<float>(2 * u(rng));
  }
  DecodeOptions o;
  o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
  o.softcap = c.softcap;
  o.sliding_window = c.window;
  o.num_threads = c.threads;
  if (c.sink) o.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {c.q_heads});
  DecodeOutputs outputs;
  outputs.out = out.mutable_view();
  outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {c.batch, c.q_heads, T});
  DecodeRun r;
  const TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {c.batch, T});
  if (c.block_size > 0) {
    const PagedCaches paged(c, k, v);
    o.block_table = paged.block_table(c);
    r.status =
        decode_attention(q.view(), paged.view(c, paged.k), paged.view(c, paged.v), pos, outputs, o);
  } else {
    r.status = decode_attention(q.view(), k.view(), v.view(), pos, outputs, o);
  }
  r.out_bytes = out.bytes();
  r.lse_bytes.resize(lse.size() * sizeof(float));
  std::memcpy(r.lse_bytes.data(), lse.data(), r.lse_bytes.size());
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t h = 0; h < c.q_heads; ++h) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t x = 0; x < dv; ++x) r.out.push_back(out.get(b, h, t, x));
        r.lse.push_back(lse[(b * c.q_heads + h) * T + t]);
      }
    }
  }
  if (with_reference && r.status.ok) run_prefill_problems(c, q, k, v, sink, &r);
  return r;
}

inline double max_abs(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

// The tolerances of tests/test_util.cc's compare(), for out and lse.
struct Tolerance {
  double out, lse;
};
inline Tolerance tolerance(const DecodeCase& c, const DecodeRun& r) {
  const double m = max_abs(r.exact_out), logits = std::max(1.0, max_abs(r.exact_lse));
  if (c.dtype == DType::kFloat32) return {1e-5 * m, 1e-5 * logits + 1e-5};
  const double u = c.dtype == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  return {std::min(2 * max_abs_diff(r.plain_out, r.exact_out) + u * m, 1e-5 + 2e-2 * m),
          2 * max_abs_diff(r.plain_lse, r.exact_lse) + u * logits + 1e-5};
}

inline ::testing::AssertionResult within(const char* what, const std::vector<double>& got,
                                         const std::vector<double>& want, double tol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  // A plain implementation whose error is not finite gives no bound.
  if (!std::isfinite(tol)) return ::testing::AssertionFailure() << what << ": tolerance " << tol;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(abs_error(got[i], want[i]) <= tol)) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << got[i] << ", want " << want[i] << " within " << tol
             << " (worst error " << max_abs_diff(got, want) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult check_against_reference(const DecodeCase& c, const DecodeRun& r) {
  const Tolerance tol = tolerance(c, r);
  auto res = within("out vs float64", r.out, r.exact_out, tol.out);
  return res ? within("lse vs float64", r.lse, r.exact_lse, tol.lse) : res;
}

// Each kernel is within the tolerance of the oracle, so the two agree within twice it.
inline ::testing::AssertionResult check_against_prefill(const DecodeCase& c, const DecodeRun& r) {
  const Tolerance tol = tolerance(c, r);
  auto res = within("out vs attention_cte", r.out, r.cte_out, 2 * tol.out);
  return res ? within("lse vs attention_cte", r.lse, r.cte_lse, 2 * tol.lse) : res;
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_DECODE_CASES_H_
