// Every SIMD target this machine can run, not only the best one: the kernel's Highway dispatch
// follows hwy::SetSupportedTargetsForTest, so each target's micro-kernels meet the oracle here.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <string>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// A handful of cases that between them reach every micro-kernel edge: ragged row blocks and
// column tails (odd tiles), head dims below / between / above vector widths, masks, sinks,
// the bf16 rounding of P and every dtype conversion.
std::vector<Case> target_cases() {
  std::vector<Case> cases;
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (int64_t d : {1, 7, 16, 59, 128}) {
      Case c;
      c.dtype = dt;
      c.bs = 2;
      c.sq = 53;
      c.skv = 101;
      c.d = d;
      c.dv = d == 59 ? 33 : d;
      c.dist = Dist::kNormal;
      c.options.scale = 0.3f;
      c.sink = d == 16;
      c.sink_lo = -1;
      c.sink_hi = 1;
      c.options.sliding_window = d == 7 ? 20 : 0;
      c.stats = StatsLayout::kRowMajor;
      c.lse = true;
      c.seed = static_cast<uint64_t>(d);
      cases.push_back(c);
      c.options.tiles = odd_tiles();
      cases.push_back(c);
    }
  }
  return cases;
}

TEST(SimdTargets, EveryTargetMatchesReference) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  std::vector<std::string> seen;
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    const std::string name = simd_target();
    seen.push_back(name);
    for (const Case& c : target_cases()) {
      EXPECT_TRUE(check_case(c)) << "target " << hwy::TargetName(target) << " (kernel reports "
                                 << name << ")";
    }
  }
  hwy::SetSupportedTargetsForTest(0);
  // Each target really ran: the kernel reported as many distinct targets as were set.
  for (size_t i = 1; i < seen.size(); ++i) EXPECT_NE(seen[i], seen[i - 1]);
}

}  // namespace
}  // namespace flashcte::test
