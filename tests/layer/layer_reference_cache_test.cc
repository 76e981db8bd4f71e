// The layer oracle's use of the KV cache (src/reference/layer_reference.h, LAYER.md sections 6-7):
// the same tokens through any split of calls give the same outputs and the same cache, bit for
// bit; rows at different positions are independent; a repeated position is padding; values are
// those of the activation dtype; and bad input is refused with the argument named.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "src/reference/layer_reference.h"
#include "src/reference/reference.h"
#include "tests/layer/layer_test_util.h"
#include "tests/test_util.h"

namespace flashcte::reference::test {
namespace {

struct Sequence {
  LayerConfig config;
  LayerWeights weights;
  std::vector<float> x;  // (batch, T, hidden)
  int64_t batch = 2, tokens = 7;
};

Sequence random_sequence(DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  Sequence s;
  s.config = full_config(dtype);
  s.weights = random_weights(s.config, &rng);
  s.x = random_vector(&rng, s.batch * s.tokens * 8, 2.0f);
  return s;
}

// Runs tokens [first, first + count) of every row in one call.
std::vector<double> run_span(const Sequence& s, LayerCache* cache, int64_t first, int64_t count) {
  std::vector<float> x;
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = first; t < first + count; ++t) {
      pos.push_back(t);
      const auto row = s.x.begin() + (b * s.tokens + t) * 8;
      x.insert(x.end(), row, row + 8);
    }
  }
  return run(s.config, s.weights, cache, x, pos, s.batch);
}

// out[b][t] of a sequence of calls covering [0, tokens) in spans of `spans` tokens.
std::vector<double> run_in_spans(const Sequence& s, const std::vector<int64_t>& spans,
                                 LayerCache* cache) {
  std::vector<double> out(s.batch * s.tokens * 8);
  int64_t first = 0;
  for (int64_t count : spans) {
    const std::vector<double> part = run_span(s, cache, first, count);
    for (int64_t b = 0; b < s.batch; ++b) {
      std::copy_n(part.begin() + b * count * 8, count * 8,
                  out.begin() + (b * s.tokens + first) * 8);
    }
    first += count;
  }
  return out;
}

TEST(LayerReference, PrefillEqualsTokenByTokenDecode) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Sequence s = random_sequence(dtype, 3);
    LayerCache prefill = new_cache(s.config, 2, 9), decode = new_cache(s.config, 2, 9);
    EXPECT_EQ(run_in_spans(s, {7}, &prefill), run_in_spans(s, {1, 1, 1, 1, 1, 1, 1}, &decode));
    EXPECT_EQ(prefill.k, decode.k);
    EXPECT_EQ(prefill.v, decode.v);
    EXPECT_EQ(prefill.lengths, (std::vector<int64_t>{7, 7}));
  }
}

TEST(LayerReference, ChunkedPrefillEqualsOnePrefill) {
  const Sequence s = random_sequence(DType::kBFloat16, 4);
  LayerCache one = new_cache(s.config, 2, 7), chunked = new_cache(s.config, 2, 7);
  const std::vector<double> out = run_in_spans(s, {7}, &one);
  EXPECT_EQ(out, run_in_spans(s, {4, 3}, &chunked));
  EXPECT_EQ(one.k, chunked.k);
  // And the output is not trivially the same for any split: a cache that misses the first chunk
  // (a fresh cache positioned at 4) gives different outputs for the second chunk.
  LayerCache fresh = new_cache(s.config, 2, 7);
  fresh.lengths = {4, 4};
  const std::vector<double> second = run_span(s, &fresh, 4, 3);
  EXPECT_NE(std::vector<double>(second.begin(), second.begin() + 24),
            std::vector<double>(out.begin() + 32, out.begin() + 56));
}

