// The fast attention layer (include/flashcte/layer.h) against its float64 oracle
// (src/reference/layer_reference.h): a prefill on attention_cte, a prefix-cached second chunk
// that also rewrites one sequence's tail, then decode steps on decode_attention, with GQA, MQA,
// partial rotary, Llama-3 scaling, a window, sinks, biases and q/k norm, in every dtype. Shared
// prefix pages and refusals on block pools: attention_layer_paged_test.cc.
//
// Tolerance. The oracle rounds to the activation dtype where the module does (R1-R7), in float64
// between them; the fast layer computes the same steps in float32 with other summation orders.
// Each rounded stage (projections, norm, RoPE, attention output, o_proj, bias) can land one ulp of
// the dtype away from the oracle's, and the weights here (|w| <= 0.5, fan-in <= 64) keep the gain
// of a stage near 1, so six stages stay within 6 ulps of the largest output; the bound is twice
// that. In float32 the same reasoning with the float32 ulp is far below the GEMMs' own summation
// error, so float32 uses 1e-5 relative to the largest output (the kernel tests' float32 floor,
// tests/test_util.cc) times the fan-in.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "flashcte/layer.h"
#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/reference/layer_reference.h"
#include "tests/layer/layer_cache_cases.h"
#include "tests/layer/layer_test_util.h"
#include "tests/test_util.h"

namespace flashcte::reference::test {
namespace {

// The tolerance unit (see the file comment): the dtype's ulp, and in float32 the GEMMs' own
// summation error instead.
double ulp_of(DType dtype) {
  return dtype == DType::kFloat32 ? 1e-5 * 64 : flashcte::test::unit_roundoff(dtype);
}

double read(const std::vector<uint16_t>& bits, const std::vector<float>& floats, DType dtype,
            size_t i) {
  if (dtype == DType::kBFloat16) return half::bf16_to_float(bits[i]);
  if (dtype == DType::kFloat16) return half::f16_to_float(bits[i]);
  return floats[i];
}

// Each value rounded to a multiple of 1 / grid.
void snap(std::vector<float>* v, float grid) {
  for (float& f : *v) f = std::nearbyint(f * grid) / grid;
}

// One layer run side by side: the fast layer and the oracle, each with its own cache; with
// `block_size`, the fast layer also runs on a block pool, bitwise the dense cache's result.
class SideBySide {
 public:
  // `grid` > 0: x on multiples of 1 / grid (see Kv8Conversation).
  SideBySide(const LayerConfig& config, const LayerWeights& weights, int64_t batch, int64_t max_len,
             int64_t block_size = 0, float grid = 0)
      : config_(config), weights_(weights), batch_(batch), grid_(grid), rng_(7) {
    const Status s = AttentionLayer::create(config, weights, &layer_);
    EXPECT_TRUE(s.ok) << s.message;
    EXPECT_TRUE(layer_->new_cache(batch, max_len, &cache_).ok);
    if (block_size > 0) paged_ = paged_cache(*layer_, batch, max_len, block_size, 3);
    oracle_cache_ = new_cache(config, batch, max_len);
  }

  // Runs one call with random x at `positions` (batch rows of T each) and compares.
  void step(const std::vector<int64_t>& positions, const std::string& what) {
    const int64_t tokens = static_cast<int64_t>(positions.size()) / batch_;
    const int64_t hidden = config_.hidden_size, n = batch_ * tokens * hidden;
    std::vector<float> x = random_vector(&rng_, n, 1.0f);
    if (grid_ > 0) snap(&x, grid_);
    const DType t = config_.dtype;
    std::vector<float> out_f(t == DType::kFloat32 ? n : 0);
    std::vector<uint16_t> out_h(t == DType::kFloat32 ? 0 : n);
    void* out_data = t == DType::kFloat32 ? static_cast<void*>(out_f.data()) : out_h.data();
    const TensorView xv =
        TensorView::contiguous(x.data(), DType::kFloat32, {batch_, tokens, hidden});
    const TensorView pv = TensorView::contiguous(positions.data(), DType::kInt64, {batch_, tokens});
    const Status s = layer_->forward(
        xv, pv, &cache_, MutableTensorView::contiguous(out_data, t, {batch_, tokens, hidden}));
    ASSERT_TRUE(s.ok) << what << ": " << s.message;
    if (paged_.paged()) {
      std::vector<float> paged_f(out_f.size());
      std::vector<uint16_t> paged_h(out_h.size());
      void* paged_data = t == DType::kFloat32 ? static_cast<void*>(paged_f.data()) : paged_h.data();
      const Status sp = layer_->forward(
          xv, pv, &paged_, MutableTensorView::contiguous(paged_data, t, {batch_, tokens, hidden}));
      ASSERT_TRUE(sp.ok) << what << " (paged): " << sp.message;
      EXPECT_TRUE(paged_f == out_f && paged_h == out_h) << what << ": paged differs from dense";
      EXPECT_EQ(paged_.lengths(), cache_.lengths()) << what;
    }
    std::vector<double> expected;
    ASSERT_TRUE(layer_forward(config_, weights_, xv, pv, &oracle_cache_, &expected).ok);
    double largest = 0, worst = 0;
    for (size_t i = 0; i < expected.size(); ++i)
      largest = std::max(largest, std::fabs(expected[i]));
    for (size_t i = 0; i < expected.size(); ++i) {
      worst = std::max(worst, flashcte::test::abs_error(read(out_h, out_f, t, i), expected[i]));
    }
    const double bound = 12 * ulp_of(t) * std::max(largest, 1e-3);
    EXPECT_LE(worst, bound) << what << " (" << dtype_name(t) << "): largest output " << largest;
    for (int64_t b = 0; b < batch_; ++b) {
      EXPECT_EQ(cache_.length(b), oracle_cache_.lengths[static_cast<size_t>(b)]) << what;
    }
    if (cache_.k_scale_data() != nullptr) expect_codes_of_the_oracle(what);
  }

