// attention_cte against the float64 oracle, one axis of variation at a time: head dims, awkward
// lengths, prefix and window edges, context-parallel ranks at both ends, dtypes and input
// distributions, tilings, memory layouts, empty rows, and bitwise determinism across threads.
// (Scale, distributions, tilings, layouts and threads are in attention_layout_test.cc, the base
// case in attention_cases.h; pairwise combinations of modes are in grid_test.cc, the Neuron
// suite's shapes in neuron_suite_test.cc.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "tests/attention_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

std::string dtype_tag(DType dt) {
  switch (dt) {
    case DType::kFloat32:
      return "f32";
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "f16";
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;
  }
  return dtype_name(dt);
}

// ---- head dims -------------------------------------------------------------------------------

class HeadDimTest : public ::testing::TestWithParam<std::tuple<int64_t, DType, bool>> {};

TEST_P(HeadDimTest, MatchesReference) {
  const auto [d, dt, causal] = GetParam();
  Case c = base_case(dt, 71, 93, d);
  c.bs = 2;
  c.options.causal_mask = causal;
  c.options.scale = static_cast<float>(1 / std::sqrt(static_cast<double>(d)));
  c.stats = StatsLayout::kRowMajor;
  c.lse = true;
  EXPECT_TRUE(check_case(c));
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c));
}

INSTANTIATE_TEST_SUITE_P(HeadDims, HeadDimTest,
                         ::testing::Combine(::testing::Values(8, 59, 88, 127, 128),
                                            ::testing::ValuesIn(kDtypes), ::testing::Bool()),
                         [](const auto& param_info) {
                           return "d" + std::to_string(std::get<0>(param_info.param)) + "_" +
                                  dtype_tag(std::get<1>(param_info.param)) +
                                  (std::get<2>(param_info.param) ? "_causal" : "_full");
                         });

// dv != d (MLA-style heads: d 576, dv 512), a value dim of 1, the largest head dims.
TEST(ValueDim, DiffersFromHeadDim) {
  for (auto [d, dv] :
       {std::pair<int64_t, int64_t>{24, 40}, {40, 24}, {9, 1}, {1, 7}, {576, 512}, {1024, 1024}}) {
    Case c = base_case(DType::kFloat32, 45, 52, d);
    c.options.scale = static_cast<float>(1 / std::sqrt(static_cast<double>(d)));
    c.dv = dv;
    c.options.tp_out = dv % 2 == 0;
    EXPECT_TRUE(check_case(c));
    c.dtype = DType::kBFloat16;
    EXPECT_TRUE(check_case(c));
  }
}

// A GQA group whose output state outgrows one pass over the KV axis (attention.cc,
// kPassStateBytes: 4 MiB, 31 heads of 64 rows at dv 512): 33 heads over one KV head run in two
// passes (17 and 16), each seeded with its heads' sinks, whole and split over the KV axis
// (threads).
TEST(ValueDim, AGroupBeyondOnePassOfOutputState) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    Case c = base_case(dt, 64, 64, 576);
    c.dv = 512;
    c.bs = 33;
    c.bs_kv = 1;
    c.sink = true;
    c.sink_lo = -2;  // sinks that leave the keys most of the weight
    c.sink_hi = 2;
    c.lse = true;
    c.options.scale = static_cast<float>(1 / std::sqrt(192.0));
    c.options.causal_mask = true;
    c.has_prior = true;
    c.s_prior = 48;
    EXPECT_TRUE(check_case(c));
    c.options.num_threads = 1;
    EXPECT_TRUE(check_case(c));
  }
}

// ---- sequence lengths --------------------------------------------------------------------------

struct Lengths {
  int64_t sq, skv;
};

class LengthTest : public ::testing::TestWithParam<std::tuple<Lengths, bool, DType>> {};

TEST_P(LengthTest, MatchesReference) {
  const auto [len, causal, dt] = GetParam();
  Case c = base_case(dt, len.sq, len.skv, 32);
  c.options.causal_mask = causal;
  c.lse = true;
  EXPECT_TRUE(check_case(c)) << "auto tiles";
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c)) << "odd tiles";
  c.options.tiles = neuron_tiles();
  EXPECT_TRUE(check_case(c)) << "neuron tiles";
}

INSTANTIATE_TEST_SUITE_P(
    Lengths, LengthTest,
    ::testing::Combine(::testing::Values(Lengths{1, 1}, Lengths{1, 77}, Lengths{1, 600},
                                         Lengths{77, 1}, Lengths{100, 33}, Lengths{33, 100},
                                         Lengths{129, 129}, Lengths{127, 513}, Lengths{513, 127},
                                         Lengths{300, 1025}),
                       ::testing::Bool(), ::testing::ValuesIn(kDtypes)),
    [](const auto& param_info) {
      const Lengths l = std::get<0>(param_info.param);
      return "sq" + std::to_string(l.sq) + "_skv" + std::to_string(l.skv) +
             (std::get<1>(param_info.param) ? "_causal_" : "_full_") +
             dtype_tag(std::get<2>(param_info.param));
    });