// Rows of a batch at different positions (per-sequence lengths) behave as separate sequences.
TEST(LayerReference, BatchRowsAtDifferentPositionsAreIndependent) {
  const Sequence s = random_sequence(DType::kFloat32, 5);
  LayerCache batched = new_cache(s.config, 2, 8);
  batched.lengths = {0, 0};
  // Row 1 gets 4 tokens first (row 0 repeats its position 0 as padding, then restarts there).
  std::vector<float> x0(s.x.begin(), s.x.begin() + 4 * 8);
  std::vector<float> x1(s.x.begin() + 7 * 8, s.x.begin() + 11 * 8);
  std::vector<float> x = x0;
  x.insert(x.end(), x1.begin(), x1.end());
  (void)run(s.config, s.weights, &batched, x, {0, 0, 0, 0, 0, 1, 2, 3}, 2);
  EXPECT_EQ(batched.lengths, (std::vector<int64_t>{1, 4}));
  // Then row 0 at positions 0..2 (rewriting slot 0), row 1 at 4..6.
  x.assign(s.x.begin(), s.x.begin() + 3 * 8);
  x.insert(x.end(), s.x.begin() + 11 * 8, s.x.begin() + 14 * 8);
  const std::vector<double> out = run(s.config, s.weights, &batched, x, {0, 1, 2, 4, 5, 6}, 2);
  for (int64_t b = 0; b < 2; ++b) {
    Sequence alone = s;
    alone.batch = 1;
    alone.x.assign(s.x.begin() + b * 7 * 8, s.x.begin() + (b + 1) * 7 * 8);
    LayerCache cache = new_cache(s.config, 1, 8);
    const std::vector<double> ref = run_in_spans(alone, {7}, &cache);
    const int64_t first = b == 0 ? 0 : 4;
    EXPECT_EQ(std::vector<double>(out.begin() + b * 24, out.begin() + (b + 1) * 24),
              std::vector<double>(ref.begin() + first * 8, ref.begin() + (first + 3) * 8))
        << "row " << b;
  }
}

// A repeated position is chunk padding (section 6): its output is that of a query at the
// position, but it is neither a key nor written, so the next step does not see it.
TEST(LayerReference, RepeatedPositionIsPaddingNotAKey) {
  const Sequence s = random_sequence(DType::kBFloat16, 6);
  Sequence one = s;
  one.batch = 1;
  LayerCache plain = new_cache(s.config, 1, 8), padded = new_cache(s.config, 1, 8);
  const std::vector<double> ref = run_in_spans(one, {4}, &plain);  // tokens 0..3, then decode
  std::vector<float> x(s.x.begin(), s.x.begin() + 3 * 8);
  x.insert(x.end(), s.x.begin() + 5 * 8, s.x.begin() + 6 * 8);  // another token at position 2
  const std::vector<double> out = run(s.config, s.weights, &padded, x, {0, 1, 2, 2}, 1);
  EXPECT_EQ(std::vector<double>(out.begin(), out.begin() + 24),
            std::vector<double>(ref.begin(), ref.begin() + 24));
  EXPECT_NE(std::vector<double>(out.begin() + 24, out.end()),
            std::vector<double>(ref.begin() + 16, ref.begin() + 24));
  const std::vector<float> x3(s.x.begin() + 3 * 8, s.x.begin() + 4 * 8);
  EXPECT_EQ(run(s.config, s.weights, &padded, x3, {3}, 1),
            std::vector<double>(ref.begin() + 24, ref.begin() + 32));
}

TEST(LayerReference, OutputsAndCacheHoldActivationDtypeValues) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    const Sequence s = random_sequence(dtype, 8);
    LayerCache cache = new_cache(s.config, 2, 7);
    const std::vector<double> out = run_in_spans(s, {7}, &cache);
    int64_t not_float32 = 0;
    for (const std::vector<double>* v : {&out, &std::as_const(cache.k), &std::as_const(cache.v)}) {
      for (double x : *v) {
        ASSERT_EQ(round_to_dtype(x, dtype), x);
        not_float32 += round_to_dtype(x, DType::kFloat32) != x;
      }
    }
    EXPECT_EQ(not_float32, 0);
  }
}

// --- Refusals, each naming its argument.

TEST(LayerReferenceErrors, BadConfigAndWeights) {
  const LayerConfig good = full_config(DType::kFloat32);
  std::mt19937 rng(9);
  const LayerWeights w = random_weights(good, &rng);
  ASSERT_TRUE(check_layer(good, w).ok);
  LayerConfig c = good;
  c.num_kv_heads = 3;
  expect_error(check_layer(c, w), "num_kv_heads: ");
  c = good;
  c.rotary_dim = 3;
  expect_error(check_layer(c, w), "rotary_dim: ");
  c.rotary_dim = 8;  // > head_dim 6
  expect_error(check_layer(c, w), "rotary_dim: ");
  c = good;
  c.rope_scaling->high_freq_factor = c.rope_scaling->low_freq_factor;
  expect_error(check_layer(c, w), "rope_scaling: ");
  c = good;
  c.head_dim = 0;
  c.hidden_size = 2;  // 2 / 4 heads = 0
  expect_error(check_layer(c, w), "head_dim: ");
  c = good;
  c.dtype = DType::kInt32;
  expect_error(check_layer(c, w), "dtype: ");
  LayerWeights bad = w;
  bad.k_proj.pop_back();
  expect_error(check_layer(good, bad), "k_proj: ");
  c = good;
  c.o_bias = false;
  expect_error(check_layer(c, w), "o_bias: ");
  bad = w;
  bad.sinks.push_back(0);
  expect_error(check_layer(good, bad), "sinks: ");
}

