// Table tests of the strategy deciders (include/flashcte/strategy.h). The expected strategies of
// neuron_strategy and nxdi_strategy were worked out by hand from the text of
// shared/spec/SEMANTICS.md ("Strategy dispatch"), not by running the code; each row says which
// rule it exercises. cpu_strategy is checked for the structure of its decision (what may never
// take the materialized path, thread counts, errors) and for shapes well on each side of the
// measured crossover.
#include "flashcte/strategy.h"

#include <gtest/gtest.h>

#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace flashcte {
namespace {

// gtest only (the suite does not link gmock): substring checks by hand.
::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << text << "' does not contain '" << part << "'";
}

using NS = NeuronStrategy;

struct NeuronCase {
  int64_t d, q, lnc;
  bool custom_scale;
  int64_t batch_heads;
  NS expected;
  const char* rule;  // the rule that decides last, as named in the reason ("rule 5" on demotion)
};

std::ostream& operator<<(std::ostream& os, const NeuronCase& c) {
  return os << "d=" << c.d << " q=" << c.q << " lnc=" << c.lnc << " custom_scale=" << c.custom_scale
            << " batch*heads=" << c.batch_heads << " -> " << strategy_name(c.expected);
}

class NeuronStrategyTest : public ::testing::TestWithParam<NeuronCase> {};

