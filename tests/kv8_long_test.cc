// 8-bit KV caches at long contexts (issue 41, item 4). Sequences of 2501, 2520 and 9001 slots
// cross two to eight of the decode kernel's 1024-slot chunk boundaries (each chunk parks a
// partial softmax state and merge() folds them in order, src/kernel/decode.h). Every 8-bit
// format (int8, float8_e4m3fn, float8_e5m2) x scale granularity (per tensor, per KV head, per
// token), dense and in pages of 1, 16 and 256 slots laid out HND (vLLM's (num_blocks, kv_heads,
// block, d)) and NHD (FlashAttention's (num_blocks, block, kv_heads, d)), on 1 and 3 threads:
//   Kv8LongDecode  decode_attention
//   Kv8LongVarlen  flash_attn_varlen_kvcache, the call under Python's paged_attention (whose
//                  kv_layout is a permutation of the pages' strides, as here): a mixed batch of
//                  two decoding sequences and a 20-query prefill chunk
//   Kv8LongAppend  flash_attn_with_kvcache appending new tokens into 8-bit caches, with rotary,
//                  cache_leftpad and cache_batch_idx (dense) or pages (kv8_long_append_test.cc,
//                  its machinery kv8_long_append.h)
// K and V always differ in format and granularity: K (format f, granularity g) with V (format
// f + 1, granularity g + 1), mod 3, so each of the nine format x granularity pairs is a K cache
// once and a V cache once.
//
// The oracle is the float64 reference (src/reference) on the dequantized cache: each element
// decoded by the test, reference::load_element of its code times its scale. The scales the test
// picks have 16-bit significands, so that product is exact in float32 (the reference's input
// dtype) and the oracle sees the exact dequantized values. Paged results must be bitwise the
// dense ones, and 3 threads bitwise 1 thread (decode.h and kvcache.h promise both).
//
// The append's codes and scales are checked against the test's own encoder, written from the
// spec in kvcache.h (quantize_kv): a per-token scale is the row's largest finite |value| over the
// format's largest value (127, 448, 57344), 1 for a zero row; each element becomes value / scale,
// divided in double, rounded to nearest even and saturated. Its rounding is the oracle's
// reference::round_to_dtype and its codes come from a table of all 256 codes decoded by
// reference::load_element; nothing of the library's encoder (quantize_kv, src/core/kv8.h) is used.
//
// The shared machinery (codebooks, the oracle's rows and tolerances, the long caches and their
// pages): kv8_long_cases.h.
//
// Cost (Release, the shared 2-core AMD EPYC Zen 4): the whole file 5-6 s CPU idle (see each test),
// 17-23 s with two other builds running.
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "flashcte/kvcache.h"
#include "src/reference/reference.h"
#include "tests/kv8_formats.h"
#include "tests/kv8_long_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---------------------------------------------------------------------------------------------
// decode_attention.

// kT query tokens per sequence at these positions, (kSeqs, kT): the last two slots of sequence 0;
// a slot in the middle and the last of sequence 1 (nine chunks); slot 1023, the first chunk's
// last, and the last slot of sequence 2. Query t sees slots [0, position].
constexpr int64_t kT = 2;
const std::vector<int64_t> kPositions = {2499, 2500, 5000, 9000, 1023, 2519};

// Query values (kSeqs, kQHeads, kT, kD), in q's dtype.
Tensor4 decode_queries(DType dtype, const std::vector<double>& values) {
  Tensor4 q(dtype, {kSeqs, kQHeads, kT, kD});
  size_t i = 0;
  for (int64_t b = 0; b < kSeqs; ++b) {
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t t = 0; t < kT; ++t) {
        for (int64_t x = 0; x < kD; ++x) q.set(b, h, t, x, values[i++]);
      }
    }
  }
  return q;
}

