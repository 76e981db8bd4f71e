// KvCache (include/flashcte/layer.h): one layer's K and V, (batch, kv_heads, max_len, head_dim)
// in the activation dtype, zero-initialized as the module's (LAYER.md section 7).
#include <cstdlib>
#include <limits>
#include <new>
#include <string>

#include "flashcte/layer.h"
#include "src/core/pages.h"

namespace flashcte {

void KvCache::Free::operator()(uint8_t* p) const { std::free(p); }

Status KvCache::create(int64_t batch, int64_t kv_heads, int64_t max_len, int64_t head_dim,
                       DType dtype, KvCache* cache) {
  if (cache == nullptr) return Status::Error("cache: must not be null");
  if (batch < 1) return Status::Error("batch: must be >= 1, got " + std::to_string(batch));
  if (max_len < 1) return Status::Error("max_len: must be >= 1, got " + std::to_string(max_len));
  if (kv_heads < 1 || head_dim < 1) {
    return Status::Error("kv_heads, head_dim: must be >= 1");
  }
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return Status::Error("dtype: the cache holds float32, bfloat16 or float16");
  }
  const int64_t limit = std::numeric_limits<int64_t>::max() / 8;
  int64_t elements = batch;
  for (int64_t factor : {kv_heads, max_len, head_dim}) {
    if (elements > limit / factor) {
      return Status::Error("max_len: a cache of " + std::to_string(batch) + " x " +
                           std::to_string(kv_heads) + " x " + std::to_string(max_len) + " x " +
                           std::to_string(head_dim) + " elements does not fit in memory");
    }
    elements *= factor;
  }
  try {
    const size_t bytes = static_cast<size_t>(elements) * static_cast<size_t>(dtype_size(dtype));
    KvCache fresh;
    fresh.batch_ = batch;
    fresh.kv_heads_ = kv_heads;
    fresh.max_len_ = max_len;
    fresh.head_dim_ = head_dim;
    fresh.dtype_ = dtype;
    fresh.k_.reset(static_cast<uint8_t*>(internal::allocate_pages(bytes)));
    fresh.v_.reset(static_cast<uint8_t*>(internal::allocate_pages(bytes)));
    fresh.lengths_.assign(static_cast<size_t>(batch), 0);
    *cache = std::move(fresh);
  } catch (const std::bad_alloc&) {
    return Status::Error("max_len: allocation of the cache (2 x " + std::to_string(elements) +
                         " elements) failed");
  }
  return Status::Ok();
}

}  // namespace flashcte
