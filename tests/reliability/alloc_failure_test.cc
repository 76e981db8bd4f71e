// Out of memory at every allocation of a call in turn: flash_attn_with_kvcache's allocation k
// (k = 0, 1, ...) fails until a call needs fewer than k + 1. Each failed call must come back as a
// kMemory error, not throw or crash, with every caller-owned buffer, the caches above all, byte
// for byte as it was: allocations after the append (the kernels' schedule) fail after the new
// rows are in the caches, so this is the test of putting them back.
//
// The same for AttentionLayer::forward over its KvCache, and for attention_cte and
// decode_attention, which write only their outputs.
//
// Every attempt runs on a thread of its own: the kernels' per-thread scratch starts empty, so
// its growth is swept too (a warm thread would allocate nothing there), and must come before the
// first row is written.
//
// Its own executable: it replaces the global operator new (counted, and failing on request).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "flashcte/flashcte.h"
#include "flashcte/kvcache.h"
#include "flashcte/layer.h"
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
// Every form that pairs with it comes from malloc too (a sanitizer's own operator new would
// otherwise meet this free: std::stable_sort takes its buffer with the nothrow form).
void* operator new[](std::size_t bytes) { return operator new(bytes); }
// The aligned forms (the kernels' cache-line-aligned scratch), from aligned_alloc.
void* operator new(std::size_t bytes, std::align_val_t align) {
  const int64_t fail_at = g_fail_at.load();
  if (fail_at >= 0 && g_allocations.fetch_add(1) == fail_at) throw std::bad_alloc();
  const auto alignment = static_cast<std::size_t>(align);
  const std::size_t rounded =
      (std::max<std::size_t>(bytes, 1) + alignment - 1) / alignment * alignment;
  if (void* p = std::aligned_alloc(alignment, rounded)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t bytes, std::align_val_t align) {
  return operator new(bytes, align);
}
void* operator new(std::size_t bytes, const std::nothrow_t& /*tag*/) noexcept {
  try {
    return operator new(bytes);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t& tag) noexcept {
  return operator new(bytes, tag);
}
// GCC, inlining these into std::allocator, takes the free to meet the built-in operator new
// (-Wmismatched-new-delete); both ends here are malloc's.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t /*bytes*/) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t /*bytes*/) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t& /*tag*/) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t& /*tag*/) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t /*align*/) noexcept { std::free(p); }
void operator delete(void* p, std::size_t /*bytes*/, std::align_val_t /*align*/) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t /*align*/) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t /*bytes*/, std::align_val_t /*align*/) noexcept {
  std::free(p);
}
#pragma GCC diagnostic pop

