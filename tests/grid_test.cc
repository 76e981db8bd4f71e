// Every mode alone and every pair of modes, in every dtype, against the oracle. Each test runs
// its case twice: with the automatic tiling and with small odd tiles (5 x 24, 48-key sections,
// always sectioned), so ragged edges and multi-tile sections meet every combination.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// A mode applied on top of the base case (non-causal, scale 1, default transposes).
struct Feature {
  const char* name;
  void (*apply)(Case*);
};

const Feature kFeatures[] = {
    {"causal", [](Case* c) { c->options.causal_mask = true; }},
    {"window", [](Case* c) { c->options.sliding_window = 29; }},
    {"prefix",
     [](Case* c) {
       c->has_prior = true;
       c->s_prior = 41;
       c->options.prior_used_len = {30};
     }},
    {"cp_contiguous",
     [](Case* c) {
       // rank 2 of 4: local rows sit at global positions [2*Sq, 3*Sq) of a 4*Sq sequence
       c->options.global_cp_deg = 4;
       c->options.cp_offset = 2 * c->sq;
       c->skv = 4 * c->sq;
     }},
    {"cp_strided",
     [](Case* c) {
       // rank 3 of 4: local row i is global row 3 + 4 i
       c->options.global_cp_deg = 4;
       c->options.cp_offset = 3;
       c->options.cp_strided_q_slicing = true;
       c->skv = 4 * c->sq;
     }},
    {"packing",
     [](Case* c) {
       c->pack_lengths = {c->sq / 3, 7, c->sq - c->sq / 3 - 7};
       c->bound_dtype = DType::kInt64;
     }},
    {"sink",
     [](Case* c) {
       // Comparable to the logits (~d/4 for uniform inputs), so neither side dominates.
       c->sink = true;
       c->sink_lo = 3;
       c->sink_hi = 9;
     }},
    {"gqa",
     [](Case* c) {
       c->bs = 6;
       c->bs_kv = 2;
     }},
    {"scale", [](Case* c) { c->options.scale = 0.37f; }},
    {"tp_q", [](Case* c) { c->options.tp_q = false; }},
    {"tp_k", [](Case* c) { c->options.tp_k = true; }},
    {"tp_out", [](Case* c) { c->options.tp_out = true; }},
    {"stats_neuron",
     [](Case* c) {
       c->stats = StatsLayout::kNeuron;
       // the Neuron layout needs Sq % 128 == 0; keep the CP features' KV length consistent
       if (c->skv == 4 * c->sq) c->skv = 4 * 128;
       if (c->options.cp_offset && !c->options.cp_strided_q_slicing) c->options.cp_offset = 256;
       if (!c->pack_lengths.empty()) c->pack_lengths = {42, 7, 128 - 49};
       c->sq = 128;
     }},
    {"stats_rowmajor", [](Case* c) { c->stats = StatsLayout::kRowMajor; }},
    {"lse", [](Case* c) { c->lse = true; }},
    {"value_dim", [](Case* c) { c->dv = c->d + 5; }},
    {"strided_views",
     [](Case* c) {
       c->q_layout = Layout::kStrided;
       c->k_layout = Layout::kPadded;
       c->v_layout = Layout::kReversed;
       c->out_layout = Layout::kPadded;
       c->stats_layout = Layout::kStrided;
     }},
    {"normal_inputs", [](Case* c) { c->dist = Dist::kNormal; }},
};
constexpr int kNumFeatures = sizeof(kFeatures) / sizeof(kFeatures[0]);

bool conflicting(const std::string& a, const std::string& b) {
  auto is = [&](const char* x, const char* y) { return (a == x && b == y) || (a == y && b == x); };
  return is("cp_contiguous", "cp_strided") || is("stats_neuron", "stats_rowmajor");
}

using Param = std::tuple<int, int, DType>;  // feature i <= feature j (i == j: alone), dtype

std::vector<Param> all_params() {
  std::vector<Param> params;
  for (int i = 0; i < kNumFeatures; ++i) {
    for (int j = i; j < kNumFeatures; ++j) {
      if (conflicting(kFeatures[i].name, kFeatures[j].name)) continue;
      for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        params.emplace_back(i, j, dt);
      }
    }
  }
  return params;
}

class PairTest : public ::testing::TestWithParam<Param> {};

TEST_P(PairTest, MatchesReference) {
  const auto [i, j, dt] = GetParam();
  Case c;
  c.dtype = dt;
  c.bs = 2;
  c.bs_kv = 2;
  c.sq = 67;  // not a multiple of any tile
  c.skv = 83;
  c.d = 24;
  c.options.causal_mask = false;
  c.seed = static_cast<uint64_t>(i * 100 + j + 1);
  // In list order: stats_neuron, which resets Sq to 128, comes after every feature that derives
  // a length from Sq and adjusts those lengths itself.
  kFeatures[i].apply(&c);
  if (i != j) kFeatures[j].apply(&c);
  EXPECT_TRUE(check_case(c)) << "automatic tiles";
  c.options.tiles = odd_tiles();
  EXPECT_TRUE(check_case(c)) << "odd tiles";
}

INSTANTIATE_TEST_SUITE_P(Modes, PairTest, ::testing::ValuesIn(all_params()),
                         [](const auto& param_info) {
                           const int i = std::get<0>(param_info.param);
                           const int j = std::get<1>(param_info.param);
                           std::string name = kFeatures[i].name;
                           if (i != j) name += std::string("_x_") + kFeatures[j].name;
                           return name + "_" + dtype_name(std::get<2>(param_info.param));
                         });

}  // namespace
}  // namespace flashcte::test
