// decode_attention (include/flashcte/decode.h) against the float64 oracle and against the
// prefill kernel: each sequence of a decode call is the prefill problem whose keys are its cache
// slots [0, last position + 1), causal with cp_offset = its first position (consecutive
// positions) or with packing bounds (any positions), bs = q_heads, bs_kv = kv_heads, and the same
// sink, window and softcap. Tolerances follow tests/test_util.cc: float32 within 1e-5 max|ref|;
// bfloat16 / float16 within twice the error of a plain same-precision implementation
// (reference::attention_plain) plus one rounding of the largest output; lse likewise on the
// logits' scale. Cache slots no token attends hold NaN, so a kernel that reads one fails.
#include "flashcte/decode.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

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

#include "src/core/half.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---- machinery ---------------------------------------------------------------------------------

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
void PrintTo(const DecodeCase& c, std::ostream* os) { *os << c.name; }

DecodeCase shape(std::string name, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t tokens,
                 int64_t d, int64_t dv, int64_t max_len, std::vector<int64_t> last,
                 DType dtype = DType::kFloat32) {
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
void run_prefill_problems(const DecodeCase& c, const Tensor4& q, const Tensor4& k, const Tensor4& v,
                          const std::vector<float>& sink, DecodeRun* r) {
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
DecodeRun run_decode_case(const DecodeCase& c, bool with_reference = true) {
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

double max_abs(const std::vector<double>& xs) {
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
Tolerance tolerance(const DecodeCase& c, const DecodeRun& r) {
  const double m = max_abs(r.exact_out), logits = std::max(1.0, max_abs(r.exact_lse));
  if (c.dtype == DType::kFloat32) return {1e-5 * m, 1e-5 * logits + 1e-5};
  const double u = c.dtype == DType::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  return {std::min(2 * max_abs_diff(r.plain_out, r.exact_out) + u * m, 1e-5 + 2e-2 * m),
          2 * max_abs_diff(r.plain_lse, r.exact_lse) + u * logits + 1e-5};
}

::testing::AssertionResult within(const char* what, const std::vector<double>& got,
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

::testing::AssertionResult check_against_reference(const DecodeCase& c, const DecodeRun& r) {
  const Tolerance tol = tolerance(c, r);
  auto res = within("out vs float64", r.out, r.exact_out, tol.out);
  return res ? within("lse vs float64", r.lse, r.exact_lse, tol.lse) : res;
}

// Each kernel is within the tolerance of the oracle, so the two agree within twice it.
::testing::AssertionResult check_against_prefill(const DecodeCase& c, const DecodeRun& r) {
  const Tolerance tol = tolerance(c, r);
  auto res = within("out vs attention_cte", r.out, r.cte_out, 2 * tol.out);
  return res ? within("lse vs attention_cte", r.lse, r.cte_lse, 2 * tol.lse) : res;
}

// ---- accuracy ----------------------------------------------------------------------------------

std::vector<DecodeCase> accuracy_cases() {
  std::vector<DecodeCase> shapes;
  auto add = [&](const DecodeCase& c) { shapes.push_back(c); };
  // GQA 32/8 at d = 128, the Llama shape: T = 1 over the whole of a 4096-slot cache, two
  // sequences at different positions.
  add(shape("gqa32_8_T1_d128_len4096", 2, 32, 8, 1, 128, 0, 4096, {4095, 1000}));
  add(shape("gqa32_8_T3_d64_len17", 1, 32, 8, 3, 64, 0, 17, {16}));
  add(shape("gqa32_8_T16_d128_len300", 1, 32, 8, 16, 128, 0, 300, {299}));
  add(shape("gqa8_2_T16_d128_len4096", 1, 8, 2, 16, 128, 0, 4096, {4095}));
  add(shape("mqa8_1_T1_d80_len17", 2, 8, 1, 1, 80, 0, 17, {16, 3}));
  add(shape("mha4_4_T3_d1_len17", 1, 4, 4, 3, 1, 0, 17, {9}));
  add(shape("mha2_2_T1_d257_len1", 1, 2, 2, 1, 257, 0, 1, {0}));
  add(shape("gqa4_2_T3_d257_len17", 1, 4, 2, 3, 257, 0, 17, {16}));
  add(shape("gqa4_2_T1_d64_dv80_len40", 1, 4, 2, 1, 64, 80, 40, {39}));
  // Value widths whose last 32-column group is partial past 16 (the native bfloat16 PV's in-lane
  // interleave) and odd attended lengths, at 2 and 3 rows per KV head.
  add(shape("gqa4_2_T1_d64_dv120_len45", 1, 4, 2, 1, 64, 120, 45, {44}));
  add(shape("gqa12_4_T1_d120_len77", 2, 12, 4, 1, 120, 0, 77, {76, 32}));
  // A batch whose sequences sit at different positions, down to the first slot.
  add(shape("batch3_T1_len17", 3, 8, 2, 1, 64, 0, 17, {16, 5, 0}));
  add(shape("batch2_T3_len4096", 2, 8, 2, 3, 128, 0, 4096, {4095, 2050}));
  // A sliding window (and sink, softcap) over several chunks of the KV axis.
  DecodeCase window = shape("gqa8_2_T3_window100_len4096", 1, 8, 2, 3, 128, 0, 4096, {3000});
  window.window = 100;
  add(window);
  DecodeCase wide_window = window;
  wide_window.name = "gqa8_2_T3_window2500_len4096_sink";
  wide_window.window = 2500;
  wide_window.sink = true;
  add(wide_window);
  DecodeCase sink = shape("gqa32_8_T1_sink_len600", 2, 32, 8, 1, 64, 0, 600, {599, 100});
  sink.sink = true;
  add(sink);
  DecodeCase capped = shape("gqa8_2_T3_softcap_window_sink_len64", 1, 8, 2, 3, 64, 0, 64, {40});
  capped.softcap = 3.0f;
  capped.window = 7;
  capped.sink = true;
  add(capped);
  // Positions that are not consecutive (repeated, with gaps), and more than 16 new tokens.
  DecodeCase gaps = shape("gqa4_2_gapped_positions", 2, 4, 2, 4, 64, 0, 40, {});
  gaps.positions = {{10, 12, 12, 30}, {0, 0, 3, 39}};
  add(gaps);
  add(shape("gqa8_2_T20_len64", 1, 8, 2, 20, 64, 0, 64, {63}));
  // Strided views: the caches' channel stride is 2 (gathered per block), q and out padded.
  DecodeCase strided = shape("gqa8_2_T3_strided_len200", 2, 8, 2, 3, 80, 0, 200, {199, 64});
  strided.strided = true;
  add(strided);

  return in_every_dtype(shapes);
}

class DecodeAccuracy : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeAccuracy, MatchesTheReferenceAndThePrefillKernel) {
  const DecodeCase& c = GetParam();
  const DecodeRun run = run_decode_case(c);
  ASSERT_TRUE(run.status.ok) << run.status.message;
  EXPECT_TRUE(check_against_reference(c, run));
  EXPECT_TRUE(check_against_prefill(c, run));
}

std::string case_name(const ::testing::TestParamInfo<DecodeCase>& param) {
  return param.param.name;
}
INSTANTIATE_TEST_SUITE_P(Decode, DecodeAccuracy, ::testing::ValuesIn(accuracy_cases()), case_name);

// Every SIMD target this CPU runs computes the whole kernel correctly (the micro-kernels' own
// testers are tests/simd/decode_ops_test.cc).
TEST(DecodeTargets, EveryTargetMatchesTheReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    DecodeCase c = shape("targets", 2, 8, 2, 3, 80, 0, 1500, {1499, 40}, dtype);
    c.sink = true;
    c.window = 1200;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", " + dtype_name(dtype));
      const DecodeRun run = run_decode_case(c);
      ASSERT_TRUE(run.status.ok) << run.status.message;
      EXPECT_TRUE(check_against_reference(c, run));
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

// ---- determinism -------------------------------------------------------------------------------

// The KV axis is cut into chunks by the problem alone: 1, 2 and 3 threads give the same bytes.
TEST(DecodeThreads, BitwiseIdenticalForAnyThreadCount) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    DecodeCase c = shape("threads", 3, 8, 2, 3, 128, 0, 4096, {4095, 2000, 10}, dtype);
    c.sink = true;
    std::vector<DecodeRun> runs;
    for (int threads : {1, 2, 3}) {
      c.threads = threads;
      runs.push_back(run_decode_case(c, /*with_reference=*/false));
      ASSERT_TRUE(runs.back().status.ok) << runs.back().status.message;
    }
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_TRUE(runs[i].out_bytes == runs[0].out_bytes) << dtype_name(dtype) << ": out differs";
      EXPECT_TRUE(runs[i].lse_bytes == runs[0].lse_bytes) << dtype_name(dtype) << ": lse differs";
    }
  }
}

// A cache laid out (batch, seqlen, heads, d) (FlashAttention's) is worked chunk by chunk with a
// chunk's KV heads in one item, a (batch, heads, seqlen, d) one head by head (decode_schedule.cc):
// the same values give the same bytes either way, over several chunks (partial states merged) or
// one (rows written by the item), and threads that group the heads (1-3: at least two items per
// thread) or not (4).
TEST(DecodeLayouts, SlotMajorCacheGivesTheHeadMajorBytes) {
  constexpr int64_t kB = 3, kHq = 8, kHkv = 2, kL = 2600, kD = 64;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(kB * kHq * kD), k_hm(kB * kHkv * kL * kD), v_hm(k_hm.size());
  for (auto* t : {&q, &k_hm, &v_hm}) {
    for (float& x : *t) x = u(rng);
  }
  // The same values slot-major.
  std::vector<float> k_sm(k_hm.size()), v_sm(v_hm.size());
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < kHkv; ++h) {
      for (int64_t j = 0; j < kL; ++j) {
        for (int64_t x = 0; x < kD; ++x) {
          const size_t hm = static_cast<size_t>(((b * kHkv + h) * kL + j) * kD + x);
          const size_t sm = static_cast<size_t>(((b * kL + j) * kHkv + h) * kD + x);
          k_sm[sm] = k_hm[hm];
          v_sm[sm] = v_hm[hm];
        }
      }
    }
  }
  const std::vector<int64_t> positions = {kL - 1, 1500, 600};  // 3, 2 and 1 chunks
  const auto run = [&](const float* k, const float* v, bool slot_major, int threads) {
    const std::array<int64_t, 4> strides =
        slot_major ? std::array<int64_t, 4>{kL * kHkv * kD, kD, kHkv * kD, 1}
                   : std::array<int64_t, 4>{kHkv * kL * kD, kL * kD, kD, 1};
    const TensorView kv_shape[2] = {{k, DType::kFloat32, 4, {kB, kHkv, kL, kD}, strides},
                                    {v, DType::kFloat32, 4, {kB, kHkv, kL, kD}, strides}};
    std::vector<float> out(q.size()), lse(kB * kHq);
    DecodeOutputs outputs;
    outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {kB, kHq, 1, kD});
    outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kB, kHq, 1});
    DecodeOptions o;
    o.scale = 0.125f;
    o.num_threads = threads;
    EXPECT_TRUE(decode_attention(
                    TensorView::contiguous(q.data(), DType::kFloat32, {kB, kHq, 1, kD}),
                    kv_shape[0], kv_shape[1],
                    TensorView::contiguous(positions.data(), DType::kInt64, {kB, 1}), outputs, o)
                    .ok);
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const std::vector<float> want = run(k_hm.data(), v_hm.data(), false, 1);
  for (int threads : {1, 2, 3, 4}) {
    const std::vector<float> got = run(k_sm.data(), v_sm.data(), true, threads);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
        << threads << " threads";
  }
}