Outcome decode(const Tensor4& q, const TensorView& k, const TensorView& v, const TensorView& ks,
               const TensorView& vs, const TensorView& table, int threads) {
  Tensor4 out(q.view().dtype, {kSeqs, kQHeads, kT, kDv});
  out.fill_nan();
  Outcome r;
  r.lse = nan_floats(kSeqs * kQHeads * kT);
  DecodeOptions o;
  o.scale = static_cast<float>(1.0 / std::sqrt(double{kD}));
  o.k_scale = ks;
  o.v_scale = vs;
  o.block_table = table;
  o.num_threads = threads;
  DecodeOutputs outputs;
  outputs.out = out.mutable_view();
  outputs.lse = MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kSeqs, kQHeads, kT});
  r.status = decode_attention(q.view(), k, v,
                              TensorView::contiguous(kPositions.data(), DType::kInt64, {kSeqs, kT}),
                              outputs, o);
  r.out = out.bytes();
  return r;
}

// The oracle for every decode query: out (kSeqs, kQHeads, kT, kDv) and lse (kSeqs, kQHeads, kT),
// the layouts of the call's outputs.
void decode_reference(const std::vector<double>& q, const LongCache& kc, const LongCache& vc,
                      std::vector<double>* out, std::vector<double>* lse) {
  for (int64_t b = 0; b < kSeqs; ++b) {
    const std::vector<double> qb(q.begin() + b * kQHeads * kT * kD,
                                 q.begin() + (b + 1) * kQHeads * kT * kD);
    std::vector<int64_t> hi;
    for (int64_t t = 0; t < kT; ++t) hi.push_back(kPositions[static_cast<size_t>(b * kT + t)] + 1);
    reference_rows(
        qb, kQHeads, kT, kD, hi, kKvHeads, kDv,
        [&](int64_t h, int64_t j, int64_t x) { return kc.value(b, h, j, x); },
        [&](int64_t h, int64_t j, int64_t x) { return vc.value(b, h, j, x); }, out, lse);
  }
}

// The checks every format x granularity pair gets in one q dtype: `run(pages, threads)` (pages
// null for the dense caches) on 1 thread against the oracle, on 3 threads bitwise that, and on
// every page layout and thread count bitwise the dense result.
template <class Run>
void expect_dense_and_paged(const Run& run, const std::vector<LongPages>& pages, DType dtype,
                            const std::vector<double>& want_out,
                            const std::vector<double>& want_lse, double top, double top_v) {
  const Outcome dense = run(nullptr, 1);
  ASSERT_TRUE(dense.status.ok) << dense.status.message;
  EXPECT_TRUE(within("out", decoded(dense.out, dtype), want_out, out_tolerance(dtype, top, top_v)));
  EXPECT_TRUE(within("lse", widened(dense.lse), want_lse, lse_tolerance(want_lse)));
  const Outcome threads = run(nullptr, 3);
  ASSERT_TRUE(threads.status.ok) << threads.status.message;
  EXPECT_TRUE(same_bits(threads.out, dense.out)) << "3 threads";
  EXPECT_TRUE(same_bits(threads.lse, dense.lse)) << "3 threads";
  for (const LongPages& p : pages) {
    for (int n : kThreadCounts) {
      SCOPED_TRACE(p.describe() + ", " + std::to_string(n) + " threads");
      const Outcome paged = run(&p, n);
      ASSERT_TRUE(paged.status.ok) << paged.status.message;
      EXPECT_TRUE(same_bits(paged.out, dense.out));
      EXPECT_TRUE(same_bits(paged.lse, dense.lse));
    }
  }
}

// One format x granularity pair: the oracle once, then q in each dtype on the dense caches (1
// thread against the oracle, 3 threads bitwise it) and in six page layouts x 2 thread counts
// (bitwise the dense result). Measured: 1.3 s for the nine pairs.
TEST(Kv8LongDecode, EveryFormatGranularityLayoutBlockSizeAndThreadCount) {
  std::mt19937 rng(1);
  std::vector<double> q(static_cast<size_t>(kSeqs * kQHeads * kT * kD));
  for (double& x : q) x = query_value(rng);
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      const LongCache kc(kFormats[f], static_cast<Granularity>(g), kD, false, 10 + 3 * f + g);
      const LongCache vc(kFormats[(f + 1) % 3], static_cast<Granularity>((g + 1) % 3), kDv, true,
                         20 + 3 * f + g);
      SCOPED_TRACE(describe(kc, vc));
      std::vector<double> want_out, want_lse;
      decode_reference(q, kc, vc, &want_out, &want_lse);
      const double top = max_abs(want_out), top_v = vc.max_abs_value();
      std::vector<LongPages> pages;
      for (bool hnd : {true, false}) {
        for (int64_t block : kBlocks) pages.emplace_back(kc, vc, block, hnd, -1);
      }
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE(std::string("q ") + dtype_name(dtype));
        const Tensor4 qt = decode_queries(dtype, q);
        const auto run = [&](const LongPages* p, int threads) {
          return p ? decode(qt, p->decode_view(p->k), p->decode_view(p->v), p->decode_scale(p->k),
                            p->decode_scale(p->v), p->table_view(), threads)
                   : decode(qt, kc.decode_view(), vc.decode_view(), kc.decode_scale(),
                            vc.decode_scale(), {}, threads);
        };
        expect_dense_and_paged(run, pages, dtype, want_out, want_lse, top, top_v);
      }
    }
  }
}

