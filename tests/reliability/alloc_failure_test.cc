// Out of memory at every allocation of a call in turn: flash_attn_with_kvcache's allocation k
// (k = 0, 1, ...) fails until a call needs fewer than k + 1. Each failed call must come back as a
// kMemory error, not throw or crash, with every caller-owned buffer, the caches above all, byte
// for byte as it was: allocations after the append (the kernels' schedule) fail after the new
// rows are in the caches, so this is the test of putting them back.
//
// Its own executable: it replaces the global operator new (counted, and failing on request).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "tests/kvcache_cases.h"
#include "tests/test_util.h"

namespace {

std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_fail_at{-1};  // the allocation (counted from 0) that fails; -1: none

}  // namespace

void* operator new(std::size_t bytes) {
  const int64_t fail_at = g_fail_at.load();
  if (fail_at >= 0 && g_allocations.fetch_add(1) == fail_at) throw std::bad_alloc();
  if (void* p = std::malloc(bytes > 0 ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t /*bytes*/) noexcept { std::free(p); }

namespace flashcte::test {
namespace {

// The buffers a call writes, after it.
struct Written {
  std::vector<unsigned char> k_cache, v_cache, out;
  std::vector<float> lse;
  bool operator==(const Written& o) const {
    return k_cache == o.k_cache && v_cache == o.v_cache && out == o.out && lse == o.lse;
  }
};

// Runs the case's call with allocation `fail_at` failing (-1: none); `*reached` says whether the
// call got that far.
Status run(const KvCase& c, int64_t fail_at, bool* reached, Written* written,
           BufferSnapshot* before = nullptr) {
  KvInputs in(c);
  const KvCacheOptions o = make_options(c, in);
  Tensor4 out(c.dtype, {c.batch, c.seqlen_q, c.heads, c.value_dim()});
  std::vector<float> lse(static_cast<size_t>(c.batch * c.heads * c.seqlen_q));
  if (before != nullptr) {
    before->add("k_cache", in.k_cache.bytes()).add("v_cache", in.v_cache.bytes());
    before->add("q", in.q.bytes()).add("k", in.k.bytes()).add("v", in.v.bytes());
    before->add("cache_seqlens", in.seqlens).add("block_table", in.table);
    before->add_output("out", out.bytes()).add_output("lse", lse);
  }
  const MutableTensorView lse_view =
      MutableTensorView::contiguous(lse.data(), DType::kFloat32, {c.batch, c.heads, c.seqlen_q});
  g_allocations = 0;
  g_fail_at = fail_at;
  const Status s =
      flash_attn_with_kvcache(in.q.view(), in.k_cache.mutable_view(), in.v_cache.mutable_view(),
                              out.mutable_view(), lse_view, o);
  g_fail_at = -1;
  *reached = g_allocations > fail_at;
  if (before != nullptr && !s.ok) {
    const ::testing::AssertionResult unchanged = before->unchanged();
    if (!unchanged) return Status::Error(unchanged.message());
  }
  *written = {in.k_cache.bytes(), in.v_cache.bytes(), out.bytes(), lse};
  return s;
}

// Fails allocation k, for k = 0, 1, ..., of the case's call, until the call no longer reaches
// it. A failed call must be a kMemory error with every buffer as it was; one that succeeds
// anyway (a library routine that falls back when memory is short, as std::stable_sort's
// temporary buffer does) must write what the call without failures writes. Returns how many
// allocations the call made.
::testing::AssertionResult sweep(const KvCase& c) {
  bool reached = false;
  Written want;
  const Status whole = run(c, -1, &reached, &want);
  if (!whole.ok) return ::testing::AssertionFailure() << c.name << ": " << whole.message;
  for (int64_t k = 0;; ++k) {
    BufferSnapshot before;
    Written got;
    const Status s = run(c, k, &reached, &got, &before);
    if (!reached) {
      if (k == 0) return ::testing::AssertionFailure() << c.name << ": no allocation to fail";
      return ::testing::AssertionSuccess() << c.name << ": " << k << " allocations";
    }
    if (s.ok ? !(got == want) : s.kind != ErrorKind::kMemory) {
      return ::testing::AssertionFailure()
             << c.name << ", allocation " << k << " failed: "
             << (s.ok ? "succeeded with other bytes" : "not a memory error: " + s.message);
    }
  }
}

KvCase appending(std::string name, int64_t seqlen, int64_t page) {
  KvCase c = kv_case(std::move(name), DType::kBFloat16);
  c.batch = 2, c.heads = 4, c.kv_heads = 2, c.d = 16, c.capacity = 96;
  c.seqlen_q = c.seqlen_new = seqlen;
  c.page = page, c.rotary_dim = 8, c.causal = true, c.threads = 1;
  return c;
}

TEST(AllocFailure, DecodeAppendLeavesTheCachesAsTheyWere) {
  // One new token per sequence (the decode kernel), paged.
  EXPECT_TRUE(sweep(appending("decode_paged", 1, 16)));
}

TEST(AllocFailure, ChunkAppendLeavesTheCachesAsTheyWere) {
  // 40 new tokens per sequence (the prefill kernel over the pages), paged and dense.
  EXPECT_TRUE(sweep(appending("chunk_paged", 40, 16)));
  EXPECT_TRUE(sweep(appending("chunk_dense", 40, 0)));
}

}  // namespace
}  // namespace flashcte::test