// ---- paged caches ------------------------------------------------------------------------------

// A paged cache gives the bytes of the dense one with the same rows, for any block size (1, odd,
// a tile's 16, past the 64-slot blocks and the 1024-slot chunks), both page layouts, every dtype,
// thread count and SIMD target, with windows that cut pages, sinks, and the gathered path
// (channel stride 2).
TEST(DecodePaged, BitwiseTheDenseResultForAnyBlockSize) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (bool strided : {false, true}) {
      DecodeCase c = shape("paged", 3, 8, 2, 3, 80, 0, 1500, {1499, 700, 2}, dtype);
      c.sink = true;
      c.window = strided ? 0 : 1100;
      c.strided = strided;
      const DecodeRun dense = run_decode_case(c, /*with_reference=*/false);
      ASSERT_TRUE(dense.status.ok) << dense.status.message;
      for (int64_t block_size : {1, 3, 16, 256, 1100}) {
        for (bool nhd : {false, true}) {
          for (int threads : {1, 3}) {
            c.block_size = block_size;
            c.nhd = nhd;
            c.threads = threads;
            SCOPED_TRACE(std::string(dtype_name(dtype)) + (strided ? " strided" : "") +
                         ", block_size " + std::to_string(block_size) + (nhd ? " NHD" : " HND") +
                         ", threads " + std::to_string(threads));
            const DecodeRun paged = run_decode_case(c, /*with_reference=*/false);
            ASSERT_TRUE(paged.status.ok) << paged.status.message;
            EXPECT_TRUE(paged.out_bytes == dense.out_bytes) << "out differs";
            EXPECT_TRUE(paged.lse_bytes == dense.lse_bytes) << "lse differs";
          }
        }
      }
    }
  }
}