// Every SIMD target this CPU runs (each has its own kernels and summation order, so each is held
// to the oracle, not to another target): the three formats, each once as K and once as V, with
// float32 and bfloat16 q; dense against the oracle, NHD pages of 16 on 3 threads bitwise dense.
// Measured: 0.6 s on five targets.
TEST(Kv8LongDecode, EverySimdTarget) {
  std::mt19937 rng(2);
  std::vector<double> q(static_cast<size_t>(kSeqs * kQHeads * kT * kD));
  for (double& x : q) x = query_value(rng);
  for (int f = 0; f < 3; ++f) {
    const LongCache kc(kFormats[f], static_cast<Granularity>(f), kD, false, 30 + f);
    const LongCache vc(kFormats[(f + 1) % 3], static_cast<Granularity>((f + 2) % 3), kDv, true,
                       40 + f);
    SCOPED_TRACE(describe(kc, vc));
    std::vector<double> want_out, want_lse;
    decode_reference(q, kc, vc, &want_out, &want_lse);
    const double top = max_abs(want_out), top_v = vc.max_abs_value();
    const LongPages p(kc, vc, 16, false, -1);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor4 qt = decode_queries(dtype, q);
      for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
        hwy::SetSupportedTargetsForTest(target);
        SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", q " + dtype_name(dtype));
        const Outcome dense = decode(qt, kc.decode_view(), vc.decode_view(), kc.decode_scale(),
                                     vc.decode_scale(), {}, 1);
        ASSERT_TRUE(dense.status.ok) << dense.status.message;
        EXPECT_TRUE(
            within("out", decoded(dense.out, dtype), want_out, out_tolerance(dtype, top, top_v)));
        EXPECT_TRUE(within("lse", widened(dense.lse), want_lse, lse_tolerance(want_lse)));
        const Outcome paged = decode(qt, p.decode_view(p.k), p.decode_view(p.v),
                                     p.decode_scale(p.k), p.decode_scale(p.v), p.table_view(), 3);
        ASSERT_TRUE(paged.status.ok) << paged.status.message;
        EXPECT_TRUE(same_bits(paged.out, dense.out));
        EXPECT_TRUE(same_bits(paged.lse, dense.lse));
      }
      hwy::SetSupportedTargetsForTest(0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// flash_attn_varlen_kvcache (Python's paged_attention).

// A mixed batch over the same caches: one query for sequence 0, three for sequence 1 (both on
// the decode kernel), twenty for sequence 2 (more than kDecodeMaxQueries: attention_cte with the
// cache as its 8-bit prior). Each sequence's queries are its last tokens, bottom-right causal.
const std::vector<int32_t> kCuSeqlensQ = {0, 1, 4, 24};
constexpr int64_t kTotalQ = 24;

Outcome varlen(const HostTensor& q, const TensorView& k, const TensorView& v, const TensorView& ks,
               const TensorView& vs, const TensorView& table, int threads) {
  HostTensor out(q.dtype(), {kTotalQ, kQHeads, kDv});
  out.fill_sentinel();
  Outcome r;
  r.lse = nan_floats(kQHeads * kTotalQ);
  const std::vector<int32_t> used(kLen.begin(), kLen.end());
  VarlenKvCacheOptions o;
  o.cu_seqlens_q = TensorView::contiguous(kCuSeqlensQ.data(), DType::kInt32, {kSeqs + 1});
  o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {kSeqs});
  o.block_table = table;
  o.k_scale = ks;
  o.v_scale = vs;
  o.causal = true;
  o.num_threads = threads;
  r.status = flash_attn_varlen_kvcache(
      q.view(), k, v, out.mutable_view(),
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kQHeads, kTotalQ}), o);
  r.out = out.bytes();
  return r;
}

