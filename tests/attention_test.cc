// attention_cte against the float64 oracle, one axis of variation at a time: head dims, awkward
// lengths, prefix and window edges, context-parallel ranks at both ends, dtypes and input
// distributions, tilings, memory layouts, empty rows, and bitwise determinism across threads.
// (Pairwise combinations of modes are in grid_test.cc, the Neuron suite's shapes in
// neuron_suite_test.cc.)
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

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

const DType kDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

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

Case base_case(DType dt, int64_t sq, int64_t skv, int64_t d) {
  Case c;
  c.dtype = dt;
  c.sq = sq;
  c.skv = skv;
  c.d = d;
  c.seed = static_cast<uint64_t>(sq * 1000003 + skv * 1009 + d);
  return c;
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

// ---- scale and input distributions ------------------------------------------------------------

TEST(Scale, AnyScaleInEveryMode) {
  for (float scale : {1.0f, 0.125f, 2.5f, -0.7f, 0.0f}) {
    for (DType dt : kDtypes) {
      Case c = base_case(dt, 66, 80, 20);
      c.dist = Dist::kNormal;
      c.options.scale = scale;
      c.options.sliding_window = 30;
      c.has_prior = true;
      c.s_prior = 10;
      c.sink = true;
      c.sink_lo = -1;
      c.sink_hi = 1;
      c.options.cp_offset = 5;
      c.lse = true;
      EXPECT_TRUE(check_case(c)) << "scale " << scale;
    }
  }
}

// Normal inputs with a large scale give peaky softmax rows whose max moves between KV tiles:
// the rescale path of the online softmax carries the whole result.
TEST(Distribution, NormalInputsPeakyRows) {
  for (DType dt : kDtypes) {
    for (float scale : {0.125f, 1.0f, 4.0f}) {
      Case c = base_case(dt, 120, 333, 48);
      c.bs = 2;
      c.dist = Dist::kNormal;
      c.options.scale = scale;
      c.options.causal_mask = false;
      c.stats = StatsLayout::kRowMajor;
      c.lse = true;
      EXPECT_TRUE(check_case(c)) << "scale " << scale;
      c.options.tiles = odd_tiles();
      EXPECT_TRUE(check_case(c)) << "scale " << scale << ", odd tiles";
    }
  }
}

// ---- tilings -----------------------------------------------------------------------------------

TEST(Tiles, Variants) {
  const TileConfig configs[] = {
      TileConfig{},                // automatic
      neuron_tiles(),              // the Neuron values
      odd_tiles(),                 // 5 x 24, sections of 2 tiles, always sectioned
      TileConfig{1, 1, 0, 0},      // one row, one key
      TileConfig{7, 13, 13, 0},    // one tile per section
      TileConfig{64, 32, 96, 50},  // sectioned only above 50 keys
      TileConfig{3, 40, 0, 0},     // no sections
      TileConfig{200, 1000, 4000, 100000},
  };
  for (const TileConfig& t : configs) {
    for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
      Case c = base_case(dt, 97, 211, 20);
      c.bs = 2;
      c.options.tiles = t;
      c.sink = true;
      c.sink_lo = 3;
      c.sink_hi = 6;
      c.stats = StatsLayout::kRowMajor;
      c.lse = true;
      EXPECT_TRUE(check_case(c));
      c.options.causal_mask = false;
      c.dist = Dist::kNormal;
      c.options.scale = 2;
      EXPECT_TRUE(check_case(c));
    }
  }
}

// Neuron tiles on a KV axis above the 10240 threshold, so 8192-key sections with their rescale
// are taken; rows are sampled.
TEST(Tiles, NeuronSectionsAboveThreshold) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    Case c = base_case(dt, 200, 10500, 32);
    c.options.tiles = neuron_tiles();
    c.options.causal_mask = false;
    c.dist = Dist::kNormal;
    c.options.scale = 0.5f;
    c.stats = StatsLayout::kRowMajor;
    EXPECT_TRUE(check_case(c));
    c.options.causal_mask = true;
    c.options.cp_offset = 10300;  // rows 0..199 at positions 10300.. see nearly every key
    EXPECT_TRUE(check_case(c));
  }
}

// ---- memory layouts ----------------------------------------------------------------------------

// float32 V with its channels contiguous and dv a multiple of the padding unit is read in place
// (src/kernel/pack.cc); every other V is packed. Both, causal over a prior that ends on a section
// boundary (in place) or inside a section (packed), with sections of two tiles.
TEST(Layouts, Float32ValuesInPlaceOrPacked) {
  for (Layout layout :
       {Layout::kContiguous, Layout::kPadded, Layout::kStrided, Layout::kReversed}) {
    for (int64_t dv : {16, 32, 24}) {
      for (int64_t s_prior : {32, 40}) {
        Case c = base_case(DType::kFloat32, 70, 90, 32);
        c.bs = 2;
        c.dv = dv;
        c.v_layout = layout;
        c.has_prior = true;
        c.s_prior = s_prior;
        c.options.tiles = TileConfig{16, 16, 32, 0};
        EXPECT_TRUE(check_case(c)) << layout_name(layout) << " dv " << dv << " prior " << s_prior;
      }
    }
  }
}