TEST(DecodePaged, BitwiseTheDenseResultOnEveryTarget) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    DecodeCase c = shape("paged_targets", 2, 8, 2, 2, 128, 0, 700, {699, 300}, dtype);
    c.window = 500;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", " + dtype_name(dtype));
      c.block_size = 0;
      const DecodeRun dense = run_decode_case(c);
      ASSERT_TRUE(dense.status.ok) << dense.status.message;
      EXPECT_TRUE(check_against_reference(c, dense));
      for (int64_t block_size : {1, 3, 16}) {
        c.block_size = block_size;
        const DecodeRun paged = run_decode_case(c, /*with_reference=*/false);
        ASSERT_TRUE(paged.status.ok) << paged.status.message;
        EXPECT_TRUE(paged.out_bytes == dense.out_bytes) << "block_size " << block_size;
        EXPECT_TRUE(paged.lse_bytes == dense.lse_bytes) << "block_size " << block_size;
      }
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

// Against the float64 oracle directly, at the Llama shape with several pages per 64-slot block.
TEST(DecodePaged, MatchesTheReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    DecodeCase c = shape("paged_reference", 2, 32, 8, 1, 128, 0, 600, {599, 17}, dtype);
    c.block_size = 16;
    c.sink = true;
    const DecodeRun run = run_decode_case(c);
    ASSERT_TRUE(run.status.ok) << run.status.message;
    EXPECT_TRUE(check_against_reference(c, run)) << dtype_name(dtype);
  }
}

