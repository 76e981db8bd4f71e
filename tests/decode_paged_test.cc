// decode_attention (include/flashcte/decode.h) on paged caches and bad input: a paged cache gives
// the bytes of the dense one for any block size, page layout, dtype, thread count and SIMD
// target, matches the float64 oracle, and sequences may share pages; a valid call (dense or
// paged) broken one argument at a time is refused with the argument named. The accuracy,
// targets, threads and layouts: decode_test.cc; the machinery: decode_cases.h.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "src/core/half.h"
#include "tests/decode_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---- paged caches ------------------------------------------------------------------------------

// A paged cache gives the bytes of the dense one with the same rows, for any block size (1, odd,
// a tile's 16, past the 64-slot blocks and the 1024-slot chunks), both page layouts, every dtype,
// thread count and SIMD target, with windows that cut pages, sinks, and the gathered path
// (channel stride 2).
TEST(DecodePaged, BitwiseTheDenseResultForAnyBlockSize) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (bool strided : {false, true}) {
      DecodeCase c = shape("paged", 3, 8, 2, 3, 80, 0, 1500, {1499, 700, 2}, dtype);
      c.sink = true;
      c.window = strided ? 0 : 1100;
      c.strided = strided;
      const DecodeRun dense = run_decode_case(c, /*with_reference=*/false);
      ASSERT_TRUE(dense.status.ok) << dense.status.message;
      for (int64_t block_size : {1, 3, 16, 256, 1100}) {
        for (bool nhd : {false, true}) {
          for (int threads : {1, 3}) {
            c.block_size = block_size;
            c.nhd = nhd;
            c.threads = threads;
            SCOPED_TRACE(std::string(dtype_name(dtype)) + (strided ? " strided" : "") +
                         ", block_size " + std::to_string(block_size) + (nhd ? " NHD" : " HND") +
                         ", threads " + std::to_string(threads));
            const DecodeRun paged = run_decode_case(c, /*with_reference=*/false);
            ASSERT_TRUE(paged.status.ok) << paged.status.message;
            EXPECT_TRUE(paged.out_bytes == dense.out_bytes) << "out differs";
            EXPECT_TRUE(paged.lse_bytes == dense.lse_bytes) << "lse differs";
          }
        }
      }
    }
  }
}

TEST(DecodePaged, BitwiseTheDenseResultOnEveryTarget) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    DecodeCase c = shape("paged_targets", 2, 8, 2, 2, 128, 0, 700, {699, 300}, dtype);
    c.window = 500;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", " + dtype_name(dtype));
      c.block_size = 0;
      const DecodeRun dense = run_decode_case(c);
      ASSERT_TRUE(dense.status.ok) << dense.status.message;
      EXPECT_TRUE(check_against_reference(c, dense));
      for (int64_t block_size : {1, 3, 16}) {
        c.block_size = block_size;
        const DecodeRun paged = run_decode_case(c, /*with_reference=*/false);
        ASSERT_TRUE(paged.status.ok) << paged.status.message;
        EXPECT_TRUE(paged.out_bytes == dense.out_bytes) << "block_size " << block_size;
        EXPECT_TRUE(paged.lse_bytes == dense.lse_bytes) << "block_size " << block_size;
      }
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

// Against the float64 oracle directly, at the Llama shape with several pages per 64-slot block.
TEST(DecodePaged, MatchesTheReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    DecodeCase c = shape("paged_reference", 2, 32, 8, 1, 128, 0, 600, {599, 17}, dtype);
    c.block_size = 16;
    c.sink = true;
    const DecodeRun run = run_decode_case(c);
    ASSERT_TRUE(run.status.ok) << run.status.message;
    EXPECT_TRUE(check_against_reference(c, run)) << dtype_name(dtype);
  }
}