namespace flashcte::test {
namespace {

// `call()` on a new thread: its per-thread scratch (and an OpenMP team of its own) start empty.
template <class Call>
auto on_new_thread(const Call& call) {
  decltype(call()) result;
  std::thread([&] { result = call(); }).join();
  return result;
}

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
  Status s = on_new_thread([&] {
    g_allocations = 0;
    g_fail_at = fail_at;
    Status status =
        flash_attn_with_kvcache(in.q.view(), in.k_cache.mutable_view(), in.v_cache.mutable_view(),
                                out.mutable_view(), lse_view, o);
    g_fail_at = -1;
    return status;
  });
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

// AttentionLayer::forward over its own KvCache: a layer of 4 query heads over 2 KV heads
// (d 8, hidden 32) whose cache holds 6 tokens, then a call of `tokens` tokens from `start`
// (below 6: it rewrites cached slots). Sweeps its allocations as sweep() does; the cache's
// storage and lengths must be as they were after each failed call.
::testing::AssertionResult sweep_layer(int64_t start, int64_t tokens) {
  LayerConfig config;
  config.hidden_size = 32, config.num_heads = 4, config.num_kv_heads = 2, config.head_dim = 8;
  config.sinks = true;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  const auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    return v;
  };
  LayerWeights w;
  w.q_proj = random(32 * 32), w.k_proj = random(16 * 32), w.v_proj = random(16 * 32);
  w.o_proj = random(32 * 32), w.sinks = random(4);
  std::unique_ptr<AttentionLayer> layer;
  if (const Status s = AttentionLayer::create(config, w, &layer); !s.ok) {
    return ::testing::AssertionFailure() << s.message;
  }
  const std::vector<float> prompt = random(6 * 32), x = random(static_cast<size_t>(tokens * 32));
  std::vector<int64_t> prompt_positions(6), positions(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < 6; ++i) prompt_positions[i] = i;
  for (int64_t i = 0; i < tokens; ++i) positions[i] = start + i;
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(6, tokens) * 32));
  // The views are made before a sweep counts (their shapes are vectors).
  struct Views {
    TensorView x, positions;
    MutableTensorView out;
  };
  const auto views = [&](const std::vector<float>& in, const std::vector<int64_t>& pos) {
    const auto t = static_cast<int64_t>(pos.size());
    return Views{TensorView::contiguous(in.data(), DType::kFloat32, {1, t, 32}),
                 TensorView::contiguous(pos.data(), DType::kInt64, {1, t}),
                 MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, t, 32})};
  };
  const Views prompt_views = views(prompt, prompt_positions), call = views(x, positions);
  const size_t bytes = 2 * 64 * 8 * sizeof(float);  // (batch 1, kv_heads 2, max_len 64, d 8)
  // The call with allocation `fail_at` failing (-1: none) on a fresh cache that holds the
  // prompt; the cache's storage and lengths before and after it, and out.
  struct Attempt {
    Status status;
    bool reached = false;
    std::vector<unsigned char> before, after;
    std::vector<int64_t> lengths_before, lengths_after;
    std::vector<float> out;
  };
  const auto attempt = [&](int64_t fail_at) {
    Attempt a;
    KvCache cache;
    a.status = layer->new_cache(1, 64, &cache);
    if (a.status.ok)
      a.status = layer->forward(prompt_views.x, prompt_views.positions, &cache, prompt_views.out);
    if (!a.status.ok) return a;
    const auto storage = [&] {
      const auto* k_data = static_cast<const unsigned char*>(cache.k_data());
      const auto* v_data = static_cast<const unsigned char*>(cache.v_data());
      std::vector<unsigned char> both(k_data, k_data + bytes);
      both.insert(both.end(), v_data, v_data + bytes);
      return both;
    };
    a.before = storage();
    a.lengths_before = cache.lengths();
    a.status = on_new_thread([&] {
      g_allocations = 0;
      g_fail_at = fail_at;
      Status status = layer->forward(call.x, call.positions, &cache, call.out);
      g_fail_at = -1;
      return status;
    });
    a.reached = g_allocations > fail_at;
    a.after = storage();
    a.lengths_after = cache.lengths();
    a.out = out;
    return a;
  };
  const Attempt want = attempt(-1);
  if (!want.status.ok) return ::testing::AssertionFailure() << want.status.message;
  for (int64_t k = 0;; ++k) {
    const Attempt got = attempt(k);
    if (!got.reached) {
      if (k == 0) return ::testing::AssertionFailure() << "no allocation to fail";
      return ::testing::AssertionSuccess() << k << " allocations";
    }
    // A call that succeeds anyway (std::stable_sort's buffer) must be the call without failures.
    const bool right = got.status.ok
                           ? got.after == want.after && got.lengths_after == want.lengths_after &&
                                 got.out == want.out
                           : got.status.kind == ErrorKind::kMemory && got.after == got.before &&
                                 got.lengths_after == got.lengths_before;
    if (!right) {
      return ::testing::AssertionFailure()
             << "from " << start << ", " << tokens << " tokens, allocation " << k << " failed: "
             << (got.status.ok
                     ? "succeeded with other results"
                     : "\"" + got.status.message + "\", " +
                           (got.after == got.before ? "the cache as it was" : "the cache changed"));
    }
  }
}

TEST(AllocFailure, LayerCallsLeaveTheirCacheAsItWas) {
  EXPECT_TRUE(sweep_layer(6, 1));   // a decode step
  EXPECT_TRUE(sweep_layer(3, 2));   // rewrites slots 3 and 4 (a rejected draft)
  EXPECT_TRUE(sweep_layer(2, 20));  // a chunk over slots 2..21 (the prefill kernel)
}