  // An 8-bit cache: every filled slot's code x scale is exactly the oracle's R8 value.
  void expect_codes_of_the_oracle(const std::string& what) const {
    const int64_t d = cache_.head_dim(), slots = cache_.max_len();
    int64_t differ = 0;
    for (int64_t b = 0; b < batch_; ++b) {
      for (int64_t h = 0; h < cache_.kv_heads(); ++h) {
        for (int64_t j = 0; j < cache_.length(b); ++j) {
          const int64_t slot = (b * cache_.kv_heads() + h) * slots + j;
          for (int64_t ch = 0; ch < d; ++ch) {
            const auto at = static_cast<size_t>(slot * d + ch);
            const double k =
                kv8::decode(cache_.dtype(), static_cast<const uint8_t*>(cache_.k_data())[at]) *
                static_cast<double>(cache_.k_scale_data()[slot]);
            const double v =
                kv8::decode(cache_.dtype(), static_cast<const uint8_t*>(cache_.v_data())[at]) *
                static_cast<double>(cache_.v_scale_data()[slot]);
            differ += (k != oracle_cache_.k[at]) + (v != oracle_cache_.v[at]);
          }
        }
      }
    }
    EXPECT_EQ(differ, 0) << what << ": cache values that are not the oracle's";
  }

 private:
  LayerConfig config_;
  LayerWeights weights_;
  int64_t batch_;
  float grid_;
  std::mt19937 rng_;
  std::unique_ptr<AttentionLayer> layer_;
  KvCache cache_, paged_;
  LayerCache oracle_cache_;
};

std::vector<int64_t> rows(const std::vector<std::pair<int64_t, int64_t>>& start_and_count) {
  std::vector<int64_t> positions;
  for (const auto& [start, count] : start_and_count) {
    for (int64_t t = 0; t < count; ++t) positions.push_back(start + t);
  }
  return positions;
}

// Prefill (attention_cte), a second chunk that continues sequence 0 and rewrites sequence 1 from
// position 30 (prefix caching at two prior lengths), then decode (decode_attention) at two
// different positions, single tokens and a 3-token speculation chunk.
void run_conversation(const LayerConfig& config, int64_t block_size = 0,
                      const LayerWeights* weights = nullptr, float grid = 0) {
  std::mt19937 rng(11);
  SideBySide run(config, weights != nullptr ? *weights : random_weights(config, &rng), 2, 96,
                 block_size, grid);
  run.step(rows({{0, 40}, {0, 40}}), "prefill");
  run.step(rows({{40, 24}, {30, 24}}), "second chunk");
  for (int step = 0; step < 3; ++step) {
    run.step(rows({{64 + step, 1}, {54 + step, 1}}), "decode " + std::to_string(step));
  }
  run.step(rows({{67, 3}, {57, 3}}), "speculation chunk");
}

class AttentionLayerTest : public ::testing::TestWithParam<DType> {};

TEST_P(AttentionLayerTest, GqaWithEverythingOn) { run_conversation(everything_on(GetParam())); }

// The same conversation on block pools (pages of 1, 3 and 16 slots at shuffled places): against
// the oracle, and bitwise the dense cache's outputs and lengths at every step.
TEST_P(AttentionLayerTest, PagedCacheBitwiseTheDenseOne) {
  for (int64_t block_size : {1, 3, 16}) {
    SCOPED_TRACE("pages of " + std::to_string(block_size));
    run_conversation(everything_on(GetParam()), block_size);
  }
}

TEST_P(AttentionLayerTest, MqaPlain) {
  LayerConfig c = small_config(64, 8, 1, 16);
  c.dtype = GetParam();
  run_conversation(c);
}

TEST_P(AttentionLayerTest, MhaNoRopeCustomScale) {
  LayerConfig c = small_config(24, 3, 3, 8);
  c.rope = false;
  c.qk_scale = 0.2;
  c.dtype = GetParam();
  run_conversation(c);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AttentionLayerTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& param_info) {
                           return std::string(dtype_name(param_info.param));
                         });

// An 8-bit cache (kv_cache_dtype) against the oracle's R8, every format under float32 and bf16
// activations, dense and on pages of 3 slots. Quantization rounds K and V to a coarse grid, so
// a K or V value one ulp away from the oracle's (another summation order) could land on the
// other side of a rounding boundary and move the output by a whole quantum. The data make K and
// V exact instead: x on multiples of 1/16 in [-1, 1], weights and biases on multiples of 1/64 in
// [-1/2, 1/2], fan-in 32, so every projection is an exact float32 (and bf16) sum, and no RoPE or
// q/k norm after it. The codes are then the oracle's and the outputs within the usual bound.
class Kv8Conversation : public ::testing::TestWithParam<std::tuple<DType, DType>> {};

TEST_P(Kv8Conversation, QuantizedOnWriteAndReadAsTheOracle) {
  const auto [format, activation] = GetParam();
  LayerConfig c = small_config(32, 4, 2, 8);
  c.rope = false;
  c.sliding_window = 20;
  c.qkv_bias = c.o_bias = c.sinks = true;
  c.dtype = activation;
  c.kv_cache_dtype = format;
  std::mt19937 rng(13);
  LayerWeights w = random_weights(c, &rng);
  for (std::vector<float>* part : {&w.q_proj, &w.k_proj, &w.v_proj, &w.o_proj, &w.q_bias, &w.k_bias,
                                   &w.v_bias, &w.o_bias, &w.sinks}) {
    snap(part, 64);
  }
  for (int64_t block_size : {0, 3}) {
    SCOPED_TRACE("block_size " + std::to_string(block_size));
    run_conversation(c, block_size, &w, 16);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Kv8Conversation,
                         ::testing::Combine(::testing::Values(DType::kInt8, DType::kFloat8E4M3,
                                                              DType::kFloat8E5M2),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16)),
                         [](const auto& param_info) {
                           return std::string(dtype_name(std::get<0>(param_info.param))) + "_" +
                                  dtype_name(std::get<1>(param_info.param));
                         });

// The cache holds codes and per-slot scales: a token's row comes back as code x scale with the
// scale its absmax over the format's largest, the slots not written keep scale 1.
TEST(Kv8Layer, CacheHoldsCodesAndScales) {
  LayerConfig c = small_config(16, 2, 1, 8);
  c.rope = false;
  c.kv_cache_dtype = DType::kInt8;
  std::mt19937 rng(4);
  std::unique_ptr<AttentionLayer> layer;
  ASSERT_TRUE(AttentionLayer::create(c, random_weights(c, &rng), &layer).ok);
  KvCache cache;
  ASSERT_TRUE(layer->new_cache(1, 8, &cache).ok);
  EXPECT_EQ(cache.dtype(), DType::kInt8);
  ASSERT_NE(cache.k_scale_data(), nullptr);
  const std::vector<float> x = random_vector(&rng, 3 * 16, 1.0f);
  const std::vector<int64_t> pos = {0, 1, 2};
  std::vector<float> out(3 * 16);
  ASSERT_TRUE(layer
                  ->forward(TensorView::contiguous(x.data(), DType::kFloat32, {1, 3, 16}),
                            TensorView::contiguous(pos.data(), DType::kInt64, {1, 3}), &cache,
                            MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, 3, 16}))
                  .ok);
  const auto* codes = static_cast<const int8_t*>(cache.k_data());
  for (int64_t slot = 0; slot < 8; ++slot) {
    int largest = 0;
    for (int64_t ch = 0; ch < 8; ++ch) largest = std::max(largest, std::abs(codes[slot * 8 + ch]));
    EXPECT_EQ(largest, slot < 3 ? 127 : 0) << "slot " << slot;  // the absmax encodes to 127
    if (slot >= 3) {
      EXPECT_EQ(cache.k_scale_data()[slot], 1.0f) << "slot " << slot;
    } else {
      EXPECT_GT(cache.k_scale_data()[slot], 0.0f) << "slot " << slot;
    }
  }
  c.kv_cache_dtype = DType::kBFloat16;
  expect_error(AttentionLayer::create(c, random_weights(c, &rng), &layer),
               "kv_cache_dtype: must be int8, float8_e4m3fn, float8_e5m2 or the activation dtype "
               "(float32), got bfloat16");
  KvCache float_cache;
  ASSERT_TRUE(KvCache::create(1, 1, 8, 8, DType::kFloat32, &float_cache).ok);
  EXPECT_EQ(float_cache.k_scale_data(), nullptr);
  // Refusals leave both caches (the int8 one's codes and scales included), x, the positions and
  // out as they were.
  const std::vector<int64_t> skipping = {5, 6, 7};
  flashcte::test::BufferSnapshot snap;
  add_cache(&snap, cache);
  add_cache(&snap, float_cache);
  snap.add("x", x).add("positions", pos).add("skipping positions", skipping);
  snap.add_output("out", out);
  expect_error(
      layer->forward(TensorView::contiguous(x.data(), DType::kFloat32, {1, 3, 16}),
                     TensorView::contiguous(pos.data(), DType::kInt64, {1, 3}), &float_cache,
                     MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, 3, 16})),
      "cache: holds (batch 1, kv_heads 1, head_dim 8, float32) but this call needs (batch "
      "1, kv_heads 1, head_dim 8, int8)");
  expect_error(
      layer->forward(TensorView::contiguous(x.data(), DType::kFloat32, {1, 3, 16}),
                     TensorView::contiguous(skipping.data(), DType::kInt64, {1, 3}), &cache,
                     MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, 3, 16})),
      "positions: row 0 token 0 is 5; a row must start in [0, cached length = 3]");
  EXPECT_TRUE(snap.unchanged());
}