// Two sequences reading the same pages (a shared prefix): pages may repeat in a block table.
TEST(DecodePaged, SequencesMaySharePages) {
  const int64_t kv_heads = 2, d = 16, block = 4, pages = 3;
  std::vector<float> pool(static_cast<size_t>(pages * kv_heads * block * d));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : pool) x = u(rng);
  std::vector<float> q(2 * 4 * d), out(q.size()), dense_out(q.size());
  for (float& x : q) x = u(rng);
  // Sequence 0: pages 2, 0; sequence 1: pages 2, 1 (page 2 is the common prefix).
  const std::vector<int32_t> table = {2, 0, 2, 1};
  const std::vector<int64_t> positions = {7, 6};
  DecodeOptions o;
  o.block_table = TensorView::contiguous(table.data(), DType::kInt32, {2, 2});
  const TensorView pool_view =
      TensorView::contiguous(pool.data(), DType::kFloat32, {pages, kv_heads, block, d});
  DecodeOutputs outputs;
  outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {2, 4, 1, d});
  const TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {2, 1});
  const TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {2, 4, 1, d});
  ASSERT_TRUE(decode_attention(qv, pool_view, pool_view, pos, outputs, o).ok);
  // The same rows copied into a dense (2, kv_heads, 8, d) cache.
  std::vector<float> dense(static_cast<size_t>(2 * kv_heads * 2 * block * d));
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t j = 0; j < 2 * block; ++j) {
        const int64_t page = table[b * 2 + j / block];
        std::memcpy(&dense[((b * kv_heads + h) * 2 * block + j) * d],
                    &pool[((page * kv_heads + h) * block + j % block) * d], d * sizeof(float));
      }
    }
  }
  const TensorView dense_view =
      TensorView::contiguous(dense.data(), DType::kFloat32, {2, kv_heads, 2 * block, d});
  outputs.out = MutableTensorView::contiguous(dense_out.data(), DType::kFloat32, {2, 4, 1, d});
  ASSERT_TRUE(decode_attention(qv, dense_view, dense_view, pos, outputs, DecodeOptions{}).ok);
  EXPECT_EQ(out, dense_out);
}