// Every buffer of an oracle cache into `snap`: its sizes, K, V and the lengths.
void add_cache(flashcte::test::BufferSnapshot* snap, const std::string& name,
               const LayerCache& cache) {
  for (const auto& [field, value] :
       {std::pair{"batch", &cache.batch}, std::pair{"kv_heads", &cache.kv_heads},
        std::pair{"max_len", &cache.max_len}, std::pair{"head_dim", &cache.head_dim}}) {
    snap->add(name + " " + field, value, sizeof(int64_t));
  }
  snap->add(name + " k", cache.k).add(name + " v", cache.v).add(name + " lengths", cache.lengths);
}

TEST(LayerReferenceErrors, BadInputsAndPositions) {
  const Sequence s = random_sequence(DType::kFloat32, 10);
  const LayerConfig& c = s.config;
  // As large as the valid call's output, so that a refused call has nothing to resize.
  std::vector<double> out(2 * 4 * 8);
  LayerCache cache = new_cache(c, 2, 4);
  LayerConfig other = c;
  other.num_kv_heads = 4;
  LayerCache wrong = new_cache(other, 2, 4);
  LayerCache one_row = new_cache(c, 1, 4);
  const std::vector<int32_t> pos32 = {0, 0};
  const auto forward = [&](const TensorView& x, const TensorView& positions, LayerCache* target) {
    return layer_forward(c, s.weights, x, positions, target, &out);
  };
  const auto x_view = [&](int64_t tokens, int64_t hidden) {
    return TensorView::contiguous(s.x.data(), DType::kFloat32, {2, tokens, hidden});
  };
  // Refused with `prefix`, every cache, x, the positions (pos64 when given as int64) and out as
  // they were. out keeps its buffer and size (checked first: a reallocated out could not be
  // compared).
  const auto expect_refused = [&](const TensorView& x, const TensorView& positions,
                                  const std::vector<int64_t>& pos64, LayerCache* target,
                                  const std::string& prefix) {
    flashcte::test::BufferSnapshot snap;
    add_cache(&snap, "cache", cache);
    add_cache(&snap, "cache of 4 KV heads", wrong);
    add_cache(&snap, "cache of 1 sequence", one_row);
    snap.add("x", s.x).add("int32 positions", pos32).add("positions", pos64);
    const double* out_data = out.data();
    const size_t out_size = out.size();
    snap.add_output("out", out);
    expect_error(forward(x, positions, target), prefix);
    ASSERT_EQ(out.data(), out_data) << prefix << ": out reallocated";
    ASSERT_EQ(out.size(), out_size) << prefix << ": out resized";
    EXPECT_TRUE(snap.unchanged()) << prefix;
  };
  const auto call = [&](const std::vector<int64_t>& pos, int64_t tokens, int64_t hidden = 8,
                        LayerCache* target = nullptr) {
    return forward(x_view(tokens, hidden),
                   TensorView::contiguous(pos.data(), DType::kInt64, {2, tokens}),
                   target ? target : &cache);
  };
  const auto refused = [&](const std::vector<int64_t>& pos, int64_t tokens,
                           const std::string& prefix, int64_t hidden = 8,
                           LayerCache* target = nullptr) {
    expect_refused(x_view(tokens, hidden),
                   TensorView::contiguous(pos.data(), DType::kInt64, {2, tokens}), pos,
                   target ? target : &cache, prefix);
  };
  refused({0, 0}, 1, "x: ", 7);
  expect_refused(x_view(1, 8), TensorView::contiguous(pos32.data(), DType::kInt32, {2, 1}), {},
                 &cache, "positions: ");
  expect_refused(x_view(2, 8), TensorView::contiguous(pos32.data(), DType::kInt64, {2, 1}), {},
                 &cache, "positions: ");
  refused({1, 0}, 1, "positions: ");         // row 0 would skip slot 0
  refused({0, 2, 0, 1}, 2, "positions: ");   // row 0 jumps 0 -> 2
  refused({0, -1, 0, 1}, 2, "positions: ");  // goes back
  ASSERT_TRUE(call({0, 1, 2, 3, 0, 1, 2, 3}, 4).ok);
  refused({4, 4}, 1, "positions: ");  // past max_len 4
  EXPECT_EQ(cache.lengths, (std::vector<int64_t>{4, 4}));
  refused({0, 0}, 1, "cache: ", 8, &wrong);
  refused({0, 0}, 1, "x: ", 8, &one_row);
  flashcte::test::BufferSnapshot snap;
  add_cache(&snap, "cache", cache);
  expect_error(make_layer_cache(c, 1, 0, &cache), "max_len: ");
  EXPECT_TRUE(snap.unchanged());
}

}  // namespace
}  // namespace flashcte::reference::test
