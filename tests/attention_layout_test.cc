// attention_cte against the float64 oracle, one axis of variation at a time (continued from
// attention_test.cc): the scale and input distributions, tilings, memory layouts (float32 V in
// place or packed, rows past a cache line, every layout and transpose), and bitwise determinism
// across threads.
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
