// Every SIMD target this machine can run, not only the best one: the kernel's Highway dispatch
// follows hwy::SetSupportedTargetsForTest, so each target's micro-kernels meet the oracle here.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <string>
#include <vector>

#include "src/simd/native_ops.h"
#include "src/simd/ops.h"
#include "tests/cpu_requirements.h"
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

// bfloat16 inputs on both of the AVX-512 target's paths, native vdpbf16ps and widening to
// float32, whichever the automatic policy picks on this CPU, with tiles whose edges split key
// pairs. (The sections that fall back from native to widening, NaN/Inf values and subnormal
// inputs, are the Poisons and Numerics tests', which run under the automatic policy.)
TEST(SimdTargets, BothBf16PathsMatchReference) {
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  const bool native = simd::native_ops_for(simd::ops()) != nullptr;
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
  if (!native) {
    FLASHCTE_SKIP_UNLESS_REQUIRED(FastPath::kNativeKernels,
                                  "the native bf16 kernels are not offered: only widening ran");
  }
  for (simd::Bf16Dot policy : {simd::Bf16Dot::kNative, simd::Bf16Dot::kWiden}) {
    simd::set_bf16_dot_policy_for_test(policy);
    const char* name = policy == simd::Bf16Dot::kNative ? "native" : "widen";
    for (Case c : target_cases()) {
      if (c.dtype != DType::kBFloat16) continue;
      EXPECT_TRUE(check_case(c)) << name;
      c.options.causal_mask = true;
      c.options.tiles = TileConfig{};
      c.options.tiles.kv_tile = 21;  // odd tiles: key pairs straddle every tile edge
      c.options.tiles.q_block = 10;
      c.options.tiles.section = 63;  // and several sections
      EXPECT_TRUE(check_case(c)) << name << ", causal, 21-key tiles, 63-key sections";
    }
  }
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
}

}  // namespace
}  // namespace flashcte::test