TEST_P(NeuronStrategyTest, MatchesSemantics) {
  const NeuronCase& c = GetParam();
  NeuronStrategyInputs in;
  in.head_dim = c.d;
  in.seqlen_q = c.q;
  in.logical_cores = c.lnc;
  in.custom_qk_scale = c.custom_scale;
  in.batch_heads = c.batch_heads;
  NeuronDecision out;
  const Status s = neuron_strategy(in, &out);
  ASSERT_TRUE(s.ok) << s.message;
  EXPECT_EQ(strategy_name(out.strategy), std::string(strategy_name(c.expected)));
  EXPECT_TRUE(Contains(out.reason, c.rule));
  if (std::string(c.rule) != "rule 5") {
    EXPECT_FALSE(Contains(out.reason, "rule 5"));
  }
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(Table, NeuronStrategyTest, ::testing::Values(
    // Rule 1: a custom qk_scale -> NONE, whatever the shape; rule 5 leaves NONE alone.
    NeuronCase{128, 8192, 1, true, 1, NS::kNone, "rule 1"},
    NeuronCase{128, 4096, 2, true, 2, NS::kNone, "rule 1"},
    NeuronCase{256, 4096, 2, true, 2, NS::kNone, "rule 1"},
    NeuronCase{128, 4096, 2, true, 3, NS::kNone, "rule 1"},
    // Rule 2, d > 128 and lnc > 1: LARGE_D_SHARDED iff q >= 2048 and q % 2048 == 0.
    NeuronCase{256, 2048, 2, false, 2, NS::kLargeDShardedKernel, "rule 2"},   // boundary
    NeuronCase{256, 4096, 2, false, 2, NS::kLargeDShardedKernel, "rule 2"},
    NeuronCase{256, 6144, 2, false, 2, NS::kLargeDShardedKernel, "rule 2"},
    NeuronCase{256, 1024, 2, false, 2, NS::kNone, "rule 2"},                  // q < 2048
    NeuronCase{256, 2047, 2, false, 2, NS::kNone, "rule 2"},
    NeuronCase{256, 3072, 2, false, 2, NS::kNone, "rule 2"},                  // 3072 % 2048 != 0
    NeuronCase{256, 0, 2, false, 2, NS::kNone, "rule 2"},
    NeuronCase{129, 2048, 2, false, 2, NS::kLargeDShardedKernel, "rule 2"},   // first d > 128
    NeuronCase{512, 4096, 4, false, 8, NS::kLargeDShardedKernel, "rule 2"},
    // Quirks kept: neither d % 128 == 0 nor d <= 512 is checked.
    NeuronCase{192, 2048, 2, false, 2, NS::kLargeDShardedKernel, "rule 2"},
    NeuronCase{576, 4096, 2, false, 2, NS::kLargeDShardedKernel, "rule 2"},
    // Rule 2, d > 128 and lnc == 1: LARGE_D_UNSHARDED iff q >= 4096 and q % 2048 == 0.
    NeuronCase{256, 4096, 1, false, 1, NS::kLargeDUnshardedKernel, "rule 2"}, // boundary
    NeuronCase{256, 6144, 1, false, 3, NS::kLargeDUnshardedKernel, "rule 2"},
    NeuronCase{256, 2048, 1, false, 1, NS::kNone, "rule 2"},                  // % ok, q < 4096
    NeuronCase{256, 4095, 1, false, 1, NS::kNone, "rule 2"},
    NeuronCase{256, 5120, 1, false, 1, NS::kNone, "rule 2"},                  // 5120 % 2048 != 0
    NeuronCase{192, 8192, 1, false, 1, NS::kLargeDUnshardedKernel, "rule 2"}, // quirk: d % 128
    NeuronCase{576, 4096, 1, false, 1, NS::kLargeDUnshardedKernel, "rule 2"}, // quirk: d > 512
    // Rule 3, d <= 128 and lnc > 1: NONE if q < 1024, SHARDED if q % 1024 == 0, else NONE.
    NeuronCase{128, 512, 2, false, 2, NS::kNone, "rule 3"},
    NeuronCase{128, 1023, 2, false, 2, NS::kNone, "rule 3"},
    NeuronCase{128, 1024, 2, false, 2, NS::kShardedKernel, "rule 3"},         // boundary
    NeuronCase{128, 2048, 2, false, 2, NS::kShardedKernel, "rule 3"},
    NeuronCase{128, 4096, 2, false, 32, NS::kShardedKernel, "rule 3"},
    NeuronCase{128, 1536, 2, false, 2, NS::kNone, "rule 3"},                  // q % 1024 != 0
    NeuronCase{128, 4095, 2, false, 2, NS::kNone, "rule 3"},
    NeuronCase{64, 3072, 4, false, 8, NS::kShardedKernel, "rule 3"},
    NeuronCase{64, 0, 2, false, 2, NS::kNone, "rule 3"},
    // d = 128 is not "large": rules 3 and 4, not rule 2.
    NeuronCase{128, 2048, 1, false, 1, NS::kNone, "rule 4"},
    // Rule 4, d <= 128 and lnc == 1: UNSHARDED iff q >= 4096 (no divisibility condition).
    NeuronCase{128, 4096, 1, false, 1, NS::kUnshardedKernel, "rule 4"},       // boundary
    NeuronCase{128, 4095, 1, false, 1, NS::kNone, "rule 4"},
    NeuronCase{128, 4097, 1, false, 1, NS::kUnshardedKernel, "rule 4"},
    NeuronCase{64, 1024, 1, false, 1, NS::kNone, "rule 4"},
    NeuronCase{64, 16384, 1, false, 7, NS::kUnshardedKernel, "rule 4"},       // lnc 1 divides all
    NeuronCase{128, 0, 1, false, 1, NS::kNone, "rule 4"},
    // Rule 5: batch*heads not divisible by lnc. SHARDED -> UNSHARDED if q >= 4096, else NONE.
    NeuronCase{128, 4096, 2, false, 3, NS::kUnshardedKernel, "rule 5"},
    NeuronCase{128, 8192, 2, false, 1, NS::kUnshardedKernel, "rule 5"},
    NeuronCase{128, 2048, 2, false, 3, NS::kNone, "rule 5"},
    NeuronCase{128, 1024, 2, false, 1, NS::kNone, "rule 5"},
    NeuronCase{128, 8192, 4, false, 6, NS::kUnshardedKernel, "rule 5"},      // 6 % 4 != 0
    NeuronCase{128, 8192, 4, false, 8, NS::kShardedKernel, "rule 3"},        // 8 % 4 == 0
    // LARGE_D_SHARDED -> LARGE_D_UNSHARDED, without re-checking q >= 4096 (quirk kept).
    NeuronCase{256, 2048, 2, false, 3, NS::kLargeDUnshardedKernel, "rule 5"},
    NeuronCase{256, 4096, 2, false, 5, NS::kLargeDUnshardedKernel, "rule 5"},
    // Rule 5 does not touch NONE.
    NeuronCase{256, 1024, 2, false, 3, NS::kNone, "rule 2"},
    NeuronCase{128, 1536, 2, false, 3, NS::kNone, "rule 3"},
    NeuronCase{128, 512, 2, false, 1, NS::kNone, "rule 3"}),
    [](const ::testing::TestParamInfo<NeuronCase>& param_info) {
      const NeuronCase& c = param_info.param;
      return "d" + std::to_string(c.d) + "_q" + std::to_string(c.q) + "_lnc" +
             std::to_string(c.lnc) + "_bh" + std::to_string(c.batch_heads) +
             (c.custom_scale ? "_customscale" : "");
    });
// clang-format on

TEST(NeuronStrategy, RejectsInputsPythonCannotTake) {
  NeuronDecision out;
  out.reason = "untouched";
  NeuronStrategyInputs in;
  in.seqlen_q = 4096;
  in.logical_cores = 0;  // rule 5 would divide by zero
  Status s = neuron_strategy(in, &out);
  EXPECT_FALSE(s.ok);
  EXPECT_TRUE(Contains(s.message, "logical_cores"));
  EXPECT_EQ(out.reason, "untouched");
  in.logical_cores = 1;
  in.head_dim = 0;
  EXPECT_TRUE(Contains(neuron_strategy(in, &out).message, "head_dim"));
  in.head_dim = 128;
  in.seqlen_q = -1;
  EXPECT_TRUE(Contains(neuron_strategy(in, &out).message, "seqlen_q"));
  in.seqlen_q = 4096;
  in.batch_heads = 0;
  EXPECT_TRUE(Contains(neuron_strategy(in, &out).message, "batch_heads"));
  EXPECT_FALSE(neuron_strategy(NeuronStrategyInputs{}, nullptr).ok);
}

using XS = NxdiStrategy;

struct NxdiCase {
  std::optional<bool> enabled;
  int64_t cp;
  bool strided;
  int64_t window, lnc, q, d;
  bool mask;
  XS expected;
};

std::ostream& operator<<(std::ostream& os, const NxdiCase& c) {
  return os << "enabled=" << (c.enabled ? (*c.enabled ? "true" : "false") : "default")
            << " cp=" << c.cp << " strided=" << c.strided << " window=" << c.window
            << " lnc=" << c.lnc << " q=" << c.q << " d=" << c.d << " mask=" << c.mask << " -> "
            << strategy_name(c.expected);
}

class NxdiStrategyTest : public ::testing::TestWithParam<NxdiCase> {};

TEST_P(NxdiStrategyTest, MatchesSemantics) {
  const NxdiCase& c = GetParam();
  NxdiStrategyInputs in;
  in.attn_kernel_enabled = c.enabled;
  in.cp_degree = c.cp;
  in.strided_cp_enabled = c.strided;
  in.sliding_window = c.window;
  in.logical_cores = c.lnc;
  in.seqlen_q = c.q;
  in.head_dim = c.d;
  in.attention_mask = c.mask;
  NxdiDecision out;
  const Status s = nxdi_strategy(in, &out);
  ASSERT_TRUE(s.ok) << s.message;
  EXPECT_EQ(strategy_name(out.strategy), std::string(strategy_name(c.expected)));
  EXPECT_FALSE(out.reason.empty());
}

constexpr std::optional<bool> kDefault = std::nullopt;

// clang-format off
INSTANTIATE_TEST_SUITE_P(Table, NxdiStrategyTest, ::testing::Values(
    //       enabled   cp strided window lnc  q     d    mask
    // Kernel disabled -> NONE, before anything else.
    NxdiCase{false,     1, false,   0,   2, 4096, 128, false, XS::kNone},
    NxdiCase{false,     4, true,    0,   2, 4096, 128, true,  XS::kNone},
    NxdiCase{false,     1, false,   0,   1, 8192, 128, false, XS::kNone},
    // cp > 1: the CP kernel only with lnc >= 2 and q > d; strided when enabled and no window.
    NxdiCase{kDefault,  2, false,   0,   2, 1024, 128, false, XS::kContextParallel},
    NxdiCase{kDefault,  2, false,   0,   1, 1024, 128, false, XS::kNone},       // lnc 1
    NxdiCase{true,      4, true,    0,   1, 4096, 128, false, XS::kNone},       // lnc 1, strided
    NxdiCase{kDefault,  2, true,    0,   2, 1024, 128, false, XS::kStridedContextParallel},
    NxdiCase{kDefault,  2, true,  128,   2, 1024, 128, false, XS::kContextParallel},  // window
    NxdiCase{kDefault,  2, false, 128,   2, 1024, 128, false, XS::kContextParallel},
    NxdiCase{kDefault,  2, false,   0,   2,  128, 128, false, XS::kNone},       // q == d
    NxdiCase{kDefault,  2, false,   0,   2,  129, 128, false, XS::kContextParallel},  // q > d
    NxdiCase{kDefault,  2, true,    0,   2,   64, 128, false, XS::kNone},       // q < d
    NxdiCase{kDefault, 16, true,    0,   2,   65,  64, false, XS::kStridedContextParallel},
    NxdiCase{kDefault,  8, false,   0,   4,  512, 128, false, XS::kContextParallel},
    // cp > 1 decides before the mask rule (q = 1000 would fail it).
    NxdiCase{true,      2, false,   0,   2, 1000, 128, true,  XS::kContextParallel},
    NxdiCase{true,      2, false,   0,   2,  100, 128, true,  XS::kNone},
    // lnc > 1 with a mask: SHARDED iff (q >= 1024 and q % 512 == 0) or (q < 1024 and q % 256 == 0).
    NxdiCase{kDefault,  1, false,   0,   2,  512, 128, true,  XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2,  768, 128, true,  XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2, 1024, 128, true,  XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2, 1536, 128, true,  XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2,  256, 128, true,  XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2, 2560, 128, true,  XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2,  128, 128, true,  XS::kNone},       // < 1024, % 256
    NxdiCase{kDefault,  1, false,   0,   2,  640, 128, true,  XS::kNone},       // 640 % 256 = 128
    NxdiCase{kDefault,  1, false,   0,   2, 1000, 128, true,  XS::kNone},
    NxdiCase{kDefault,  1, false,   0,   2, 1280, 128, true,  XS::kNone},       // 1280 % 512 = 256
    NxdiCase{kDefault,  1, false,   0,   2, 1792, 128, true,  XS::kNone},       // 1792 % 512 = 256
    NxdiCase{true,      1, false,   0,   4, 1280, 128, true,  XS::kNone},       // explicit: no help
    // lnc > 1 without a mask: always SHARDED.
    NxdiCase{kDefault,  1, false,   0,   2,    1, 128, false, XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2, 1000, 128, false, XS::kSharded},
    NxdiCase{kDefault,  1, false,   0,   2, 1280, 128, false, XS::kSharded},
    NxdiCase{kDefault,  1, false, 512,   2, 1536, 256, false, XS::kSharded},
    // lnc == 1: UNSHARDED if q >= 4096, or explicitly enabled and q >= 512; else NONE.
    NxdiCase{kDefault,  1, false,   0,   1, 4096, 128, false, XS::kUnsharded},
    NxdiCase{kDefault,  1, false,   0,   1, 4095, 128, false, XS::kNone},
    NxdiCase{kDefault,  1, false,   0,   1,  512, 128, false, XS::kNone},
    NxdiCase{true,      1, false,   0,   1,  512, 128, false, XS::kUnsharded},
    NxdiCase{true,      1, false,   0,   1,  511, 128, false, XS::kNone},
    NxdiCase{true,      1, false,   0,   1, 4096, 128, false, XS::kUnsharded},
    NxdiCase{kDefault,  1, false,   0,   1, 8192, 128, true,  XS::kUnsharded},  // mask: lnc>1 only
    NxdiCase{true,      1, false,   0,   1, 1000, 128, true,  XS::kUnsharded},
    NxdiCase{kDefault,  1, true,    0,   1, 8192, 128, false, XS::kUnsharded}),  // cp 1: no CP
    [](const ::testing::TestParamInfo<NxdiCase>& param_info) {
      const NxdiCase& c = param_info.param;
      return std::string(c.enabled ? (*c.enabled ? "enabled" : "disabled") : "default") + "_cp" +
             std::to_string(c.cp) + (c.strided ? "_strided" : "") + "_sw" +
             std::to_string(c.window) + "_lnc" + std::to_string(c.lnc) + "_q" +
             std::to_string(c.q) + "_d" + std::to_string(c.d) + (c.mask ? "_mask" : "");
    });
// clang-format on

TEST(NxdiStrategy, ReasonsSayWhyStridedWasNotUsed) {
  NxdiStrategyInputs in;
  in.cp_degree = 2;
  in.strided_cp_enabled = true;
  in.sliding_window = 128;
  in.logical_cores = 2;
  in.seqlen_q = 1024;
  NxdiDecision out;
  ASSERT_TRUE(nxdi_strategy(in, &out).ok);
  EXPECT_EQ(out.strategy, NxdiStrategy::kContextParallel);
  EXPECT_TRUE(Contains(out.reason, "sliding window 128"));
}

TEST(NxdiStrategy, RejectsImpossibleInputs) {
  NxdiDecision out;
  NxdiStrategyInputs in;
  in.seqlen_q = 4096;
  in.logical_cores = 0;
  EXPECT_TRUE(Contains(nxdi_strategy(in, &out).message, "logical_cores"));
  in.logical_cores = 1;
  in.cp_degree = 0;
  EXPECT_TRUE(Contains(nxdi_strategy(in, &out).message, "cp_degree"));
  in.cp_degree = 1;
  in.head_dim = 0;
  EXPECT_TRUE(Contains(nxdi_strategy(in, &out).message, "head_dim"));
  in.head_dim = 128;
  in.seqlen_q = -1;
  EXPECT_TRUE(Contains(nxdi_strategy(in, &out).message, "seqlen_q"));
  in.seqlen_q = 4096;
  in.sliding_window = -1;
  EXPECT_TRUE(Contains(nxdi_strategy(in, &out).message, "sliding_window"));
  in.sliding_window = 0;
  EXPECT_TRUE(nxdi_strategy(in, &out).ok);
  EXPECT_FALSE(nxdi_strategy(in, nullptr).ok);
}

TEST(StrategyNames, AreThePythonEnumMembers) {
  EXPECT_STREQ(strategy_name(NeuronStrategy::kNone), "NONE");
  EXPECT_STREQ(strategy_name(NeuronStrategy::kUnshardedKernel), "UNSHARDED_KERNEL");
  EXPECT_STREQ(strategy_name(NeuronStrategy::kShardedKernel), "SHARDED_KERNEL");
  EXPECT_STREQ(strategy_name(NeuronStrategy::kLargeDUnshardedKernel), "LARGE_D_UNSHARDED_KERNEL");
  EXPECT_STREQ(strategy_name(NeuronStrategy::kLargeDShardedKernel), "LARGE_D_SHARDED_KERNEL");
  EXPECT_STREQ(strategy_name(NxdiStrategy::kNone), "NONE");
  EXPECT_STREQ(strategy_name(NxdiStrategy::kUnsharded), "UNSHARDED_KERNEL");
  EXPECT_STREQ(strategy_name(NxdiStrategy::kSharded), "SHARDED_KERNEL");
  EXPECT_STREQ(strategy_name(NxdiStrategy::kContextParallel), "CONTEXT_PARALLEL_KERNEL");
  EXPECT_STREQ(strategy_name(NxdiStrategy::kStridedContextParallel),
               "STRIDED_CONTEXT_PARALLEL_KERNEL");
  EXPECT_STREQ(strategy_name(CpuStrategy::kNone), "NONE");
  EXPECT_STREQ(strategy_name(CpuStrategy::kKernel), "KERNEL");
}

CpuStrategyInputs PlainCpuInputs(int64_t length, int64_t d) {
  CpuStrategyInputs in;
  in.batch = 1;
  in.seqlen_q = length;
  in.seqlen_kv = length;
  in.head_dim = d;
  in.threads = 1;
  return in;
}

TEST(CpuStrategy, MaterializedOnlyForTinyPlainFloat32Heads) {
  CpuDecision out;
  // Well inside the measured region where the materialized path won (src/dispatch/strategy.cc).
  ASSERT_TRUE(cpu_strategy(PlainCpuInputs(8, 64), &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kNone) << out.reason;
  EXPECT_EQ(out.threads, 1);
  // Far beyond it, causal or not.
  ASSERT_TRUE(cpu_strategy(PlainCpuInputs(4096, 128), &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kKernel) << out.reason;
  CpuStrategyInputs in = PlainCpuInputs(4096, 128);
  in.causal = false;
  ASSERT_TRUE(cpu_strategy(in, &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kKernel) << out.reason;
  // A long side on either axis is enough.
  in = PlainCpuInputs(8, 64);
  in.seqlen_kv = 4096;
  ASSERT_TRUE(cpu_strategy(in, &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kKernel) << out.reason;
}

TEST(CpuStrategy, OutsideTheMeasuredClassAlwaysKernel) {
  struct Case {
    const char* what;
    void (*change)(CpuStrategyInputs*);
  };
  const Case cases[] = {
      {"a mode beyond plain attention", [](CpuStrategyInputs* in) { in->plain = false; }},
      {"bfloat16", [](CpuStrategyInputs* in) { in->dtype = DType::kBFloat16; }},
      {"float16", [](CpuStrategyInputs* in) { in->dtype = DType::kFloat16; }},
      {"grouped KV heads, Sq = 4",
       [](CpuStrategyInputs* in) {
         in->seqlen_q = 4;
         in->batch = 8;
         in->kv_batch = 2;
       }},
      {"d = 512", [](CpuStrategyInputs* in) { in->head_dim = 512; }},
      {"Sq = 1 with 8 heads",
       [](CpuStrategyInputs* in) {
         in->seqlen_q = 1;
         in->batch = 8;
       }},
      {"empty query", [](CpuStrategyInputs* in) { in->seqlen_q = 0; }},
      {"empty batch", [](CpuStrategyInputs* in) { in->batch = 0; }},
  };
  for (const Case& c : cases) {
    CpuStrategyInputs in = PlainCpuInputs(8, 64);
    c.change(&in);
    CpuDecision out;
    ASSERT_TRUE(cpu_strategy(in, &out).ok) << c.what;
    EXPECT_EQ(out.strategy, CpuStrategy::kKernel) << c.what << ": " << out.reason;
    EXPECT_GE(out.threads, 1) << c.what;
  }
}

TEST(CpuStrategy, ThreadCounts) {
  CpuDecision out;
  // The kernel never uses more threads than asked, and uses them when there is work for each.
  CpuStrategyInputs in = PlainCpuInputs(4096, 128);
  in.batch = 8;
  in.threads = 4;
  ASSERT_TRUE(cpu_strategy(in, &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kKernel);
  EXPECT_EQ(out.threads, 4);
  // One head of a few rows is one work item: one thread, whatever was asked.
  in = PlainCpuInputs(64, 64);
  in.plain = false;
  in.threads = 4;
  ASSERT_TRUE(cpu_strategy(in, &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kKernel);
  EXPECT_EQ(out.threads, 1);
  // The materialized path splits heads, not rows.
  in = PlainCpuInputs(8, 64);
  in.batch = 3;
  in.threads = 8;
  ASSERT_TRUE(cpu_strategy(in, &out).ok);
  EXPECT_EQ(out.strategy, CpuStrategy::kNone) << out.reason;
  EXPECT_EQ(out.threads, 3);
  // threads = 0 resolves to some positive count.
  in.threads = 0;
  ASSERT_TRUE(cpu_strategy(in, &out).ok);
  EXPECT_GE(out.threads, 1);
  EXPECT_LE(out.threads, 3);
}

// The kernel's thread count must be the one the library really uses, as plan_attention reports.
TEST(CpuStrategy, KernelThreadsMatchPlanAttention) {
  const auto shape_view = [](const std::vector<int64_t>& shape) {
    return TensorView::contiguous(nullptr, DType::kFloat32, shape);
  };
  struct Shape {
    int64_t batch, kv_batch, sq, skv, d;
    bool causal;
    int threads;
  };
  for (const Shape& c : {Shape{1, 1, 4096, 4096, 128, true, 2}, Shape{1, 1, 8, 8192, 64, false, 4},
                         Shape{32, 8, 512, 512, 128, true, 3}, Shape{2, 1, 100, 3000, 64, true, 8},
                         Shape{4, 4, 1, 20000, 128, false, 16}}) {
    CpuStrategyInputs in;
    in.batch = c.batch;
    in.kv_batch = c.kv_batch;
    in.seqlen_q = c.sq;
    in.seqlen_kv = c.skv;
    in.head_dim = c.d;
    in.causal = c.causal;
    in.threads = c.threads;
    CpuDecision out;
    ASSERT_TRUE(cpu_strategy(in, &out).ok);
    ASSERT_EQ(out.strategy, CpuStrategy::kKernel) << out.reason;
    Options o;
    o.causal_mask = c.causal;
    o.num_threads = c.threads;
    PlanSummary plan;
    const Status s =
        plan_attention(shape_view({c.batch, c.sq, c.d}), shape_view({c.kv_batch, c.d, c.skv}),
                       shape_view({c.kv_batch, c.skv, c.d}), o, &plan);
    ASSERT_TRUE(s.ok) << s.message;
    EXPECT_EQ(out.threads, plan.threads) << out.reason;
  }
}

TEST(CpuStrategy, RejectsImpossibleInputs) {
  CpuDecision out;
  CpuStrategyInputs in = PlainCpuInputs(8, 64);
  in.batch = -1;
  EXPECT_TRUE(Contains(cpu_strategy(in, &out).message, "batch"));
  in = PlainCpuInputs(8, 64);
  in.batch = 6;
  in.kv_batch = 4;
  EXPECT_TRUE(Contains(cpu_strategy(in, &out).message, "kv_batch"));
  in = PlainCpuInputs(8, 64);
  in.seqlen_kv = -1;
  EXPECT_TRUE(Contains(cpu_strategy(in, &out).message, "seqlen_kv"));
  in = PlainCpuInputs(8, 0);
  EXPECT_TRUE(Contains(cpu_strategy(in, &out).message, "head_dim"));
  in = PlainCpuInputs(8, 64);
  in.threads = -2;
  EXPECT_TRUE(Contains(cpu_strategy(in, &out).message, "threads"));
  EXPECT_FALSE(cpu_strategy(PlainCpuInputs(8, 64), nullptr).ok);
}

}  // namespace
}  // namespace flashcte
