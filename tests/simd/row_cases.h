// for_each_row, the row micro-kernels' loop over every edge length and misalignment with
// canaries past the end, for the row testers (row_ops_test.cc, row_convert_test.cc).
#ifndef FLASHCTE_TESTS_SIMD_ROW_CASES_H_
#define FLASHCTE_TESTS_SIMD_ROW_CASES_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <sstream>

#include "src/simd/ops.h"
#include "tests/simd/tester.h"

namespace flashcte::test {

inline constexpr float kInf = std::numeric_limits<float>::infinity();

// Runs body(row, n, where) for every edge length and start misalignment 0..3 on a one-row
// buffer whose floats past n are canaries, then checks that none past n was written.
template <class Body>
inline void for_each_row(const simd::Ops& ops, const Body& body) {
  for (int64_t n : edge_lengths(ops.lanes)) {
    for (int64_t misalign = 0; misalign < 4; ++misalign) {
      std::ostringstream where;
      where << ops.target << ", n " << n << ", misalign " << misalign;
      SCOPED_TRACE(where.str());
      GuardedBuffer row(1, n + 2 * ops.lanes, misalign);
      body(row, n);
      EXPECT_EQ(row.untouched_outside(1, n), "") << "written past n";
    }
  }
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_SIMD_ROW_CASES_H_