// Two sequences reading the same pages (a shared prefix): pages may repeat in a block table.
TEST(DecodePaged, SequencesMaySharePages) {
  const int64_t kv_heads = 2, d = 16, block = 4, pages = 3;
  std::vector<float> pool(static_cast<size_t>(pages * kv_heads * block * d));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : pool) x = u(rng);
  std::vector<float> q(2 * 4 * d), out(q.size()), dense_out(q.size());
  for (float& x : q) x = u(rng);
  // Sequence 0: pages 2, 0; sequence 1: pages 2, 1 (page 2 is the common prefix).
  const std::vector<int32_t> table = {2, 0, 2, 1};
  const std::vector<int64_t> positions = {7, 6};
  DecodeOptions o;
  o.block_table = TensorView::contiguous(table.data(), DType::kInt32, {2, 2});
  const TensorView pool_view =
      TensorView::contiguous(pool.data(), DType::kFloat32, {pages, kv_heads, block, d});
  DecodeOutputs outputs;
  outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {2, 4, 1, d});
  const TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {2, 1});
  const TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {2, 4, 1, d});
  ASSERT_TRUE(decode_attention(qv, pool_view, pool_view, pos, outputs, o).ok);
  // The same rows copied into a dense (2, kv_heads, 8, d) cache.
  std::vector<float> dense(static_cast<size_t>(2 * kv_heads * 2 * block * d));
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t j = 0; j < 2 * block; ++j) {
        const int64_t page = table[b * 2 + j / block];
        std::memcpy(&dense[((b * kv_heads + h) * 2 * block + j) * d],
                    &pool[((page * kv_heads + h) * block + j % block) * d], d * sizeof(float));
      }
    }
  }
  const TensorView dense_view =
      TensorView::contiguous(dense.data(), DType::kFloat32, {2, kv_heads, 2 * block, d});
  outputs.out = MutableTensorView::contiguous(dense_out.data(), DType::kFloat32, {2, 4, 1, d});
  ASSERT_TRUE(decode_attention(qv, dense_view, dense_view, pos, outputs, DecodeOptions{}).ok);
  EXPECT_EQ(out, dense_out);
}

// ---- bad input ---------------------------------------------------------------------------------

// A valid call (batch 2, 4/2 heads, T 2, d 8, 16 slots), to be broken one argument at a time.
struct ValidDecode {
  int64_t batch = 2, q_heads = 4, kv_heads = 2, tokens = 2, d = 8, max_len = 16;
  std::vector<float> q = std::vector<float>(batch * q_heads * tokens * d, 0.5f);
  std::vector<float> k = std::vector<float>(batch * kv_heads * max_len * d, 0.25f);
  std::vector<float> v = std::vector<float>(batch * kv_heads * max_len * d, 1.0f);
  std::vector<float> out = std::vector<float>(batch * q_heads * tokens * d);
  std::vector<float> lse = std::vector<float>(batch * q_heads * tokens);
  std::vector<int64_t> positions = {3, 4, 14, 15};
  std::vector<float> sink = {0.0f, 1.0f, -2.0f, 3.0f};
  TensorView qv = TensorView::contiguous(q.data(), DType::kFloat32, {2, 4, 2, 8});
  TensorView kv = TensorView::contiguous(k.data(), DType::kFloat32, {2, 2, 16, 8});
  TensorView vv = TensorView::contiguous(v.data(), DType::kFloat32, {2, 2, 16, 8});
  TensorView pos = TensorView::contiguous(positions.data(), DType::kInt64, {2, 2});
  DecodeOutputs outputs;
  DecodeOptions options;
  ValidDecode() {
    outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {2, 4, 2, 8});
    outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {2, 4, 2});
    options.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {4});
  }
  Status run() {
    Status s;
    EXPECT_NO_THROW(s = decode_attention(qv, kv, vv, pos, outputs, options));
    return s;
  }
  // Every buffer of the call, out and lse filled with NaN first.
  BufferSnapshot snapshot() {
    BufferSnapshot snap;
    snap.add("q", q).add("k_cache", k).add("v_cache", v).add("positions", positions);
    snap.add("sink", sink).add_output("out", out).add_output("lse", lse);
    return snap;
  }
};

TEST(DecodeValidation, TheValidCallSucceeds) {
  ValidDecode call;
  const Status s = call.run();
  EXPECT_TRUE(s.ok) << s.message;
}

