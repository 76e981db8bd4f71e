// The KV cache's storage (src/core/pages.h): zeroed, 2 MiB-aligned (huge-page eligible) from
// 2 MiB up and on 64-byte lines below, and its views cover every element.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "flashcte/layer.h"
#include "src/core/pages.h"

namespace flashcte {
namespace {

using internal::allocate_pages;
using internal::kHugePageBytes;

bool all_zero(const void* p, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

uintptr_t address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

TEST(Pages, LargeBuffersStartOnAHugePageAndAreZeroed) {
  for (size_t bytes : {kHugePageBytes, kHugePageBytes + 1, 3 * kHugePageBytes - 64}) {
    std::unique_ptr<void, decltype(&std::free)> p(allocate_pages(bytes), &std::free);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(address(p.get()) % kHugePageBytes, 0u) << bytes;
    EXPECT_TRUE(all_zero(p.get(), bytes)) << bytes;
  }
}

TEST(Pages, SmallBuffersStartOnACacheLineAndAreZeroed) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, kHugePageBytes - 1}) {
    std::unique_ptr<void, decltype(&std::free)> p(allocate_pages(bytes), &std::free);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(address(p.get()) % 64, 0u) << bytes;
    EXPECT_TRUE(all_zero(p.get(), bytes)) << bytes;
  }
}

TEST(Pages, ImpossibleSizesThrowBadAlloc) {
  EXPECT_THROW(allocate_pages(SIZE_MAX), std::bad_alloc);
  EXPECT_THROW(allocate_pages(static_cast<size_t>(PTRDIFF_MAX)), std::bad_alloc);
}

TEST(KvCacheStorage, ZeroedDenseAndHugePageAlignedWhenLarge) {
  // (2, 4, 1024, 128) bfloat16: 2 MiB each for K and V.
  KvCache cache;
  ASSERT_TRUE(KvCache::create(2, 4, 1024, 128, DType::kBFloat16, &cache).ok);
  const size_t bytes = size_t{2} * 4 * 1024 * 128 * 2;
  for (const void* p :
       {static_cast<const KvCache&>(cache).k_data(), static_cast<const KvCache&>(cache).v_data()}) {
    EXPECT_EQ(address(p) % kHugePageBytes, 0u);
    EXPECT_TRUE(all_zero(p, bytes));
  }
  EXPECT_NE(cache.k_data(), cache.v_data());
  // The whole view is writable (ASan checks the bounds in CI's sanitizer run).
  static_cast<unsigned char*>(cache.k_data())[bytes - 1] = 1;
  static_cast<unsigned char*>(cache.v_data())[bytes - 1] = 1;
  // Moving hands the storage over.
  const void* k = cache.k_data();
  KvCache moved = std::move(cache);
  EXPECT_EQ(moved.k_data(), k);
}

TEST(KvCacheStorage, SmallCachesAreLineAligned) {
  KvCache cache;
  ASSERT_TRUE(KvCache::create(1, 1, 3, 5, DType::kFloat16, &cache).ok);
  EXPECT_EQ(address(cache.k_data()) % 64, 0u);
  EXPECT_TRUE(all_zero(cache.v_data(), 3 * 5 * 2));
}

}  // namespace
}  // namespace flashcte
