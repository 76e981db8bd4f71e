// The base case of attention_cte's one-axis tests (attention_test.cc, attention_layout_test.cc):
// the three activation dtypes and a case of given lengths and head dim, seeded by its shape.
#ifndef FLASHCTE_TESTS_ATTENTION_CASES_H_
#define FLASHCTE_TESTS_ATTENTION_CASES_H_

#include <cstdint>

#include "tests/test_util.h"

namespace flashcte::test {

inline constexpr DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

inline Case base_case(DType dt, int64_t sq, int64_t skv, int64_t d) {
  Case c;
  c.dtype = dt;
  c.sq = sq;
  c.skv = skv;
  c.d = d;
  c.seed = static_cast<uint64_t>(sq * 1000003 + skv * 1009 + d);
  return c;
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_ATTENTION_CASES_H_