TEST(DecodeValidation, EmptyBatchesAndNoNewTokensAreNoOps) {
  ValidDecode call;
  call.qv.shape[0] = call.kv.shape[0] = call.vv.shape[0] = 0;
  call.pos.shape[0] = call.outputs.out.shape[0] = call.outputs.lse.shape[0] = 0;
  EXPECT_TRUE(call.run().ok);
  ValidDecode none;
  none.qv.shape[2] = none.pos.shape[1] = none.outputs.out.shape[2] = 0;
  none.outputs.lse.shape[2] = 0;
  EXPECT_TRUE(none.run().ok);
}

struct BadInput {
  const char* what;
  const char* argument;
  void (*breaks)(ValidDecode&);
};

const BadInput kBadInputs[] = {
    {"q missing", "q", [](ValidDecode& c) { c.qv = {}; }},
    {"q of rank 3", "q", [](ValidDecode& c) { c.qv.rank = 3; }},
    {"q int32", "q", [](ValidDecode& c) { c.qv.dtype = DType::kInt32; }},
    {"q head dim 0", "q", [](ValidDecode& c) { c.qv.shape[3] = c.kv.shape[3] = 0; }},
    {"q negative stride", "q", [](ValidDecode& c) { c.qv.strides[1] = -8; }},
    {"q_heads not a multiple of kv_heads", "q",
     [](ValidDecode& c) { c.qv.shape[1] = c.outputs.out.shape[1] = 3; }},
    {"k_cache missing", "k_cache", [](ValidDecode& c) { c.kv = {}; }},
    {"k_cache null data", "k_cache", [](ValidDecode& c) { c.kv.data = nullptr; }},
    {"k_cache bfloat16", "k_cache", [](ValidDecode& c) { c.kv.dtype = DType::kBFloat16; }},
    {"k_cache other batch", "k_cache", [](ValidDecode& c) { c.kv.shape[0] = 1; }},
    {"k_cache other head dim", "k_cache", [](ValidDecode& c) { c.kv.shape[3] = 4; }},
    {"v_cache float16", "v_cache", [](ValidDecode& c) { c.vv.dtype = DType::kFloat16; }},
    {"v_cache other kv_heads", "v_cache", [](ValidDecode& c) { c.vv.shape[1] = 1; }},
    {"v_cache other max_len", "v_cache", [](ValidDecode& c) { c.vv.shape[2] = 8; }},
    {"positions missing", "positions", [](ValidDecode& c) { c.pos = {}; }},
    {"positions int32", "positions", [](ValidDecode& c) { c.pos.dtype = DType::kInt32; }},
    {"positions (batch, T + 1)", "positions", [](ValidDecode& c) { c.pos.shape[1] = 3; }},
    {"a negative position", "positions", [](ValidDecode& c) { c.positions[1] = -1; }},
    {"a position past the cache", "positions", [](ValidDecode& c) { c.positions[3] = 16; }},
    {"out missing", "out", [](ValidDecode& c) { c.outputs.out = {}; }},
    {"out bfloat16", "out", [](ValidDecode& c) { c.outputs.out.dtype = DType::kBFloat16; }},
    {"out of another T", "out", [](ValidDecode& c) { c.outputs.out.shape[2] = 1; }},
    {"out elements overlapping", "out", [](ValidDecode& c) { c.outputs.out.strides[1] = 0; }},
    {"out aliasing k_cache", "out", [](ValidDecode& c) { c.outputs.out.data = c.k.data(); }},
    {"lse float16", "lse", [](ValidDecode& c) { c.outputs.lse.dtype = DType::kFloat16; }},
    {"lse of rank 2", "lse", [](ValidDecode& c) { c.outputs.lse.rank = 2; }},
    {"lse of other heads", "lse", [](ValidDecode& c) { c.outputs.lse.shape[1] = 2; }},
    {"lse aliasing out", "lse", [](ValidDecode& c) { c.outputs.lse.data = c.out.data(); }},
    {"sink of kv_heads", "sink", [](ValidDecode& c) { c.options.sink.shape[0] = 2; }},
    {"sink NaN", "sink", [](ValidDecode& c) { c.sink[2] = std::nanf(""); }},
    {"sink +inf", "sink",
     [](ValidDecode& c) { c.sink[0] = std::numeric_limits<float>::infinity(); }},
    {"sink int64", "sink", [](ValidDecode& c) { c.options.sink.dtype = DType::kInt64; }},
    {"scale inf", "scale",
     [](ValidDecode& c) { c.options.scale = std::numeric_limits<float>::infinity(); }},
    {"softcap negative", "softcap", [](ValidDecode& c) { c.options.softcap = -1.0f; }},
    {"sliding_window negative", "sliding_window",
     [](ValidDecode& c) { c.options.sliding_window = -2; }},
    {"num_threads negative", "num_threads", [](ValidDecode& c) { c.options.num_threads = -1; }},
};

