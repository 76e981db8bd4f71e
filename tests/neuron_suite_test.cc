// The shapes of the Neuron kernel's own test suite (shared/spec/SEMANTICS.md, last section), with
// its inputs: uniform in [0, 1), sinks uniform in [15, 25].
//
// This file builds twice. In flashcte_tests every shape is scaled down (lengths / 4 to / 8, the
// structure kept: Sq vs Skv ratio, prefix fractions, CP degrees and ranks, window vs length) so
// the default suite stays fast. In flashcte_long_tests (FLASHCTE_FULL_SIZE, CTest label `long`)
// the shapes are the suite's own, and the tests skip unless FLASHCTE_LONG_TESTS=1. Big shapes
// compare a sample of query rows with the oracle (run_case picks them), all rows are checked for
// being written.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "tests/test_util.h"

namespace flashcte::test {
namespace {

#ifdef FLASHCTE_FULL_SIZE
constexpr bool kFull = true;
#else
constexpr bool kFull = false;
#endif

// `full` when building the long suite, else `small`.
int64_t size(int64_t full, int64_t small) { return kFull ? full : small; }

struct Shape {
  std::string name;
  std::function<Case()> make;
  std::vector<DType> dtypes = {DType::kFloat32, DType::kBFloat16};
};

Case neuron_case(int64_t sq, int64_t skv, int64_t d) {
  Case c;
  c.sq = sq;
  c.skv = skv;
  c.d = d;
  c.seed = static_cast<uint64_t>(sq * 31 + skv * 7 + d);
  return c;  // causal, scale 1, uniform [0, 1): the kernel's defaults
}

void add_cp(Case* c, int64_t degree, int64_t rank, bool strided) {
  c->options.global_cp_deg = degree;
  c->options.cp_offset = strided ? rank : rank * c->sq;
  c->options.cp_strided_q_slicing = strided;
  c->skv = degree * c->sq;
}

void add_packing(Case* c, int sequences) {
  // Uneven lengths summing to Sq (the suite packs sequences of different lengths).
  c->pack_lengths.clear();
  int64_t left = c->sq;
  for (int s = 0; s < sequences - 1; ++s) {
    const int64_t len = c->sq / sequences + (s % 2 ? -c->sq / 16 : c->sq / 16);
    c->pack_lengths.push_back(len);
    left -= len;
  }
  c->pack_lengths.push_back(left);
  c->bound_dtype = DType::kFloat32;  // range_select takes float32 bounds on Neuron
}

std::vector<Shape> shapes() {
  std::vector<Shape> s;
  s.push_back({"sq4096_skv9216_d64_scale05", [] {
                 Case c = neuron_case(size(4096, 512), size(9216, 1152), 64);
                 c.options.scale = 0.5f;
                 return c;
               }});
  s.push_back({"sq4096_skv9216_d64_scale05_full", [] {
                 Case c = neuron_case(size(4096, 512), size(9216, 1152), 64);
                 c.options.scale = 0.5f;
                 c.options.causal_mask = false;
                 return c;
               }});
  s.push_back({"s16400_d128_tp_out", [] {
                 Case c = neuron_case(size(16400, 2050), size(16400, 2050), 128);
                 c.options.tp_out = true;
                 c.options.tiles = neuron_tiles();
                 return c;
               }});
  s.push_back({"bs3_sq512_skv1024_sink", [] {
                 Case c = neuron_case(512, 1024, 128);
                 c.bs = c.bs_kv = 3;
                 c.sink = true;
                 c.stats = StatsLayout::kNeuron;
                 return c;
               }});
  s.push_back({"s16384_d8", [] {
                 Case c = neuron_case(size(16384, 2048), size(16384, 2048), 8);
                 c.options.tiles = neuron_tiles();
                 return c;
               }});
  for (int64_t used : {int64_t{0}, int64_t{1}, int64_t{2048}, int64_t{4095}, int64_t{4096}}) {
    s.push_back({"prefix4096_used" + std::to_string(used), [used] {
                   // Scaled: S_prior 512 with the same fractions (0, 1, half, all but one, all).
                   const int64_t prior = size(4096, 512);
                   const int64_t u = kFull          ? used
                                     : used == 4096 ? 512
                                     : used == 4095 ? 511
                                     : used == 2048 ? 256
                                                    : used;
                   Case c = neuron_case(size(4096, 512), size(4096, 512), 64);
                   c.has_prior = true;
                   c.s_prior = prior;
                   c.options.prior_used_len = {u};
                   return c;
                 }});
  }
  s.push_back({"s2001_prior3555_used3000", [] {
                 Case c = neuron_case(2001, 2001, 64);
                 c.has_prior = true;
                 c.s_prior = 3555;
                 c.options.prior_used_len = {3000};
                 return c;
               }});
  s.push_back({"d88", [] { return neuron_case(size(4096, 1024), size(4096, 1024), 88); }});
  s.push_back({"d127", [] { return neuron_case(size(4096, 1024), size(4096, 1024), 127); }});
  s.push_back({"sq577", [] { return neuron_case(577, 577, 128); }});
  s.push_back({"sq12345", [] {
                 Case c = neuron_case(size(12345, 1543), size(12345, 1543), 64);
                 c.options.tiles = neuron_tiles();
                 return c;
               }});
  for (auto [bs, bs_kv] : {std::pair<int64_t, int64_t>{9, 3}, {8, 1}, {3, 1}}) {
    s.push_back(
        {"gqa" + std::to_string(bs) + "_" + std::to_string(bs_kv), [bs = bs, bs_kv = bs_kv] {
           Case c = neuron_case(size(2048, 256), size(2048, 256), 64);
           c.bs = bs;
           c.bs_kv = bs_kv;
           c.sink = true;
           return c;
         }});
  }
  for (int64_t window : {23, 128, 1024}) {
    s.push_back({"window" + std::to_string(window), [window] {
                   Case c = neuron_case(size(8192, 2048), size(8192, 2048), 64);
                   c.options.sliding_window = window;
                   c.options.tiles = neuron_tiles();
                   return c;
                 }});
  }
  for (auto [degree, rank] :
       {std::pair<int64_t, int64_t>{2, 1}, {16, 0}, {16, 15}, {20, 19}, {32, 0}, {32, 31}}) {
    for (bool strided : {false, true}) {
      s.push_back({"cp" + std::to_string(degree) + "_rank" + std::to_string(rank) +
                       (strided ? "_strided" : "_contiguous"),
                   [degree = degree, rank = rank, strided] {
                     Case c = neuron_case(size(512, 64), 0, 64);
                     add_cp(&c, degree, rank, strided);
                     c.stats = StatsLayout::kRowMajor;
                     return c;
                   }});
    }
  }
  for (int64_t sq : {int64_t{512}, int64_t{2048}, int64_t{4096}}) {
    if (!kFull && sq == 4096) continue;
    for (int sequences : {4, 8}) {
      s.push_back({"packing_sq" + std::to_string(sq) + "_seqs" + std::to_string(sequences),
                   [sq, sequences] {
                     Case c = neuron_case(sq, sq, 64);
                     add_packing(&c, sequences);
                     return c;
                   }});
    }
  }
  // Head dims over 128 (the large-d kernel's shapes), with and without a window.
  for (int64_t d : {256, 384, 512}) {
    for (int64_t seq : {int64_t{2048}, int64_t{4096}}) {
      if (!kFull && seq == 4096) continue;
      for (bool window : {false, true}) {
        s.push_back({"large_d" + std::to_string(d) + "_s" + std::to_string(seq) +
                         (window ? "_window1024" : ""),
                     [d, seq, window] {
                       Case c = neuron_case(size(seq, seq / 4), size(seq, seq / 4), d);
                       if (window) c.options.sliding_window = size(1024, 128);
                       return c;
                     },
                     {DType::kBFloat16}});
      }
    }
  }
  return s;
}

using Param = std::tuple<int, DType>;

std::vector<Param> params() {
  std::vector<Param> p;
  const auto all = shapes();
  for (int i = 0; i < static_cast<int>(all.size()); ++i) {
    for (DType dt : all[i].dtypes) p.emplace_back(i, dt);
  }
  return p;
}

class NeuronShapeTest : public ::testing::TestWithParam<Param> {};

TEST_P(NeuronShapeTest, MatchesReference) {
  if (kFull && !long_tests_enabled()) GTEST_SKIP() << "full size: set FLASHCTE_LONG_TESTS=1";
  const auto [index, dt] = GetParam();
  Case c = shapes()[index].make();
  c.dtype = dt;
  EXPECT_TRUE(check_case(c));
}

INSTANTIATE_TEST_SUITE_P(Neuron, NeuronShapeTest, ::testing::ValuesIn(params()),
                         [](const auto& param_info) {
                           return shapes()[std::get<0>(param_info.param)].name + "_" +
                                  dtype_name(std::get<1>(param_info.param));
                         });

}  // namespace
}  // namespace flashcte::test