// ---- bad input ---------------------------------------------------------------------------------

// A valid call (batch 2, 4/2 heads, T 2, d 8, 16 slots), to be broken one argument at a time.
struct ValidDecode {
  int64_t batch = 2, q_heads = 4, kv_heads = 2, tokens = 2, d = 8, max_len = 16;
  std::vector<float> q = std::vector<float>(batch * q_heads * tokens * d, 0.5f);
  std::vector<float> k = std::vector<float>(batch * kv_heads * max_len * d, 0.25f);
  std::vector<float> v = std::vector<float>(batch * kv_heads * max_len * d, 1.0f);
  std::vector<float> out = std::vector<float>(batch * q_heads * tokens * d);
  std::vector<float> lse = std::vector<float>(batch * q_heads * tokens);
  std::vector<int64_t> positions = {3, 4, 14, 15};
  std::vector<float> sink = {0.0f, 1.0f, -2.0f, 3.0f};
  TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {2, 4, 2, 8});
  TensorView kv = TensorView::contiguous(k.data(), DType::kFloat32, {2, 2, 16, 8});
  TensorView vv = TensorView::contiguous(v.data(), DType::kFloat32, {2, 2, 16, 8});
  TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {2, 2});
  DecodeOutputs outputs;
  DecodeOptions options;
  ValidDecode() {
    outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {2, 4, 2, 8});
    outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {2, 4, 2});
    options.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {4});
  }
  Status run() {
    Status s;
    EXPECT_NO_THROW(s = decode_attention(qv, kv, vv, pos, outputs, options));
    return s;
  }
  // Every buffer of the call, out and lse filled with NaN first.
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("q", q).add("k_cache", k).add("v_cache", v).add("positions", positions);
    snap.add("sink", sink).add_output("out", out).add_output("lse", lse);
    return snap;
  }
};

TEST(DecodeValidation, TheValidCallSucceeds) {
  ValidDecode call;
  const Status s = call.run();
  EXPECT_TRUE(s.ok) << s.message;
}