TEST(DecodeValidation, EveryBadInputIsRefusedWithItsArgumentNamed) {
  for (const BadInput& bad : kBadInputs) {
    ValidDecode call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

// ValidDecode on a paged cache: 5 pages of 4 slots, 4 pages per sequence; positions 3, 4 read
// pages 0 and 1 of sequence 0, 14, 15 all four of sequence 1.
struct ValidPagedDecode : ValidDecode {
  std::vector<int32_t> table = {4, 0, -1, -1, 1, 3, 2, 0};
  ValidPagedDecode() {
    kv = TensorView::contiguous(k.data(), DType::kFloat32, {5, 2, 4, 8});
    vv = TensorView::contiguous(v.data(), DType::kFloat32, {5, 2, 4, 8});
    options.block_table = TensorView::contiguous(table.data(), DType::kInt32, {2, 4});
  }
  BufferSnapshot snapshot() {
    BufferSnapshot snap = ValidDecode::snapshot();
    snap.add("block_table", table);
    return snap;
  }
};

TEST(DecodeValidation, ThePagedCallSucceedsWithUnreadEntriesAnything) {
  ValidPagedDecode call;
  const Status s = call.run();
  EXPECT_TRUE(s.ok) << s.message;
}

struct BadPagedInput {
  const char* what;
  const char* argument;
  void (*breaks)(ValidPagedDecode&);
};

const BadPagedInput kBadPagedInputs[] = {
    {"block_table int64", "block_table",
     [](ValidPagedDecode& c) { c.options.block_table.dtype = DType::kInt64; }},
    {"block_table of rank 1", "block_table",
     [](ValidPagedDecode& c) { c.options.block_table.rank = 1; }},
    {"block_table of another batch", "block_table",
     [](ValidPagedDecode& c) { c.options.block_table.shape[0] = 1; }},
    {"a page past num_blocks", "block_table", [](ValidPagedDecode& c) { c.table[5] = 5; }},
    {"a negative page that is read", "block_table", [](ValidPagedDecode& c) { c.table[1] = -1; }},
    {"a position past the pages", "positions", [](ValidPagedDecode& c) { c.positions[3] = 16; }},
    {"block_size 0", "k_cache", [](ValidPagedDecode& c) { c.kv.shape[2] = c.vv.shape[2] = 0; }},
    {"v_cache of other num_blocks", "v_cache", [](ValidPagedDecode& c) { c.vv.shape[0] = 4; }},
    {"v_cache of another block_size", "v_cache", [](ValidPagedDecode& c) { c.vv.shape[2] = 2; }},
    {"out aliasing a page", "out", [](ValidPagedDecode& c) { c.outputs.out.data = c.v.data(); }},
};

TEST(DecodeValidation, EveryBadPagedInputIsRefusedWithItsArgumentNamed) {
  for (const BadPagedInput& bad : kBadPagedInputs) {
    ValidPagedDecode call;
    bad.breaks(call);
    const BufferSnapshot snap = call.snapshot();
    EXPECT_TRUE(refused_for(call.run(), bad.argument)) << bad.what;
    EXPECT_TRUE(snap.unchanged()) << bad.what;
  }
}

}  // namespace
}  // namespace flashcte::test
