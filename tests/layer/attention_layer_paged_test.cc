// The fast attention layer (include/flashcte/layer.h) on block pools shared the way a serving
// engine's prefix cache shares them: sequences reading another's prompt pages, which no call may
// write, and refusals (bad pages or positions, on float and 8-bit pools) that leave the pool, its
// scales, lengths and pages byte for byte as they were. The conversations against the float64
// oracle: attention_layer_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcte/layer.h"
#include "tests/layer/layer_cache_cases.h"
#include "tests/layer/layer_test_util.h"
#include "tests/test_util.h"

namespace flashcte::reference::test {
namespace {

// Runs the layer on `cache` with x rows `x` (batch, T, hidden) at `positions`; float32 out.
Status forward(const AttentionLayer& layer, KvCache* cache, const std::vector<float>& x,
               const std::vector<int64_t>& positions, std::vector<float>* out) {
  const int64_t batch = cache->batch(), tokens = static_cast<int64_t>(positions.size()) / batch;
  const int64_t hidden = layer.config().hidden_size;
  out->assign(static_cast<size_t>(batch * tokens * hidden), 0.0f);
  return layer.forward(
      TensorView::contiguous(x.data(), DType::kFloat32, {batch, tokens, hidden}),
      TensorView::contiguous(positions.data(), DType::kInt64, {batch, tokens}), cache,
      MutableTensorView::contiguous(out->data(), DType::kFloat32, {batch, tokens, hidden}));
}

// Runs `layer` on `cache` at `positions` (batch rows of T each) with random x, expecting a refusal
// with `prefix` and every buffer of the call (the cache's storage, scales, lengths and pages, x,
// positions, out) byte for byte as it was.
void expect_refused_writing_nothing(const AttentionLayer& layer, KvCache* cache,
                                    const std::vector<int64_t>& positions, std::mt19937* rng,
                                    const std::string& prefix) {
  const int64_t batch = cache->batch(), tokens = static_cast<int64_t>(positions.size()) / batch;
  const int64_t hidden = layer.config().hidden_size;
  const std::vector<float> x = random_vector(rng, batch * tokens * hidden, 1.0f);
  std::vector<float> out(static_cast<size_t>(batch * tokens * hidden));
  flashcte::test::BufferSnapshot snap;
  add_cache(&snap, *cache);
  snap.add("x", x).add("positions", positions).add_output("out", out);
  expect_error(
      layer.forward(
          TensorView::contiguous(x.data(), DType::kFloat32, {batch, tokens, hidden}),
          TensorView::contiguous(positions.data(), DType::kInt64, {batch, tokens}), cache,
          MutableTensorView::contiguous(out.data(), DType::kFloat32, {batch, tokens, hidden})),
      prefix);
  EXPECT_TRUE(snap.unchanged()) << prefix;
}

// A serving engine's prefix cache: sequence 1 takes sequence 0's prompt pages (read-only) and
// its own pages after them; its decode steps are bitwise those of a dense cache that prefilled
// the same prompt, and a call that would write into the shared pages is refused with the pool
// byte for byte as it was.
TEST(PagedLayer, SharedPrefixPagesAreReadOnly) {
  const LayerConfig c = everything_on(DType::kFloat32);
  std::mt19937 rng(5);
  std::unique_ptr<AttentionLayer> layer;
  ASSERT_TRUE(AttentionLayer::create(c, random_weights(c, &rng), &layer).ok);
  const int64_t hidden = c.hidden_size, prompt = 32;
  const std::vector<float> p = random_vector(&rng, prompt * hidden, 1.0f);
  const std::vector<float> junk = random_vector(&rng, prompt * hidden, 1.0f);
  std::vector<float> both_prompt = p, prompt_and_junk = p;
  both_prompt.insert(both_prompt.end(), p.begin(), p.end());
  prompt_and_junk.insert(prompt_and_junk.end(), junk.begin(), junk.end());
  std::vector<int64_t> prefill_pos;
  for (int b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < prompt; ++t) prefill_pos.push_back(t);
  }
  KvCache dense, pool;
  ASSERT_TRUE(layer->new_cache(2, 64, &dense).ok);
  ASSERT_TRUE(layer->new_paged_cache(2, 12, 16, &pool).ok);
  ASSERT_TRUE(pool.assign(0, {5, 2, 7, 0}, 0).ok);
  ASSERT_TRUE(pool.assign(1, {9, 4, 1, 3}, 0).ok);
  std::vector<float> dense_out, paged_out;
  ASSERT_TRUE(forward(*layer, &dense, both_prompt, prefill_pos, &dense_out).ok);
  ASSERT_TRUE(forward(*layer, &pool, prompt_and_junk, prefill_pos, &paged_out).ok);
  // Sequence 1 now reuses sequence 0's prompt pages, 5 and 2, then pages of its own. The dense
  // cache gets the same: sequence 0's prompt slots copied into sequence 1's (the GEMM may round
  // a row differently by its place in the batch, so the two prefills need not agree bitwise).
  ASSERT_TRUE(pool.assign(1, {5, 2, 8, 6}, prompt).ok);
  const size_t slot = static_cast<size_t>(c.head_dim) * sizeof(float);
  for (void* storage : {dense.k_data(), dense.v_data()}) {
    auto* bytes = static_cast<uint8_t*>(storage);
    for (int64_t h = 0; h < c.num_kv_heads; ++h) {
      std::memcpy(bytes + (c.num_kv_heads + h) * dense.max_len() * slot,
                  bytes + h * dense.max_len() * slot, static_cast<size_t>(prompt) * slot);
    }
  }
  for (int64_t step = 0; step < 3; ++step) {
    const std::vector<float> x = random_vector(&rng, 2 * hidden, 1.0f);
    const std::vector<int64_t> pos = {prompt + step, prompt + step};
    ASSERT_TRUE(forward(*layer, &dense, x, pos, &dense_out).ok);
    ASSERT_TRUE(forward(*layer, &pool, x, pos, &paged_out).ok);
    for (int64_t b = 0; b < 2; ++b) {
      EXPECT_TRUE(std::equal(paged_out.begin() + b * hidden, paged_out.begin() + (b + 1) * hidden,
                             dense_out.begin() + b * hidden))
          << "decode step " << step << ", sequence " << b;
    }
  }
  EXPECT_EQ(pool.lengths(), dense.lengths());
  // Rewriting sequence 1 from position 30 would write into page 2, sequence 0's.
  const std::vector<int64_t> lengths = pool.lengths();
  expect_refused_writing_nothing(*layer, &pool, {35, 36, 37, 38, 30, 31, 32, 33}, &rng,
                                 "positions: row 1 writes into page 2");
  EXPECT_EQ(pool.lengths(), lengths);
}

TEST(PagedLayer, BadPagesAndPositionsAreRefusedWithThePoolUntouched) {
  const LayerConfig c = everything_on(DType::kFloat32);
  std::mt19937 rng(6);
  std::unique_ptr<AttentionLayer> layer;
  ASSERT_TRUE(AttentionLayer::create(c, random_weights(c, &rng), &layer).ok);
  KvCache pool, dense;
  expect_error(layer->new_paged_cache(1, 0, 16, &pool), "num_blocks:");
  expect_error(layer->new_paged_cache(1, 4, 0, &pool), "block_size:");
  ASSERT_TRUE(layer->new_paged_cache(2, 6, 4, &pool).ok);
  ASSERT_TRUE(layer->new_cache(1, 8, &dense).ok);
  expect_error(dense.assign(0, {0}, 0), "cache: a dense cache");
  expect_error(pool.assign(2, {0}, 0), "b:");
  expect_error(pool.assign(0, {0, 6}, 0), "pages: [1] = 6");
  expect_error(pool.assign(0, {-1}, 0), "pages: [0] = -1");
  expect_error(pool.assign(0, {3, 1, 3}, 0), "pages: page 3 is named twice");
  expect_error(pool.assign(0, {0, 1}, 9), "length:");
  ASSERT_TRUE(pool.assign(0, {0, 1}, 0).ok);
  ASSERT_TRUE(pool.assign(1, {2}, 0).ok);
  {
    // Refused assignments leave the pool (its storage, lengths and pages) as it was.
    flashcte::test::BufferSnapshot snap;
    add_cache(&snap, pool);
    expect_error(pool.assign(0, {0, 6}, 0), "pages: [1] = 6");
    expect_error(pool.assign(1, {3, 1, 3}, 0), "pages: page 3 is named twice");
    expect_error(pool.assign(1, {3}, 5), "length:");
    ASSERT_EQ(pool.pages(0).size(), 2u);  // resized pages could not be compared
    ASSERT_EQ(pool.pages(1).size(), 1u);
    EXPECT_TRUE(snap.unchanged());
  }
  // Sequence 1 has one page of 4 slots: 5 tokens run past it.
  expect_refused_writing_nothing(
      *layer, &pool, {0, 1, 2, 3, 4, 0, 1, 2, 3, 4}, &rng,
      "positions: row 1 token 4 is 4, past sequence 1's pages (4 slots)");
  EXPECT_EQ(pool.lengths(), (std::vector<int64_t>{0, 0}));
  // A sequence without pages cannot take a token.
  ASSERT_TRUE(pool.assign(1, {}, 0).ok);
  expect_refused_writing_nothing(
      *layer, &pool, {0, 0}, &rng,
      "positions: row 1 token 0 is 0, past sequence 1's pages (0 slots)");
}

// The same on an 8-bit pool (int8 codes with a float32 scale per slot): refusals found at the
// last row (sequence 1 past its pages, or writing into a page sequence 0 also names) leave the
// codes, the scales, the lengths and the pages as they were, after a prefill filled them.
TEST(PagedLayer, Kv8RefusalsLeaveCodesAndScalesAlone) {
  for (DType format : {DType::kInt8, DType::kFloat8E4M3}) {
    SCOPED_TRACE(dtype_name(format));
    LayerConfig c = everything_on(DType::kFloat32);
    c.kv_cache_dtype = format;
    std::mt19937 rng(8);
    std::unique_ptr<AttentionLayer> layer;
    ASSERT_TRUE(AttentionLayer::create(c, random_weights(c, &rng), &layer).ok);
    KvCache pool;
    ASSERT_TRUE(layer->new_paged_cache(2, 6, 4, &pool).ok);
    ASSERT_NE(pool.k_scale_data(), nullptr);
    ASSERT_TRUE(pool.assign(0, {0, 1}, 0).ok);
    ASSERT_TRUE(pool.assign(1, {2}, 0).ok);
    std::vector<float> out;
    ASSERT_TRUE(forward(*layer, &pool, random_vector(&rng, 2 * 4 * c.hidden_size, 1.0f),
                        {0, 1, 2, 3, 0, 1, 2, 3}, &out)
                    .ok);
    // Sequence 1's next token has no slot.
    expect_refused_writing_nothing(*layer, &pool, {4, 4}, &rng,
                                   "positions: row 1 token 0 is 4, past sequence 1's pages");
    // Sequence 1 takes sequence 0's first page as its prefix and rewrites from slot 2.
    ASSERT_TRUE(pool.assign(1, {0, 3}, 4).ok);
    expect_refused_writing_nothing(*layer, &pool, {4, 5, 2, 3}, &rng,
                                   "positions: row 1 writes into page 0");
    EXPECT_EQ(pool.lengths(), (std::vector<int64_t>{4, 4}));
  }
}

}  // namespace
}  // namespace flashcte::reference::test