TEST(AttentionLayerErrors, BadInputsAreRefusedWithTheArgumentNamed) {
  LayerConfig c = small_config(16, 2, 1, 8);
  std::mt19937 rng(3);
  std::unique_ptr<AttentionLayer> layer;
  ASSERT_TRUE(AttentionLayer::create(c, random_weights(c, &rng), &layer).ok);
  KvCache cache;
  ASSERT_TRUE(layer->new_cache(1, 8, &cache).ok);
  std::vector<float> x(5 * 16), out(5 * 16);
  const auto call = [&](const std::vector<int64_t>& positions, int64_t hidden, KvCache* kv) {
    const int64_t tokens = static_cast<int64_t>(positions.size());
    return layer->forward(
        TensorView::contiguous(x.data(), DType::kFloat32, {1, tokens, hidden}),
        TensorView::contiguous(positions.data(), DType::kInt64, {1, tokens}), kv,
        MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, tokens, 16}));
  };
  // Refused with `prefix`, every buffer of the call (the cache, x, positions, out) as it was.
  const auto refuses = [&](const std::vector<int64_t>& positions, int64_t hidden, KvCache* kv,
                           const std::string& prefix) {
    flashcte::test::BufferSnapshot snap;
    add_cache(&snap, *kv);
    snap.add("x", x).add("positions", positions).add_output("out", out);
    expect_error(call(positions, hidden, kv), prefix);
    EXPECT_TRUE(snap.unchanged()) << prefix;
  };
  refuses({0, 1}, 15, &cache, "x: last dimension 15");
  refuses({1, 2}, 16, &cache, "positions: row 0 token 0 is 1; a row must start in [0,");
  refuses({0, 2}, 16, &cache, "positions: row 0 token 1 is 2; positions within a row");
  ASSERT_TRUE(call({0, 1, 2, 3}, 16, &cache).ok);
  EXPECT_EQ(cache.length(0), 4);
  refuses({4, 5, 6, 7, 8}, 16, &cache, "positions: row 0 token 4 is 8, past the cache");
  KvCache other;
  ASSERT_TRUE(KvCache::create(1, 2, 8, 8, DType::kFloat32, &other).ok);
  refuses({0}, 16, &other, "cache: holds (batch 1, kv_heads 2");
  LayerWeights w = random_weights(c, &rng);
  w.k_proj.pop_back();
  expect_error(AttentionLayer::create(c, w, &layer), "k_proj: expected 128 floats, got 127");
  c.num_kv_heads = 3;
  expect_error(AttentionLayer::create(c, w, &layer), "num_kv_heads: must divide num_heads");
  expect_error(KvCache::create(1, 1, 0, 8, DType::kFloat32, &other), "max_len: must be >= 1");
}

}  // namespace
}  // namespace flashcte::reference::test