// The oracle in the call's layouts: out (total_q, heads, dv), lse (heads, total_q).
void varlen_reference(const std::vector<double>& q, const LongCache& kc, const LongCache& vc,
                      std::vector<double>* out, std::vector<double>* lse) {
  out->assign(static_cast<size_t>(kTotalQ * kQHeads * kDv), 0);
  lse->assign(static_cast<size_t>(kQHeads * kTotalQ), 0);
  for (int64_t b = 0; b < kSeqs; ++b) {
    const int64_t first = kCuSeqlensQ[b], rows = kCuSeqlensQ[b + 1] - first;
    std::vector<double> qb;  // (heads, rows, d)
    std::vector<int64_t> hi;
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t x = 0; x < kD; ++x) {
          qb.push_back(q[static_cast<size_t>(((first + r) * kQHeads + h) * kD + x)]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) hi.push_back(kLen[b] - rows + r + 1);
    std::vector<double> o, l;
    reference_rows(
        qb, kQHeads, rows, kD, hi, kKvHeads, kDv,
        [&](int64_t h, int64_t j, int64_t x) { return kc.value(b, h, j, x); },
        [&](int64_t h, int64_t j, int64_t x) { return vc.value(b, h, j, x); }, &o, &l);
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t x = 0; x < kDv; ++x) {
          (*out)[static_cast<size_t>(((first + r) * kQHeads + h) * kDv + x)] =
              o[static_cast<size_t>((h * rows + r) * kDv + x)];
        }
        (*lse)[static_cast<size_t>(h * kTotalQ + first + r)] = l[static_cast<size_t>(h * rows + r)];
      }
    }
  }
}

// As Kv8LongDecode's test, through the serving call: every format x granularity pair, float32 and
// bfloat16 q, dense (FlashAttention's (batch, seqlen_cache, kv_heads, d) view of the same bytes)
// against the oracle, 3 threads and the six page layouts x 2 thread counts bitwise dense.
// Measured: 1.4 s.
TEST(Kv8LongVarlen, EveryFormatGranularityLayoutBlockSizeAndThreadCount) {
  std::mt19937 rng(3);
  std::vector<double> q(static_cast<size_t>(kTotalQ * kQHeads * kD));
  for (double& x : q) x = query_value(rng);
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      const LongCache kc(kFormats[f], static_cast<Granularity>(g), kD, false, 50 + 3 * f + g);
      const LongCache vc(kFormats[(f + 1) % 3], static_cast<Granularity>((g + 1) % 3), kDv, true,
                         60 + 3 * f + g);
      SCOPED_TRACE(describe(kc, vc));
      std::vector<double> want_out, want_lse;
      varlen_reference(q, kc, vc, &want_out, &want_lse);
      const double top = max_abs(want_out), top_v = vc.max_abs_value();
      std::vector<LongPages> pages;
      for (bool hnd : {true, false}) {
        for (int64_t block : kBlocks) pages.emplace_back(kc, vc, block, hnd, -2);
      }
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(std::string("q ") + dtype_name(dtype));
        HostTensor qt(dtype, {kTotalQ, kQHeads, kD});
        for (int64_t i = 0; i < kTotalQ; ++i) {
          for (int64_t h = 0; h < kQHeads; ++h) {
            for (int64_t x = 0; x < kD; ++x) {
              qt.set(i, h, x, q[static_cast<size_t>((i * kQHeads + h) * kD + x)]);
            }
          }
        }
        const auto run = [&](const LongPages* p, int threads) {
          return p ? varlen(qt, p->kvcache_view(p->k), p->kvcache_view(p->v),
                            p->kvcache_scale(p->k), p->kvcache_scale(p->v), p->table_view(),
                            threads)
                   : varlen(qt, kc.kvcache_view(), vc.kvcache_view(), kc.kvcache_scale(),
                            vc.kvcache_scale(), {}, threads);
        };
        expect_dense_and_paged(run, pages, dtype, want_out, want_lse, top, top_v);
      }
    }
  }
}

}  // namespace
}  // namespace flashcte::test