// A call that writes only its output (`call` returns its Status; its views are made before):
// each failed allocation must be a kMemory error with `out` as it was; a call that succeeds
// anyway must write what the call without failures writes.
template <class T, class Call>
::testing::AssertionResult sweep_output(const char* name, std::vector<T>* out, const Call& call) {
  const T unwritten = T(7);  // 7.0f, or a bfloat16 subnormal
  const auto attempt = [&](int64_t fail_at, Status* status) {
    std::fill(out->begin(), out->end(), unwritten);
    *status = on_new_thread([&] {
      g_allocations = 0;
      g_fail_at = fail_at;
      Status s = call();
      g_fail_at = -1;
      return s;
    });
    return g_allocations > fail_at;
  };
  Status s;
  attempt(-1, &s);
  if (!s.ok) return ::testing::AssertionFailure() << name << ": " << s.message;
  const std::vector<T> want = *out;
  for (int64_t k = 0;; ++k) {
    if (!attempt(k, &s)) {
      if (k == 0) return ::testing::AssertionFailure() << name << ": no allocation to fail";
      return ::testing::AssertionSuccess() << name << ": " << k << " allocations";
    }
    const bool untouched =
        std::all_of(out->begin(), out->end(), [&](T x) { return x == unwritten; });
    if (s.ok ? *out != want : s.kind != ErrorKind::kMemory || !untouched) {
      return ::testing::AssertionFailure()
             << name << ", allocation " << k << " failed: "
             << (s.ok ? "succeeded with other results"
                      : "\"" + s.message + "\"" + (untouched ? "" : ", out written"));
    }
  }
}

TEST(AllocFailure, AttentionCteAndDecodeAttentionWriteNothingWhenOutOfMemory) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(2 * 4 * 40 * 16), kv(2 * 2 * 64 * 16), out(q.size());
  for (float& x : q) x = u(rng);
  for (float& x : kv) x = u(rng);
  // attention_cte rank 4: a batch of 2, 4 heads over 2 of 40 tokens, d 16.
  const TensorView q4 = TensorView::contiguous(q.data(), DType::kFloat32, {2, 4, 40, 16});
  const TensorView k4 = TensorView::contiguous(kv.data(), DType::kFloat32, {2, 2, 40, 16});
  Outputs outputs;
  outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {2, 4, 40, 16});
  Options options;
  options.tp_k = true;
  EXPECT_TRUE(sweep_output("attention_cte", &out,
                           [&] { return attention_cte(q4, k4, k4, outputs, options); }));
  // decode_attention: 2 new tokens of 2 sequences over a 64-slot cache.
  const TensorView qd = TensorView::contiguous(q.data(), DType::kFloat32, {2, 4, 2, 16});
  const TensorView cache = TensorView::contiguous(kv.data(), DType::kFloat32, {2, 2, 64, 16});
  const std::vector<int64_t> positions = {40, 41, 62, 63};
  const TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {2, 2});
  DecodeOutputs decode_out;
  decode_out.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {2, 4, 2, 16});
  EXPECT_TRUE(sweep_output("decode_attention", &out, [&] {
    return decode_attention(qd, cache, cache, pos, decode_out, DecodeOptions{});
  }));
  // Over 2,100 slots: each pair's three chunks park partial states, and the merges write out.
  std::vector<float> long_kv(2 * 2 * 2100 * 16);
  for (float& x : long_kv) x = u(rng);
  const TensorView long_cache =
      TensorView::contiguous(long_kv.data(), DType::kFloat32, {2, 2, 2100, 16});
  const std::vector<int64_t> late = {2098, 2099, 2050, 2051};
  const TensorView late_pos = TensorView::contiguous(late.data(), DType::kInt64, {2, 2});
  EXPECT_TRUE(sweep_output("decode_attention, 3 chunks a pair", &out, [&] {
    return decode_attention(qd, long_cache, long_cache, late_pos, decode_out, DecodeOptions{});
  }));
  // A cache whose channels are not adjacent (a view of every other float): the decode kernel
  // gathers each block's rows.
  const TensorView strided_cache{
      long_kv.data(), DType::kFloat32, 4, {2, 2, 1050, 16}, {2 * 2100 * 16, 2100 * 16, 32, 2}};
  EXPECT_TRUE(sweep_output("decode_attention, gathered rows", &out, [&] {
    return decode_attention(qd, strided_cache, strided_cache, pos, decode_out, DecodeOptions{});
  }));
  // attention_cte of 8 rows over 3,000 keys on 2 threads: the KV axis is split, and the merges
  // write out.
  const TensorView q3 = TensorView::contiguous(q.data(), DType::kFloat32, {1, 8, 16});
  const TensorView k3 = TensorView::contiguous(long_kv.data(), DType::kFloat32, {1, 16, 3000});
  const TensorView v3 = TensorView::contiguous(long_kv.data(), DType::kFloat32, {1, 3000, 16});
  Outputs split_out;
  split_out.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {1, 8, 16});
  Options split;
  split.causal_mask = false;
  split.num_threads = 2;
  EXPECT_TRUE(sweep_output("attention_cte, split KV axis", &out,
                           [&] { return attention_cte(q3, k3, v3, split_out, split); }));
}