TEST(DecodeValidation, EmptyBatchesAndNoNewTokensAreNoOps) {
  ValidDecode call;
  call.qv.shape[0] = call.kv.shape[0] = call.vv.shape[0] = 0;
  call.pos.shape[0] = call.outputs.out.shape[0] = call.outputs.lse.shape[0] = 0;
  EXPECT_TRUE(call.run().ok);
  ValidDecode none;
  none.qv.shape[2] = none.pos.shape[1] = none.outputs.out.shape[2] = 0;
  none.outputs.lse.shape[2] = 0;
  EXPECT_TRUE(none.run().ok);
}

struct BadInput {
  const char* what;
  const char* argument;
  void (*breaks)(ValidDecode&);
};

const BadInput kBadInputs[] = {
    {"q missing", "q", [](ValidDecode& c) { c.qv = {}; }},
    {"q of rank 3", "q", [](ValidDecode& c) { c.qv.rank = 3; }},
    {"q int32", "q", [](ValidDecode& c) { c.qv.dtype = DType::kInt32; }},
    {"q head dim 0", "q", [](ValidDecode& c) { c.qv.shape[3] = c.kv.shape[3] = 0; }},
    {"q negative stride", "q", [](ValidDecode& c) { c.qv.strides[1] = -8; }},
    {"q_heads not a multiple of kv_heads", "q",
     [](ValidDecode& c) { c.qv.shape[1] = c.outputs.out.shape[1] = 3; }},
    {"k_cache missing", "k_cache", [](ValidDecode& c) { c.kv = {}; }},
    {"k_cache null data", "k_cache", [](ValidDecode& c) { c.kv.data = nullptr; }},
    {"k_cache bfloat16", "k_cache", [](ValidDecode& c) { c.kv.dtype = DType::kBFloat16; }},
    {"k_cache other batch", "k_cache", [](ValidDecode& c) { c.kv.shape[0] = 1; }},
    {"k_cache other head dim", "k_cache", [](ValidDecode& c) { c.kv.shape[3] = 4; }},
    {"v_cache float16", "v_cache", [](ValidDecode& c) { c.vv.dtype = DType::kFloat16; }},
    {"v_cache other kv_heads", "v_cache", [](ValidDecode& c) { c.vv.shape[1] = 1; }},
    {"v_cache other max_len", "v_cache", [](ValidDecode& c) { c.vv.shape[2] = 8; }},
    {"positions missing", "positions", [](ValidDecode& c) { c.pos = {}; }},
    {"positions int32", "positions", [](ValidDecode& c) { c.pos.dtype = DType::kInt32; }},
    {"positions (batch, T + 1)", "positions", [](ValidDecode& c) { c.pos.shape[1] = 3; }},
    {"a negative position", "positions", [](ValidDecode& c) { c.positions[1] = -1; }},
    {"a position past the cache", "positions", [](ValidDecode& c) { c.positions[3] = 16; }},
    {"out missing", "out", [](ValidDecode& c) { c.outputs.out = {}; }},
    {"out bfloat16", "out", [](ValidDecode& c) { c.outputs.out.dtype = DType::kBFloat16; }},
    {"out of another T", "out", [](ValidDecode& c) { c.outputs.out.shape[2] = 1; }},
    {"out elements overlapping", "out", [](ValidDecode& c) { c.outputs.out.strides[1] = 0; }},
    {"out aliasing k_cache", "out", [](ValidDecode& c) { c.outputs.out.data = c.k.data(); }},
    {"lse float16", "lse", [](ValidDecode& c) { c.outputs.lse.dtype = DType::kFloat16; }},
    {"lse of rank 2", "lse", [](ValidDecode& c) { c.outputs.lse.rank = 2; }},
    {"lse of other heads", "lse", [](ValidDecode& c) { c.outputs.lse.shape[1] = 2; }},
    {"lse aliasing out", "lse", [](ValidDecode& c) { c.outputs.lse.data = c.out.data(); }},
    {"sink of kv_heads", "sink", [](ValidDecode& c) { c.options.sink.shape[0] = 2; }},
    {"sink NaN", "sink", [](ValidDecode& c) { c.sink[2] = std::nanf(""); }},
    {"sink +inf", "sink",
     [](ValidDecode& c) { c.sink[0] = std::numeric_limits<float>::infinity(); }},
    {"sink int64", "sink", [](ValidDecode& c) { c.options.sink.dtype = DType::kInt64; }},
    {"scale inf", "scale",
     [](ValidDecode& c) { c.options.scale = std::numeric_limits<float>::infinity(); }},
    {"softcap negative", "softcap", [](ValidDecode& c) { c.options.softcap = -1.0f; }},
    {"sliding_window negative", "sliding_window",
     [](ValidDecode& c) { c.options.sliding_window = -2; }},
    {"num_threads negative", "num_threads", [](ValidDecode& c) { c.options.num_threads = -1; }},
};

