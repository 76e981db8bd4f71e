// The fast layer's caches in the attention layer's tests (attention_layer_test.cc,
// attention_layer_paged_test.cc): every buffer of a KvCache into a BufferSnapshot, and a block
// pool whose pages sit at shuffled places.
#ifndef FLASHCTE_TESTS_LAYER_LAYER_CACHE_CASES_H_
#define FLASHCTE_TESTS_LAYER_LAYER_CACHE_CASES_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashcte/layer.h"
#include "tests/test_util.h"

namespace flashcte::reference::test {

// Every buffer of a fast cache into `snap`: the K and V storage, their scales (8-bit caches), the
// lengths and, paged, each sequence's pages.
inline void add_cache(flashcte::test::BufferSnapshot* snap, const KvCache& cache) {
  const int64_t rows = cache.paged() ? cache.num_blocks() : cache.batch();
  const int64_t slots = cache.paged() ? cache.block_size() : cache.max_len();
  const size_t n = static_cast<size_t>(rows * cache.kv_heads() * slots);
  const size_t bytes = n * static_cast<size_t>(cache.head_dim() * dtype_size(cache.dtype()));
  snap->add("cache k", cache.k_data(), bytes).add("cache v", cache.v_data(), bytes);
  if (cache.k_scale_data() != nullptr) {
    snap->add("cache k_scale", cache.k_scale_data(), n * sizeof(float));
    snap->add("cache v_scale", cache.v_scale_data(), n * sizeof(float));
  }
  snap->add("cache lengths", cache.lengths());
  for (int64_t b = 0; cache.paged() && b < cache.batch(); ++b) {
    snap->add("cache pages of sequence " + std::to_string(b), cache.pages(b));
  }
}

// A block pool for `batch` sequences of `max_len` slots in pages of `block_size`, each
// sequence's pages at shuffled places among two spare ones.
inline KvCache paged_cache(const AttentionLayer& layer, int64_t batch, int64_t max_len,
                           int64_t block_size, uint32_t seed) {
  const int64_t pages = (max_len + block_size - 1) / block_size;
  std::vector<int32_t> order(static_cast<size_t>(batch * pages + 2));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  KvCache cache;
  EXPECT_TRUE(layer.new_paged_cache(batch, batch * pages + 2, block_size, &cache).ok);
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<int32_t> own(order.begin() + b * pages, order.begin() + (b + 1) * pages);
    EXPECT_TRUE(cache.assign(b, own, 0).ok);
  }
  return cache;
}

}  // namespace flashcte::reference::test

#endif  // FLASHCTE_TESTS_LAYER_LAYER_CACHE_CASES_H_