// No keys at all: every row is empty (out 0, neg_max = sum_recip = +inf, lse = -inf), unless a
// sink fills it.
TEST(EmptyRows, NoKeysAtAll) {
  for (bool sink : {false, true}) {
    Case c = base_case(DType::kFloat32, 128, 0, 16);
    c.options.causal_mask = false;
    c.sink = sink;
    c.stats = StatsLayout::kNeuron;
    c.lse = true;
    EXPECT_TRUE(check_case(c)) << "sink " << sink;
  }
}

// A packed sequence with an empty KV range, with and without a sink, in every stats layout.
TEST(EmptyRows, EmptyPackedSequence) {
  for (DType dt : kDtypes) {
    for (bool sink : {false, true}) {
      Case c = base_case(dt, 256, 256, 24);
      c.pack_lengths = {60, 70, 126};
      c.pack_empty_sequence = true;
      c.sink = sink;
      c.sink_lo = 2;
      c.sink_hi = 6;
      c.stats = StatsLayout::kNeuron;
      c.lse = true;
      EXPECT_TRUE(check_case(c));
      c.stats = StatsLayout::kRowMajor;
      c.options.tiles = odd_tiles();
      EXPECT_TRUE(check_case(c));
    }
  }
}

// A sink of -inf carries no probability: rows are as without a sink, and a row with no key is
// the documented empty row (out 0, neg_max = sum_recip = +inf, lse = -inf).
TEST(EmptyRows, MinusInfinitySinkIsNoSink) {
  const double inf = std::numeric_limits<double>::infinity();
  Case c = base_case(DType::kFloat32, 128, 128, 16);
  c.bs = 2;
  c.pack_lengths = {40, 30, 58};
  c.pack_empty_sequence = true;
  c.sink_values = {-inf, 3.0};
  c.stats = StatsLayout::kRowMajor;
  c.lse = true;
  EXPECT_TRUE(check_case(c));
  c.options.tiles = odd_tiles();  // query blocks of 5: some lie wholly inside the empty sequence
  EXPECT_TRUE(check_case(c)) << "odd tiles";
}

// Zero-sized problems are valid calls that write nothing.
TEST(EmptyRows, ZeroSizedTensors) {
  Case c = base_case(DType::kFloat32, 0, 20, 8);
  c.lse = true;
  EXPECT_TRUE(check_case(c)) << "Sq = 0";
  c = base_case(DType::kBFloat16, 20, 20, 8);
  c.bs = c.bs_kv = 0;
  EXPECT_TRUE(check_case(c)) << "bs = bs_kv = 0";
}

// ---- extreme magnitudes ------------------------------------------------------------------------

// float16 subnormals (below 2^-14) must be decoded, and subnormal outputs encoded, not flushed.
TEST(Extremes, Float16Subnormals) {
  Case c = base_case(DType::kFloat16, 60, 75, 16);
  c.dist = Dist::kNormal;
  c.v_mult = std::ldexp(1.0, -18);  // |v| ~ 4e-6: subnormal, a few significant bits
  c.options.causal_mask = false;
  EXPECT_TRUE(check_case(c)) << "subnormal values";
  c.v_mult = 1;
  c.qk_mult = std::ldexp(1.0, -16);  // scores ~ 1e-8: q and k subnormal, softmax ~ uniform
  c.options.scale = 1e8f;            // brings the scores back to order 1
  EXPECT_TRUE(check_case(c)) << "subnormal q and k";
}

// Values near the float16 maximum (65504) and large bfloat16 / float32 magnitudes.
TEST(Extremes, LargeValues) {
  for (DType dt : kDtypes) {
    Case c = base_case(dt, 50, 64, 16);
    c.v_mult = 65000;  // uniform [0, 65000): outputs stay below the float16 maximum
    EXPECT_TRUE(check_case(c)) << dtype_name(dt);
    if (dt != DType::kFloat16) {
      c.v_mult = 1e30;
      EXPECT_TRUE(check_case(c)) << dtype_name(dt) << " v ~ 1e30";
    }
  }
}

// Logits of order +-50: rows are dominated by a few keys, and the running max moves by large
// steps between tiles (exp of the rescale factor underflows to 0).
TEST(Extremes, LargeLogits) {
  for (DType dt : kDtypes) {
    Case c = base_case(dt, 90, 230, 32);
    c.dist = Dist::kNormal;
    c.qk_mult = 3;
    c.options.causal_mask = false;
    c.lse = true;
    c.options.tiles = odd_tiles();
    EXPECT_TRUE(check_case(c)) << dtype_name(dt);
    c.options.tiles = TileConfig{};
    c.options.causal_mask = true;
    EXPECT_TRUE(check_case(c)) << dtype_name(dt);
  }
}