// A chunk of 40 queries (the prefill kernel) over an int8 paged cache with a scale per token: the
// prior's rows are gathered across its pages and scaled; in bfloat16 on the native kernels too.
TEST(AllocFailure, EightBitPagedPriorWritesNothingWhenOutOfMemory) {
  constexpr int64_t kPages = 8, kPage = 16, kKvHeads = 2, kD = 16, kHeads = 4, kRows = 40;
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> code(-127, 127);
  std::uniform_real_distribution<float> u(0.01f, 0.02f);
  std::vector<int8_t> k_codes(kPages * kPage * kKvHeads * kD), v_codes(k_codes.size());
  for (int8_t& x : k_codes) x = static_cast<int8_t>(code(rng));
  for (int8_t& x : v_codes) x = static_cast<int8_t>(code(rng));
  std::vector<float> k_scale(kPages * kPage * kKvHeads), v_scale(k_scale.size());
  for (float& x : k_scale) x = u(rng);
  for (float& x : v_scale) x = u(rng);
  const std::vector<int32_t> table = {6, 1, 4, 3, 0, 7, 2, 5};  // 2 sequences of 4 pages
  const std::vector<int32_t> seqlens = {60, 52};
  KvCacheOptions o;
  o.block_table = TensorView::contiguous(table.data(), DType::kInt32, {2, 4});
  o.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {2});
  o.k_scale =
      MutableTensorView::contiguous(k_scale.data(), DType::kFloat32, {kPages, kPage, kKvHeads});
  o.v_scale =
      MutableTensorView::contiguous(v_scale.data(), DType::kFloat32, {kPages, kPage, kKvHeads});
  o.causal = true;
  o.num_threads = 1;
  const auto cache = [&](std::vector<int8_t>& codes) {
    return MutableTensorView::contiguous(codes.data(), DType::kInt8, {kPages, kPage, kKvHeads, kD});
  };
  const MutableTensorView k_cache = cache(k_codes), v_cache = cache(v_codes);
  std::uniform_real_distribution<float> uq(-1.0f, 1.0f);
  std::vector<float> q(2 * kRows * kHeads * kD), out(q.size());
  for (float& x : q) x = uq(rng);
  std::vector<uint16_t> q16(q.size()), out16(q.size());
  for (size_t i = 0; i < q.size(); ++i) q16[i] = half::float_to_bf16(q[i]);
  // The views are made before a sweep counts (their shapes are vectors).
  const std::vector<int64_t> shape = {2, kRows, kHeads, kD};
  const TensorView q32_view = TensorView::contiguous(q.data(), DType::kFloat32, shape);
  const TensorView q16_view = TensorView::contiguous(q16.data(), DType::kBFloat16, shape);
  const MutableTensorView out32_view =
      MutableTensorView::contiguous(out.data(), DType::kFloat32, shape);
  const MutableTensorView out16_view =
      MutableTensorView::contiguous(out16.data(), DType::kBFloat16, shape);
  EXPECT_TRUE(sweep_output("float32 q", &out, [&] {
    return flash_attn_with_kvcache(q32_view, k_cache, v_cache, out32_view, {}, o);
  }));
  EXPECT_TRUE(sweep_output("bfloat16 q", &out16, [&] {
    return flash_attn_with_kvcache(q16_view, k_cache, v_cache, out16_view, {}, o);
  }));
}

}  // namespace
}  // namespace flashcte::test
