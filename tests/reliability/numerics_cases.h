// The shared pieces of the numerical edge-case tests (numerics_test.cc,
// numerics_nonfinite_test.cc): the kernel run on edited tensors, its outputs read back as float64
// arrays, and the base case.
#ifndef FLASHCTE_TESTS_RELIABILITY_NUMERICS_CASES_H_
#define FLASHCTE_TESTS_RELIABILITY_NUMERICS_CASES_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

inline std::string dtype_label(DType d) { return dtype_name(d); }

// The kernel's outputs as plain arrays: out (bs, Sq, dv) whatever tp_out says; stats (bs, Sq).
struct Outputs64 {
  std::vector<double> out, neg_max, sum_recip, lse;
};

inline Outputs64 read_outputs(const Case& c, const CaseTensors& t) {
  Outputs64 r;
  const int64_t dv = c.value_dim();
  for (int64_t b = 0; b < c.bs; ++b) {
    for (int64_t i = 0; i < c.sq; ++i) {
      for (int64_t ch = 0; ch < dv; ++ch) {
        r.out.push_back(c.options.tp_out ? t.out.get(b, ch, i) : t.out.get(b, i, ch));
      }
      auto stat = [&](const HostTensor& s) {
        return c.stats == StatsLayout::kNeuron ? s.get(b, i % 128, i / 128) : s.get(b, i);
      };
      if (c.stats != StatsLayout::kNone) {
        r.neg_max.push_back(stat(t.neg_max));
        r.sum_recip.push_back(stat(t.sum_recip));
      }
      if (c.lse) r.lse.push_back(t.lse.get(b, i));
    }
  }
  return r;
}

inline Status run_kernel(CaseTensors& t) {
  return attention_cte(t.q.view(), t.k.view(), t.v.view(), t.outputs, t.options);
}

inline Case base_case(DType dtype) {
  Case c;
  c.dtype = dtype;
  c.bs = 2;
  c.bs_kv = 1;
  c.sq = 24;
  c.skv = 24;
  c.d = 8;
  c.options.num_threads = 2;
  return c;
}

inline constexpr DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_RELIABILITY_NUMERICS_CASES_H_