TEST(DecodeValidation, EveryBadInputIsRefusedWithItsArgumentNamed) {
  for (const BadInput& bad : kBadInputs) {
    ValidDecode call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

// ValidDecode on a paged cache: 5 pages of 4 slots, 4 pages per sequence; positions 3, 4 read
// pages 0 and 1 of sequence 0, 14, 15 all four of sequence 1.
struct ValidPagedDecode : ValidDecode {
  std::vector<int32_t> table = {4, 0, -1, -1, 1, 3, 2, 0};
  ValidPagedDecode() {
    kv = TensorView::contiguous(k.data(), DType::kFloat32, {5, 2, 4, 8});
    vv = TensorView::contiguous(v.data(), DType::kFloat32, {5, 2, 4, 8});
    options.block_table = TensorView::contiguous(table.data(), DType::kInt32, {2, 4});
  }
  BufferSnapshot snapshot() {
    BufferSnapshot snap = ValidDecode::snapshot();
    snap.add("block_table", table);
    return snap;
  }
};

TEST(DecodeValidation, ThePagedCallSucceedsWithUnreadEntriesAnything) {
  ValidPagedDecode call;
  const Status s = call.run();
  EXPECT_TRUE(s.ok) << s.message;
}

struct BadPagedInput {
  const char* what;
  const char* argument;
  void (*breaks)(ValidPagedDecode&);
};

const BadPagedInput kBadPagedInputs[] = {
    {"block_table int64", "block_table",
     [](ValidPagedDecode& c) { c.options.block_table.dtype = DType::kInt64; }},
    {"block_table of rank 1", "block_table",
     [](ValidPagedDecode& c) { c.options.block_table.rank = 1; }},
    {"block_table of another batch", "block_table",
     [](ValidPagedDecode& c) { c.options.block_table.shape[0] = 1; }},
    {"a page past num_blocks", "block_table", [](ValidPagedDecode& c) { c.table[5] = 5; }},
    {"a negative page that is read", "block_table", [](ValidPagedDecode& c) { c.table[1] = -1; }},
    {"a position past the pages", "positions", [](ValidPagedDecode& c) { c.positions[3] = 16; }},
    {"block_size 0", "k_cache", [](ValidPagedDecode& c) { c.kv.shape[2] = c.vv.shape[2] = 0; }},
    {"v_cache of other num_blocks", "v_cache", [](ValidPagedDecode& c) { c.vv.shape[0] = 4; }},
    {"v_cache of another block_size", "v_cache", [](ValidPagedDecode& c) { c.vv.shape[2] = 2; }},
    {"out aliasing a page", "out", [](ValidPagedDecode& c) { c.outputs.out.data = c.v.data(); }},
};

TEST(DecodeValidation, EveryBadPagedInputIsRefusedWithItsArgumentNamed) {
  for (const BadPagedInput& bad : kBadPagedInputs) {
    ValidPagedDecode call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

}  // namespace
}  // namespace flashcte::test
