// Every SIMD target this machine can run, not only the best one: the kernel's Highway dispatch
// follows hwy::SetSupportedTargetsForTest, so each target's micro-kernels meet the oracle here.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "src/simd/ops.h"
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

// The exp of the exp-and-sum pass against std::exp in double, lane by lane, on every target:
// x = s + bias over [-110, 0] (bias folded in as the kernel does), the underflow edge, -inf and
// NaN. float32 path: relative error within 2^-22 (2 to 4 ulp); bfloat16 path: the stored value is
// a bfloat16 within half a bfloat16 ulp (plus the polynomial's 2.8e-6) and the returned sum keeps
// float32 terms.
TEST(SimdTargets, ExpSumMatchesStdExp) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  std::vector<float> x;
  for (int i = 0; i <= 110000; ++i) x.push_back(-110.0f * static_cast<float>(i) / 110000.0f);
  for (float v : {0.0f, -0.0f, -1e-30f, -87.0f, std::nextafter(-87.0f, 0.0f),
                  std::nextafter(-87.0f, -kInf), -kInf}) {
    x.push_back(v);
  }
  const float bias = -0.75f;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const simd::Ops& ops = simd::ops();
    for (bool round_bf16 : {false, true}) {
      std::vector<float> in(x.size()), s(x.size());
      for (size_t i = 0; i < x.size(); ++i) s[i] = in[i] = x[i] - bias;
      const float sum = ops.exp_sum(s.data(), static_cast<int64_t>(s.size()), bias, round_bf16);
      double want_sum = 0.0;
      int bad = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const float xi = in[i] + bias;  // x as the kernel forms it
        const double want = xi < -87.0f ? 0.0 : std::exp(static_cast<double>(xi));
        want_sum += want;
        double tol = 2.0 * std::ldexp(want, -23);
        if (round_bf16) {
          uint32_t bits;
          std::memcpy(&bits, &s[i], sizeof bits);
          if ((bits & 0xFFFFu) != 0 && ++bad <= 5) ADD_FAILURE() << "not a bfloat16 at x = " << xi;
          tol = want * (std::ldexp(1.0, -8) + 3e-6);  // half ulp: 2^-8 relative at worst
        }
        if (!(std::abs(s[i] - want) <= tol) && ++bad <= 5) {
          ADD_FAILURE() << hwy::TargetName(target) << (round_bf16 ? " bf16" : " fp32") << ": exp("
                        << xi << ") = " << s[i] << ", want " << want;
        }
      }
      // The lanes above carry the accuracy; this checks that the sum adds up what was computed.
      // 1e-4: float32 accumulation over 110k terms (the scalar target's single accumulator
      // measured 1.04e-5).
      EXPECT_NEAR(sum, want_sum, want_sum * 1e-4) << hwy::TargetName(target);
      // NaN stays NaN, and so does the sum.
      std::vector<float> nan_row = {-1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f};
      for (int64_t n : {int64_t{3}, int64_t{2}}) {
        EXPECT_TRUE(std::isnan(ops.exp_sum(nan_row.data(), n, 0.0f, round_bf16)));
        EXPECT_TRUE(std::isnan(nan_row[1]));
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
}  // namespace flashcte::test
