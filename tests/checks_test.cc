// The suite's comparison helpers (test_util.h) against planted faults: a NaN, an Inf where the
// reference is finite, a finite value where it is infinite. Every accuracy check of the suite
// folds its errors through abs_error, so these are what keeps a NaN from passing any of them.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(Checks, AbsErrorIsInfiniteOnEveryFinitenessMismatch) {
  EXPECT_EQ(abs_error(1.5, 1.0), 0.5);
  EXPECT_EQ(abs_error(-kInf, -kInf), 0.0);  // an empty row's lse
  EXPECT_EQ(abs_error(kNaN, kNaN), 0.0);    // a NaN input reaching the row on both sides
  for (double got : {kNaN, kInf, -kInf}) EXPECT_EQ(abs_error(got, 0.25), kInf) << got;
  for (double want : {kNaN, kInf, -kInf}) EXPECT_EQ(abs_error(0.25, want), kInf) << want;
  EXPECT_EQ(abs_error(kInf, -kInf), kInf);
  EXPECT_EQ(abs_error(kNaN, -kInf), kInf);
}

TEST(Checks, MaxAbsDiffSeesAPlantedNaNAnywhere) {
  const std::vector<double> want = {0.5, -kInf, 2.0, 3.0};
  EXPECT_EQ(max_abs_diff(want, want), 0.0);
  for (size_t i = 0; i < want.size(); ++i) {
    for (double planted : {kNaN, kInf, 7.0}) {
      std::vector<double> got = want;
      got[i] = planted;
      const double err = max_abs_diff(got, want);
      EXPECT_FALSE(err <= 1.0) << "planted " << planted << " at " << i << ": error " << err;
    }
  }
  EXPECT_EQ(max_abs_diff({1.0}, {1.0, 2.0}), kInf);  // a row missing altogether
}

TEST(Checks, WithinPlainErrorRejectsNaNInTheResultAndANaNBound) {
  const std::vector<double> exact = {1.0, 2.0, -kInf};
  const std::vector<double> plain = {1.01, 1.99, -kInf};
  EXPECT_TRUE(within_plain_error({1.02, 2.0, -kInf}, plain, exact, 3, 0));
  EXPECT_FALSE(within_plain_error({1.05, 2.0, -kInf}, plain, exact, 3, 0));
  EXPECT_FALSE(within_plain_error({kNaN, 2.0, -kInf}, plain, exact, 3, 0));
  EXPECT_FALSE(within_plain_error({1.0, 2.0, 0.0}, plain, exact, 3, 0));  // empty row written
  // A plain error that is not finite would make any result pass: refused.
  EXPECT_FALSE(within_plain_error(exact, {kNaN, 2.0, -kInf}, exact, 3, 0));
}

// compare(), the attention_cte suite's check, on a real outcome with one value replaced.
TEST(Checks, CompareRejectsAPlantedNaNInEveryOutput) {
  Case c;
  c.stats = StatsLayout::kRowMajor;
  c.lse = true;
  const Outcome clean = run_case(c);
  ASSERT_TRUE(compare(c, clean));
  const auto plant = [&](std::vector<double> reference::Result::*field, double value) {
    Outcome o = clean;
    ((o.kernel).*field)[3] = value;
    return compare(c, o);
  };
  for (double value : {kNaN, kInf}) {
    EXPECT_FALSE(plant(&reference::Result::out, value)) << value;
    EXPECT_FALSE(plant(&reference::Result::neg_max, value)) << value;
    EXPECT_FALSE(plant(&reference::Result::sum_recip, value)) << value;
    EXPECT_FALSE(plant(&reference::Result::lse, value)) << value;
  }
}

}  // namespace
}  // namespace flashcte::test