// ---- prefix caching ----------------------------------------------------------------------------

class PrefixTest : public ::testing::TestWithParam<std::tuple<std::vector<int64_t>, DType>> {};

TEST_P(PrefixTest, MatchesReference) {
  const auto [used, dt] = GetParam();
  Case c = base_case(dt, 90, 90, 40);
  c.bs = 4;
  c.bs_kv = 2;
  c.has_prior = true;
  c.s_prior = 77;
  c.options.prior_used_len = used;
  c.stats = StatsLayout::kRowMajor;
  EXPECT_TRUE(check_case(c)) << "causal";
  c.options.sliding_window = 50;  // reaches into the prior for the first rows only
  EXPECT_TRUE(check_case(c)) << "causal + window";
  c.options.causal_mask = false;
  c.options.sliding_window = 0;
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c)) << "not causal";
}

INSTANTIATE_TEST_SUITE_P(
    Used, PrefixTest,
    ::testing::Combine(::testing::Values(std::vector<int64_t>{}, std::vector<int64_t>{0},
                                         std::vector<int64_t>{1}, std::vector<int64_t>{76},
                                         std::vector<int64_t>{77}, std::vector<int64_t>{0, 77},
                                         std::vector<int64_t>{33, 5}),
                       ::testing::ValuesIn(kDtypes)),
    [](const auto& param_info) {
      std::string name = "used";
      const auto& used = std::get<0>(param_info.param);
      if (used.empty()) name += "_all";
      for (int64_t u : used) name += "_" + std::to_string(u);
      return name + "_" + dtype_tag(std::get<1>(param_info.param));
    });

// ---- sliding window ----------------------------------------------------------------------------

class WindowTest : public ::testing::TestWithParam<std::tuple<int64_t, bool, DType>> {};

TEST_P(WindowTest, MatchesReference) {
  const auto [window, causal, dt] = GetParam();
  Case c = base_case(dt, 150, 170, 32);
  c.options.sliding_window = window;
  c.options.causal_mask = causal;
  c.lse = true;
  EXPECT_TRUE(check_case(c));
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c));
  c.has_prior = true;  // the window reaches back into the prior
  c.s_prior = 40;
  c.options.prior_used_len = {31};
  EXPECT_TRUE(check_case(c)) << "with prefix";
}

INSTANTIATE_TEST_SUITE_P(Windows, WindowTest,
                         ::testing::Combine(::testing::Values(1, 2, 23, 128, 169, 1000),
                                            ::testing::Bool(), ::testing::ValuesIn(kDtypes)),
                         [](const auto& param_info) {
                           return "sw" + std::to_string(std::get<0>(param_info.param)) +
                                  (std::get<1>(param_info.param) ? "_causal_" : "_full_") +
                                  dtype_tag(std::get<2>(param_info.param));
                         });

// ---- context parallelism -----------------------------------------------------------------------

struct CpSpec {
  int64_t degree, rank;
  bool strided;
};

class CpTest : public ::testing::TestWithParam<std::tuple<CpSpec, DType>> {};

// Each rank holds n local query rows of a global sequence of degree*n tokens and all the keys.
TEST_P(CpTest, MatchesReference) {
  const auto [cp, dt] = GetParam();
  const int64_t n = 37;
  Case c = base_case(dt, n, cp.degree * n, 24);
  c.bs = 2;
  c.options.global_cp_deg = cp.degree;
  c.options.cp_offset = cp.strided ? cp.rank : cp.rank * n;
  c.options.cp_strided_q_slicing = cp.strided;
  c.stats = StatsLayout::kRowMajor;
  c.seed += static_cast<uint64_t>(cp.rank);
  EXPECT_TRUE(check_case(c)) << "causal";
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c)) << "causal, odd tiles";
  c.options.sliding_window = 45;
  EXPECT_TRUE(check_case(c)) << "causal + window";
  c.options.tiles = TileConfig{};
  c.has_prior = true;
  c.s_prior = 20;
  c.options.prior_used_len = {13};
  EXPECT_TRUE(check_case(c)) << "causal + window + prefix";
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, CpTest,
    ::testing::Combine(::testing::Values(CpSpec{2, 0, false}, CpSpec{2, 1, true},
                                         CpSpec{16, 0, false}, CpSpec{16, 15, false},
                                         CpSpec{16, 0, true}, CpSpec{16, 15, true},
                                         CpSpec{20, 19, true}, CpSpec{20, 7, false},
                                         CpSpec{32, 31, false}, CpSpec{32, 31, true}),
                       ::testing::ValuesIn(kDtypes)),
    [](const auto& param_info) {
      const CpSpec cp = std::get<0>(param_info.param);
      return "deg" + std::to_string(cp.degree) + "_rank" + std::to_string(cp.rank) +
             (cp.strided ? "_strided_" : "_contiguous_") + dtype_tag(std::get<1>(param_info.param));
    });

}  // namespace
}  // namespace flashcte::test