// float32 V whose rows start past a cache line (numpy's arrays 16 bytes past one, a slice 4 bytes
// past) is copied instead of read in place (pack.cc's v_in_place): the output is bitwise the
// aligned call's, K and Q moved along with it, with a prior and without.
TEST(Layouts, ValuesPastACacheLineGiveTheAlignedBytes) {
  constexpr int64_t kBs = 2, kS = 300, kD = 64;
  std::vector<float> data(static_cast<size_t>(3 * kBs * kS * kD + 64));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : data) x = u(rng);
  const auto run = [&](int64_t offset_floats) {
    // A 64-byte-aligned block of the same values, shifted by offset_floats.
    std::vector<float> buffer(data.size() + 32);
    const auto base = reinterpret_cast<uintptr_t>(buffer.data());
    float* start = buffer.data() + ((64 - base % 64) % 64) / sizeof(float) + offset_floats;
    std::copy(data.begin(), data.end() - 64, start);
    const int64_t n = kBs * kS * kD;
    const auto view = [&](int64_t i) {
      return TensorView::contiguous(start + i * n, DType::kFloat32, {kBs, kS, kD});
    };
    std::vector<float> out(static_cast<size_t>(n));
    Outputs outputs;
    outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {kBs, kS, kD});
    Options o;
    o.tp_k = true;
    o.causal_mask = false;
    o.scale = 0.125f;
    EXPECT_TRUE(attention_cte(view(0), view(1), view(2), outputs, o).ok);
    return out;
  };
  const std::vector<float> aligned = run(0);
  for (int64_t offset : {4, 1}) {
    const std::vector<float> shifted = run(offset);
    EXPECT_EQ(0, std::memcmp(aligned.data(), shifted.data(), aligned.size() * sizeof(float)))
        << offset * 4 << " bytes past a line";
  }
}

TEST(Layouts, EveryLayoutAndTranspose) {
  const Layout layouts[] = {Layout::kContiguous, Layout::kPadded, Layout::kStrided,
                            Layout::kReversed};
  for (Layout layout : layouts) {
    for (int tp = 0; tp < 8; ++tp) {
      Case c = base_case(DType::kBFloat16, 128, 70, 12);
      c.bs = 3;
      c.dv = 10;
      c.q_layout = c.k_layout = c.v_layout = c.out_layout = c.stats_layout = layout;
      c.options.tp_q = tp & 1;
      c.options.tp_k = tp & 2;
      c.options.tp_out = tp & 4;
      c.stats = tp % 2 ? StatsLayout::kNeuron : StatsLayout::kRowMajor;
      c.lse = true;
      EXPECT_TRUE(check_case(c)) << layout_name(layout) << " tp " << tp;
    }
  }
  // Mixed: each tensor in a different layout.
  Case c = base_case(DType::kFloat16, 128, 90, 17);
  c.q_layout = Layout::kStrided;
  c.k_layout = Layout::kReversed;
  c.v_layout = Layout::kPadded;
  c.out_layout = Layout::kReversed;
  c.stats_layout = Layout::kStrided;
  c.stats = StatsLayout::kNeuron;
  c.lse = true;
  c.has_prior = true;
  c.s_prior = 9;
  EXPECT_TRUE(check_case(c));
}

// ---- threads -----------------------------------------------------------------------------------

// The API promises bitwise identical results for any num_threads.
TEST(Threads, BitwiseIdenticalAcrossThreadCounts) {
  std::vector<Case> cases;
  {
    Case c = base_case(DType::kFloat32, 300, 300, 64);
    c.bs = 3;
    c.sink = true;
    c.stats = StatsLayout::kRowMajor;
    c.lse = true;
    cases.push_back(c);
  }
  {
    Case c = base_case(DType::kBFloat16, 256, 256, 40);
    c.bs = 4;
    c.bs_kv = 2;
    c.pack_lengths = {64, 100, 92};
    c.stats = StatsLayout::kNeuron;
    c.options.tiles = odd_tiles();
    cases.push_back(c);
  }
  {
    Case c = base_case(DType::kFloat16, 77, 16 * 77, 32);
    c.options.global_cp_deg = 16;
    c.options.cp_offset = 15;
    c.options.cp_strided_q_slicing = true;
    c.options.sliding_window = 200;
    c.has_prior = true;
    c.s_prior = 50;
    c.lse = true;
    cases.push_back(c);
  }
  {
    Case c = base_case(DType::kFloat32, 1000, 1500, 16);
    c.options.tiles = neuron_tiles();
    c.options.causal_mask = false;
    c.dist = Dist::kNormal;
    cases.push_back(c);
  }
  for (Case& c : cases) {
    c.options.num_threads = 1;
    const Outcome one = run_case(c, /*skip_reference=*/true);
    ASSERT_TRUE(one.status.ok) << one.status.message;
    for (int threads : {2, 3, 0}) {
      c.options.num_threads = threads;
      const Outcome other = run_case(c, true);
      ASSERT_TRUE(other.status.ok) << other.status.message;
      EXPECT_TRUE(other.raw == one.raw) << c.describe() << ": differs from 1 thread";
    }
    EXPECT_TRUE(check_case(c));
  }
}

}  // namespace
}  // namespace flashcte::test
