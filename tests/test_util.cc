#include "tests/test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <sstream>

namespace flashcte::test {
namespace {

// Collects mismatches for one AssertionResult, reporting the first few in full.
class Mismatches {
 public:
  void add(const std::string& what) {
    if (count_++ < 8) text_ << "  " << what << "\n";
  }
  bool empty() const { return count_ == 0; }
  std::string str() const {
    std::ostringstream s;
    s << count_ << " mismatch(es):\n" << text_.str();
    if (count_ > 8) s << "  ...\n";
    return s.str();
  }

 private:
  int64_t count_ = 0;
  std::ostringstream text_;
};

std::string fmt(double x) {
  std::ostringstream s;
  s.precision(9);
  s << x;
  return s.str();
}

double max_abs(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

// Largest |a - b| over entries where b is finite.
double max_err(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(b[i])) m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

}  // namespace

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
    case DType::kFloat32:
      return std::ldexp(1.0, -24);
    case DType::kFloat8E4M3:
      return std::ldexp(1.0, -4);
    case DType::kFloat8E5M2:
      return std::ldexp(1.0, -3);
    case DType::kInt8:
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  ADD_FAILURE() << "unit_roundoff: " << dtype_name(dtype) << " is no float format";
  return 0;
}

std::string Case::describe() const {
  std::ostringstream s;
  const Options& o = options;
  s << dtype_name(dtype) << " bs=" << bs << " bs_kv=" << bs_kv << " Sq=" << sq << " Skv=" << skv
    << " d=" << d << " dv=" << value_dim() << " scale=" << o.scale << " causal=" << o.causal_mask;
  if (has_prior) {
    s << " S_prior=" << s_prior << " used=";
    if (o.prior_used_len.empty()) s << "all";
    for (int64_t u : o.prior_used_len) s << u << ",";
  }
  if (o.sliding_window) s << " window=" << o.sliding_window;
  if (sink) s << " sink[" << sink_lo << "," << sink_hi << "]";
  for (double z : sink_values) s << " sink=" << z;
  if (qk_mult != 1 || v_mult != 1) s << " qk_mult=" << qk_mult << " v_mult=" << v_mult;
  if (o.cp_offset) s << " cp_offset=" << *o.cp_offset;
  if (o.global_cp_deg) s << " cp_deg=" << *o.global_cp_deg;
  if (o.cp_strided_q_slicing) s << " strided";
  if (!pack_lengths.empty()) {
    s << " packing=";
    for (int64_t l : pack_lengths) s << l << ",";
    if (pack_empty_sequence) s << "(empty seq 1)";
    s << " bounds " << dtype_name(bound_dtype) << (bound_rank1 ? " (Sq,)" : " (Sq,1)");
  }
  s << " tp_q=" << o.tp_q << " tp_k=" << o.tp_k << " tp_out=" << o.tp_out;
  if (stats != StatsLayout::kNone) {
    s << " cache_softmax=" << (stats == StatsLayout::kNeuron ? "neuron" : "row-major");
  }
  if (lse) s << " lse";
  s << " layouts q/k/v/out/stats=" << layout_name(q_layout) << "/" << layout_name(k_layout) << "/"
    << layout_name(v_layout) << "/" << layout_name(out_layout) << "/" << layout_name(stats_layout);
  s << " dist=" << (dist == Dist::kNormal ? "normal" : "uniform") << " tiles={" << o.tiles.q_block
    << "," << o.tiles.kv_tile << "," << o.tiles.section << "," << o.tiles.section_threshold
    << "} threads=" << o.num_threads << " seed=" << seed;
  return s.str();
}

std::vector<int64_t> sample_rows(int64_t sq, int64_t n, uint64_t seed) {
  std::set<int64_t> rows;
  if (n >= sq) {
    for (int64_t i = 0; i < sq; ++i) rows.insert(i);
    return {rows.begin(), rows.end()};
  }
  auto add = [&](int64_t i) {
    if (i >= 0 && i < sq) rows.insert(i);
  };
  for (int64_t i : {int64_t{0}, int64_t{1}, sq / 2, sq - 2, sq - 1}) add(i);
  // Tile and Q-group edges (128 is the Neuron group; powers of two cover other tile choices).
  for (int64_t m = 128; m < sq && rows.size() < static_cast<size_t>(n / 2); m *= 2) {
    add(m - 1);
    add(m);
  }
  std::mt19937_64 rng(seed * 7919 + 13);
  std::uniform_int_distribution<int64_t> pick(0, sq - 1);
  while (rows.size() < static_cast<size_t>(n)) rows.insert(pick(rng));
  return {rows.begin(), rows.end()};
}

void build_tensors(const Case& c, CaseTensors* t) {
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto draw = [&] { return c.dist == Dist::kNormal ? normal(rng) : uniform(rng); };
  const Options& o = c.options;
  const int64_t dv = c.value_dim();

  // Values are drawn in logical order, so every layout and transpose of a case holds the same
  // numbers.
  t->q = HostTensor(
      c.dtype,
      o.tp_q ? std::vector<int64_t>{c.bs, c.sq, c.d} : std::vector<int64_t>{c.bs, c.d, c.sq},
      c.q_layout);
  for (int64_t b = 0; b < c.bs; ++b)
    for (int64_t i = 0; i < c.sq; ++i)
      for (int64_t ch = 0; ch < c.d; ++ch) {
        const double x = c.qk_mult * draw();
        o.tp_q ? t->q.set(b, i, ch, x) : t->q.set(b, ch, i, x);
      }
  auto make_kv = [&](int64_t len, HostTensor* k, HostTensor* v) {
    *k = HostTensor(
        c.dtype,
        o.tp_k ? std::vector<int64_t>{c.bs_kv, len, c.d} : std::vector<int64_t>{c.bs_kv, c.d, len},
        c.k_layout);
    for (int64_t b = 0; b < c.bs_kv; ++b)
      for (int64_t j = 0; j < len; ++j)
        for (int64_t ch = 0; ch < c.d; ++ch) {
          const double x = c.qk_mult * draw();
          o.tp_k ? k->set(b, j, ch, x) : k->set(b, ch, j, x);
        }
    *v = HostTensor(c.dtype, {c.bs_kv, len, dv}, c.v_layout);
    for (int64_t b = 0; b < c.bs_kv; ++b)
      for (int64_t j = 0; j < len; ++j)
        for (int64_t ch = 0; ch < dv; ++ch) v->set(b, j, ch, c.v_mult * draw());
  };
  make_kv(c.skv, &t->k, &t->v);

  t->options = o;
  if (c.has_prior) {
    make_kv(c.s_prior, &t->k_prior, &t->v_prior);
    t->options.k_prior = t->k_prior.view();
    t->options.v_prior = t->v_prior.view();
  }
  if (c.sink || !c.sink_values.empty()) {
    std::uniform_real_distribution<double> sink(c.sink_lo, c.sink_hi);
    t->sink = HostTensor(DType::kFloat32, {c.bs, 1});
    for (int64_t b = 0; b < c.bs; ++b) {
      t->sink.set(b, 0, 0, c.sink_values.empty() ? sink(rng) : c.sink_values.at(b));
    }
    t->options.sink = t->sink.view();
  }
  if (!c.pack_lengths.empty()) {
    // The prior every KV batch has (packing bounds are shared by all batches).
    int64_t prior = 0;
    if (c.has_prior) {
      prior = c.s_prior;
      for (int64_t u : o.prior_used_len) prior = std::min(prior, u);
    }
    const std::vector<int64_t> shape =
        c.bound_rank1 ? std::vector<int64_t>{c.sq} : std::vector<int64_t>{c.sq, 1};
    t->bound_min = HostTensor(c.bound_dtype, shape);
    t->bound_max = HostTensor(c.bound_dtype, shape);
    int64_t start = 0;
    for (size_t s = 0; s < c.pack_lengths.size(); ++s) {
      const int64_t end = start + c.pack_lengths[s];
      int64_t lo = s == 0 ? 0 : prior + start * c.skv / c.sq;
      int64_t hi = prior + end * c.skv / c.sq;
      if (c.pack_empty_sequence && s == 1) lo = hi;
      for (int64_t i = start; i < end && i < c.sq; ++i) {
        t->bound_min.set_raw_int(i, 0, lo);
        t->bound_max.set_raw_int(i, 0, hi);
      }
      start = end;
    }
    t->options.bound_min = t->bound_min.view();
    t->options.bound_max = t->bound_max.view();
  }

  t->out = HostTensor(
      c.dtype,
      o.tp_out ? std::vector<int64_t>{c.bs, dv, c.sq} : std::vector<int64_t>{c.bs, c.sq, dv},
      c.out_layout);
  t->out.fill_sentinel();
  t->outputs = Outputs{};
  t->outputs.out = t->out.mutable_view();
  t->options.cache_softmax = c.stats != StatsLayout::kNone;
  if (c.stats != StatsLayout::kNone) {
    const std::vector<int64_t> shape = c.stats == StatsLayout::kNeuron
                                           ? std::vector<int64_t>{c.bs, 128, c.sq / 128}
                                           : std::vector<int64_t>{c.bs, c.sq};
    t->neg_max = HostTensor(DType::kFloat32, shape, c.stats_layout);
    t->sum_recip = HostTensor(DType::kFloat32, shape, c.stats_layout);
    t->neg_max.fill_sentinel();
    t->sum_recip.fill_sentinel();
    t->outputs.neg_max = t->neg_max.mutable_view();
    t->outputs.sum_recip = t->sum_recip.mutable_view();
  }
  if (c.lse) {
    t->lse = HostTensor(DType::kFloat32, {c.bs, c.sq}, c.stats_layout);
    t->lse.fill_sentinel();
    t->outputs.lse = t->lse.mutable_view();
  }
}

Outcome run_case(const Case& c, bool skip_reference) {
  Outcome r;
  CaseTensors t;
  build_tensors(c, &t);
  r.status = attention_cte(t.q.view(), t.k.view(), t.v.view(), t.outputs, t.options);
  if (!r.status.ok) return r;
  const Options& o = c.options;
  const int64_t dv = c.value_dim();

  if (!c.rows.empty()) {
    r.rows = c.rows;
  } else {
    // The oracle reads every element through a dtype switch (a few ns each); past ~3e7 element
    // reads per run a sample of rows keeps the suite fast and still covers every tile edge.
    const int64_t kv_total = c.skv + (c.has_prior ? c.s_prior : 0);
    const double cost = static_cast<double>(c.bs) * c.sq * kv_total * (c.d + dv);
    r.rows = cost <= 3e7 ? sample_rows(c.sq, c.sq, 0) : sample_rows(c.sq, 40, c.seed);
  }

  // Read the kernel's outputs on the compared rows, in the reference's layout.
  const int64_t nr = static_cast<int64_t>(r.rows.size());
  reference::Result& kr = r.kernel;
  kr.batch = c.bs;
  kr.seqlen_q = nr;
  kr.value_dim = dv;
  kr.out.resize(c.bs * nr * dv);
  kr.neg_max.assign(c.bs * nr, 0);
  kr.sum_recip.assign(c.bs * nr, 0);
  kr.lse.assign(c.bs * nr, 0);
  auto stat = [&](const HostTensor& s, int64_t b, int64_t i) {
    return c.stats == StatsLayout::kNeuron ? s.get(b, i % 128, i / 128) : s.get(b, i);
  };
  for (int64_t b = 0; b < c.bs; ++b) {
    for (int64_t ri = 0; ri < nr; ++ri) {
      const int64_t i = r.rows[ri];
      for (int64_t ch = 0; ch < dv; ++ch) {
        kr.out[(b * nr + ri) * dv + ch] = o.tp_out ? t.out.get(b, ch, i) : t.out.get(b, i, ch);
      }
      if (c.stats != StatsLayout::kNone) {
        kr.neg_max[b * nr + ri] = stat(t.neg_max, b, i);
        kr.sum_recip[b * nr + ri] = stat(t.sum_recip, b, i);
      }
      if (c.lse) kr.lse[b * nr + ri] = t.lse.get(b, i);
    }
  }

  // Every output element of every row (compared or not) must have been written with a number.
  auto all_numbers = [](const HostTensor& h) {
    const auto& s = h.shape();
    for (int64_t a = 0; a < s[0]; ++a)
      for (int64_t b = 0; b < (s.size() > 1 ? s[1] : 1); ++b)
        for (int64_t d = 0; d < (s.size() > 2 ? s[2] : 1); ++d) {
          if (std::isnan(h.get(a, b, d))) return false;
        }
    return true;
  };
  std::vector<const HostTensor*> outs = {&t.out};
  if (c.stats != StatsLayout::kNone) {
    outs.push_back(&t.neg_max);
    outs.push_back(&t.sum_recip);
  }
  if (c.lse) outs.push_back(&t.lse);
  for (const HostTensor* h : outs) {
    r.outputs_written = r.outputs_written && all_numbers(*h);
    r.gaps_intact = r.gaps_intact && h->gaps_intact();
    r.raw.insert(r.raw.end(), h->bytes().begin(), h->bytes().end());
  }

  if (skip_reference) return r;
  const Status s =
      reference::attention_rows(t.q.view(), t.k.view(), t.v.view(), t.options, r.rows, &r.exact);
  if (!s.ok) {
    r.status = s;
    return r;
  }
  if (c.dtype != DType::kFloat32) {
    const Status sp = reference::attention_plain_rows(t.q.view(), t.k.view(), t.v.view(), t.options,
                                                      r.rows, &r.plain);
    if (!sp.ok) r.status = sp;
  }
  return r;
}

// Tolerances.
//
// out, float32 inputs: |kernel - exact| <= 1e-5 * max|exact| (the rule; a float32 flash
// kernel sits orders of magnitude inside it).
//
// out, bfloat16/float16 inputs (FlashAttention's rule): the kernel may be off by at most twice
// what a plain same-precision implementation is (reference::attention_plain, E_plain = its max
// error against float64), plus a floor of u * max|exact|, u the dtype's unit roundoff (2^-8 for
// bfloat16, 2^-11 for float16). Why that floor: the kernel has to round its result to the output
// dtype at least once, which alone costs up to u * |exact|, while the plain implementation can
// land exactly by luck when a row has one key or a constant row (E_plain = 0); one rounding of the
// largest output is the least any dtype-output kernel needs. The absolute rule
// |a - b| <= 1e-5 + 2e-2 * max|exact| caps the bound in every case.
//
// Statistics (float32 outputs). L = max(1, the largest |max logit| and |lse| of the rows) is the
// magnitude of the logits; an error e in a logit moves neg_max and lse by e and sum_recip by a
// factor exp(+-e) (relative e per error in max or score). Float32: tol_S = 1e-5 * L. Low
// precision: tol_S = 2 * (the plain implementation's error on neg_max / lse) + u * L (same rule
// as the output). Then |neg_max err| <= tol_S, |lse err| <= tol_S + 1e-5 (the float32 sum under
// the log), |sum_recip err| <= (2 tol_S + 1e-5) * sum_recip. Infinite reference values (empty
// rows) must be matched exactly, and such rows must output exactly 0.
::testing::AssertionResult compare(const Case& c, const Outcome& o) {
  if (!o.status.ok) return ::testing::AssertionFailure() << "status: " << o.status.message;
  Mismatches bad;
  if (!o.outputs_written) bad.add("an output element was left unwritten or is NaN");
  if (!o.gaps_intact) bad.add("bytes outside an output view were written");

  const reference::Result& k = o.kernel;
  const reference::Result& e = o.exact;
  const bool low = c.dtype != DType::kFloat32;
  const double u = unit_roundoff(c.dtype);
  const int64_t nr = static_cast<int64_t>(o.rows.size());
  const int64_t dv = c.value_dim();

  const double m = max_abs(e.out);
  double tol;
  if (low) {
    tol = std::min(2 * max_err(o.plain.out, e.out) + u * m, 1e-5 + 2e-2 * m);
  } else {
    tol = 1e-5 * m;
  }
  double worst = 0;
  for (int64_t b = 0; b < c.bs; ++b) {
    for (int64_t ri = 0; ri < nr; ++ri) {
      const int64_t row = b * nr + ri;
      const bool empty = std::isinf(e.neg_max[row]);
      for (int64_t ch = 0; ch < dv; ++ch) {
        const double kv = k.out[row * dv + ch], ev = e.out[row * dv + ch];
        const double err = std::fabs(kv - ev);
        if (!(err <= tol) || (empty && kv != 0.0)) {
          bad.add("out[b=" + std::to_string(b) + ", i=" + std::to_string(o.rows[ri]) +
                  ", c=" + std::to_string(ch) + "] = " + fmt(kv) + ", reference " + fmt(ev) +
                  (empty ? " (empty row: must be exactly 0)" : ", tolerance " + fmt(tol)));
        }
        if (std::isfinite(err)) worst = std::max(worst, err);
      }
    }
  }

  const bool have_stats = c.stats != StatsLayout::kNone;
  if (have_stats || c.lse) {
    const double logits = std::max({1.0, max_abs(e.neg_max), max_abs(e.lse)});
    double tol_s = 1e-5 * logits;
    if (low) {
      tol_s = 2 * std::max(max_err(o.plain.neg_max, e.neg_max), max_err(o.plain.lse, e.lse)) +
              u * logits;
    }
    auto check = [&](const char* name, const std::vector<double>& kv, const std::vector<double>& ev,
                     bool relative, double t) {
      for (int64_t b = 0; b < c.bs; ++b) {
        for (int64_t ri = 0; ri < nr; ++ri) {
          const double a = kv[b * nr + ri], x = ev[b * nr + ri];
          const double lim = relative ? t * std::fabs(x) : t;
          const bool ok = std::isinf(x) ? a == x : std::isfinite(a) && std::fabs(a - x) <= lim;
          if (!ok) {
            bad.add(std::string(name) + "[b=" + std::to_string(b) + ", i=" +
                    std::to_string(o.rows[ri]) + "] = " + fmt(a) + ", reference " + fmt(x) +
                    (std::isinf(x) ? " (an empty row: must match exactly)"
                                   : ", tolerance " + fmt(lim)));
          }
        }
      }
    };
    if (have_stats) {
      check("neg_max", k.neg_max, e.neg_max, false, tol_s);
      check("sum_recip", k.sum_recip, e.sum_recip, true, 2 * tol_s + 1e-5);
    }
    if (c.lse) check("lse", k.lse, e.lse, false, tol_s + 1e-5);
  }

  if (!bad.empty()) {
    return ::testing::AssertionFailure()
           << c.describe() << "\n"
           << bad.str() << "  max|ref| = " << fmt(m) << ", worst out error = " << fmt(worst);
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult check_case(const Case& c) { return compare(c, run_case(c)); }

bool long_tests_enabled() {
  const char* env = std::getenv("FLASHCTE_LONG_TESTS");
  return env != nullptr && std::string(env) == "1";
}

TileConfig neuron_tiles() { return TileConfig{128, 512, 8192, 10240}; }
TileConfig odd_tiles() { return TileConfig{5, 24, 48, 0}; }

double abs_error(double got, double want) {
  if (std::isfinite(got) && std::isfinite(want)) return std::fabs(got - want);
  const bool same = got == want || (std::isnan(got) && std::isnan(want));
  return same ? 0.0 : std::numeric_limits<double>::infinity();
}

double max_abs_diff(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, abs_error(got[i], want[i]));
  return m;
}

::testing::AssertionResult within_plain_error(const std::vector<double>& got,
                                              const std::vector<double>& plain,
                                              const std::vector<double>& exact, double factor,
                                              double floor) {
  const double err = max_abs_diff(got, exact), plain_err = max_abs_diff(plain, exact);
  if (!std::isfinite(plain_err)) {
    return ::testing::AssertionFailure() << "the plain implementation's error is " << plain_err;
  }
  const double bound = factor * plain_err + floor;
  if (err <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "error " << err << " > " << factor << " x plain error " << plain_err << " + " << floor;
}

::testing::AssertionResult refused_for(const Status& s, const std::string& argument) {
  if (s.ok) return ::testing::AssertionFailure() << "accepted; expected an error on " << argument;
  if (s.message.rfind(argument + ":", 0) != 0) {
    return ::testing::AssertionFailure()
           << "message \"" << s.message << "\" does not start with \"" << argument << ":\"";
  }
  // Every dtype rule reads "<argument>: dtype ..." and is of kind kDtype (Python's TypeError).
  const bool dtype_rule = s.message.find(": dtype") != std::string::npos;
  if (dtype_rule != (s.kind == ErrorKind::kDtype)) {
    return ::testing::AssertionFailure()
           << "message \"" << s.message << "\" has kind " << static_cast<int>(s.kind)
           << (dtype_rule ? ", not kDtype" : ", kDtype for a rule that is not a dtype's");
  }
  return ::testing::AssertionSuccess() << s.message;
}

}  // namespace flashcte::test
