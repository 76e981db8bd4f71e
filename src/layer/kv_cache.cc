// KvCache (include/flashcte/layer.h): one layer's K and V in the activation dtype or an 8-bit
// format with a scale per slot, zero-initialized as the module's (LAYER.md section 7): dense
// (batch, kv_heads, max_len, head_dim), or a block pool (num_blocks, kv_heads, block_size,
// head_dim) the sequences name through their block tables.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <new>
#include <string>

#include "flashcte/layer.h"
#include "src/core/kv8.h"
#include "src/core/pages.h"

namespace flashcte {
namespace {}  // namespace

void KvCache::Free::operator()(uint8_t* p) const { std::free(p); }

// `rows` x kv_heads x `slots` x head_dim elements each for K and V, zeroed.
Status KvCache::allocate(int64_t rows, int64_t kv_heads, int64_t slots, int64_t head_dim,
                         DType dtype, KvCache* cache) {
  if (kv_heads < 1 || head_dim < 1) {
    return Status::Error("kv_heads, head_dim: must be >= 1");
  }
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16 &&
      !kv8::is_8bit(dtype)) {
    return Status::Error(
        "dtype: the cache holds float32, bfloat16, float16, int8, float8_e4m3fn or float8_e5m2");
  }
  const int64_t limit = std::numeric_limits<int64_t>::max() / 8;
  int64_t elements = rows;
  for (int64_t factor : {kv_heads, slots, head_dim}) {
    if (elements > limit / factor) {
      return Status::Error("max_len: a cache of " + std::to_string(rows) + " x " +
                           std::to_string(kv_heads) + " x " + std::to_string(slots) + " x " +
                           std::to_string(head_dim) + " elements does not fit in memory");
    }
    elements *= factor;
  }
  try {
    const size_t bytes = static_cast<size_t>(elements) * static_cast<size_t>(dtype_size(dtype));
    cache->kv_heads_ = kv_heads;
    cache->head_dim_ = head_dim;
    cache->dtype_ = dtype;
    cache->k_.reset(static_cast<uint8_t*>(internal::allocate_pages(bytes)));
    cache->v_.reset(static_cast<uint8_t*>(internal::allocate_pages(bytes)));
    if (kv8::is_8bit(dtype)) {
      // One scale per slot and KV head; 1 (a valid scale) until a token is written there.
      const auto slots_total = static_cast<size_t>(elements / head_dim);
      for (std::unique_ptr<float[]>* scale : {&cache->k_scale_, &cache->v_scale_}) {
        scale->reset(new float[slots_total]);
        std::fill_n(scale->get(), slots_total, 1.0f);
      }
    }
  } catch (const std::bad_alloc&) {
    return Status::Error(
        "max_len: allocation of the cache (2 x " + std::to_string(elements) + " elements) failed",
        ErrorKind::kMemory);
  }
  return Status::Ok();
}

Status KvCache::create(int64_t batch, int64_t kv_heads, int64_t max_len, int64_t head_dim,
                       DType dtype, KvCache* cache) {
  if (cache == nullptr) return Status::Error("cache: must not be null");
  if (batch < 1) return Status::Error("batch: must be >= 1, got " + std::to_string(batch));
  if (max_len < 1) return Status::Error("max_len: must be >= 1, got " + std::to_string(max_len));
  KvCache fresh;
  if (Status s = allocate(batch, kv_heads, max_len, head_dim, dtype, &fresh); !s.ok) return s;
  fresh.batch_ = batch;
  fresh.max_len_ = max_len;
  fresh.lengths_.assign(static_cast<size_t>(batch), 0);
  *cache = std::move(fresh);
  return Status::Ok();
}

Status KvCache::create_paged(int64_t batch, int64_t num_blocks, int64_t block_size,
                             int64_t kv_heads, int64_t head_dim, DType dtype, KvCache* cache) {
  if (cache == nullptr) return Status::Error("cache: must not be null");
  if (batch < 1) return Status::Error("batch: must be >= 1, got " + std::to_string(batch));
  if (num_blocks < 1 || num_blocks > std::numeric_limits<int32_t>::max()) {
    return Status::Error("num_blocks: must be in [1, 2^31 - 1] (int32 block tables), got " +
                         std::to_string(num_blocks));
  }
  if (block_size < 1)
    return Status::Error("block_size: must be >= 1, got " + std::to_string(block_size));
  KvCache fresh;
  if (Status s = allocate(num_blocks, kv_heads, block_size, head_dim, dtype, &fresh); !s.ok) {
    return s;
  }
  fresh.batch_ = batch;
  fresh.num_blocks_ = num_blocks;
  fresh.block_size_ = block_size;
  fresh.lengths_.assign(static_cast<size_t>(batch), 0);
  fresh.pages_.resize(static_cast<size_t>(batch));
  *cache = std::move(fresh);
  return Status::Ok();
}

int64_t KvCache::max_len() const {
  if (!paged()) return max_len_;
  size_t most = 0;
  for (const std::vector<int32_t>& p : pages_) most = std::max(most, p.size());
  return static_cast<int64_t>(most) * block_size_;
}

int64_t KvCache::capacity(int64_t b) const {
  return paged() ? static_cast<int64_t>(pages(b).size()) * block_size_ : max_len_;
}

Status KvCache::assign(int64_t b, const std::vector<int32_t>& pages, int64_t length) {
  if (!paged()) return Status::Error("cache: a dense cache has no pages to assign");
  if (b < 0 || b >= batch_) {
    return Status::Error("b: must be in [0, batch = " + std::to_string(batch_) + "), got " +
                         std::to_string(b));
  }
  std::vector<int32_t> sorted = pages;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < pages.size(); ++i) {
    if (pages[i] < 0 || pages[i] >= num_blocks_) {
      return Status::Error("pages: [" + std::to_string(static_cast<int64_t>(i)) +
                           "] = " + std::to_string(pages[i]) +
                           " must be in [0, num_blocks = " + std::to_string(num_blocks_) + ")");
    }
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      return Status::Error("pages: page " + std::to_string(sorted[i]) +
                           " is named twice; a sequence's slots are distinct");
    }
  }
  const int64_t slots = static_cast<int64_t>(pages.size()) * block_size_;
  if (length < 0 || length > slots) {
    return Status::Error("length: must be in [0, " + std::to_string(slots) + "], the slots of " +
                         std::to_string(static_cast<int64_t>(pages.size())) + " pages of " +
                         std::to_string(block_size_) + ", got " + std::to_string(length));
  }
  pages_[static_cast<size_t>(b)] = pages;
  lengths_[static_cast<size_t>(b)] = length;
  return Status::Ok();
}

}  // namespace flashcte
