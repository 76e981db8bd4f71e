// Every parallel serving path on several threads (issue 41): decode_attention over dense, paged
// and 8-bit caches, flash_attn_with_kvcache (append, then attend; dense, paged, 8-bit),
// flash_attn_varlen_kvcache on a mixed batch (prefill chunks and decodes in one region),
// attention_cte on rank-4 batches, merge_attn_states, and the attention layer (prefill, a second
// chunk over the cached prefix, decode steps). Each path runs once on 1 thread, checked against
// the float64 oracle (src/reference), then on 3 threads and on OpenMP's default, and every byte it
// wrote (outputs, lse, and the caches where it appends) must equal the 1-thread run's: the
// entry points promise results bitwise identical for any thread count.
//
// The shapes are small enough for ThreadSanitizer (these tests carry the CTest label `threads`;
// scripts/ci_sanitizers.sh runs them under TSan with Archer) but give 3 threads work to share:
// GQA 8/2 heads over 3 to 6 sequences, decode contexts past the kernel's 1024-slot chunk (chunks
// on different threads, then merged) and prefill chunks over 2100 cached keys (the KV axis split,
// then merged).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "flashcte/kvcache.h"
#include "flashcte/layer.h"
#include "flashcte/merge.h"
#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/reference/layer_reference.h"
#include "src/reference/reference.h"
#include "tests/layer/layer_test_util.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr int64_t kHeads = 8, kKvHeads = 2, kD = 32, kDv = 24;
const float kScale = static_cast<float>(1.0 / std::sqrt(double{kD}));
constexpr float kNoSink = -std::numeric_limits<float>::infinity();

// ---- running and checking ----------------------------------------------------------------------

// What one call (or sequence of calls) produced.
struct Outcome {
  std::vector<uint8_t> bytes;      // every byte written: outputs, lse, caches and scales
  std::vector<double> out, lse;    // in the oracle's order (see Oracle)
  std::vector<double> appended_k;  // flash_attn_with_kvcache: the new tokens' cache rows read back,
  std::vector<double> appended_v;  // (batch, seqlen_new, kv_heads, channels)
};

void append_bytes(std::vector<uint8_t>* bytes, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  bytes->insert(bytes->end(), p, p + n);
}

::testing::AssertionResult same_bytes(const std::vector<uint8_t>& got,
                                      const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " bytes, want " << want.size();
  }
  size_t first = got.size(), count = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    first = std::min(first, i);
    ++count;
  }
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << count << " of " << got.size() << " bytes differ, the first at " << first;
}

// The contract of every test here: the 1-thread run against the float64 oracle (`exact`), then 3
// threads and OpenMP's default (0) bitwise the 1-thread run.
void expect_exact_and_thread_count_invariant(
    const std::function<Outcome(int)>& run,
    const std::function<::testing::AssertionResult(const Outcome&)>& exact) {
  const Outcome serial = run(1);
  ASSERT_FALSE(serial.bytes.empty());
  EXPECT_TRUE(exact(serial)) << "1 thread against the float64 oracle";
  for (int threads : {3, 0}) {
    const Outcome o = run(threads);
    EXPECT_TRUE(same_bytes(o.bytes, serial.bytes))
        << threads << " threads (0: OpenMP's default) against 1 thread";
  }
}

double largest(const std::vector<double>& xs) {
  double m = 0;
  for (double x : xs) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  }
  return m;
}

// The oracle's results, problem after problem: out (heads, rows, dv) and lse (heads, rows) of
// each, from reference::attention (float64) and, for 16-bit inputs, reference::attention_plain
// (the same precision as the inputs, the yardstick of their tolerance; float32 inputs are held to
// a fixed 1e-5 instead, which saves the oracle half its time under TSan).
struct Oracle {
  std::vector<double> out, lse, plain_out, plain_lse;
};

void add_oracle(const TensorView& q, const TensorView& k, const TensorView& v, const Options& o,
                Oracle* g) {
  reference::Result exact;
  const Status e = reference::attention(q, k, v, o, &exact);
  ASSERT_TRUE(e.ok) << e.message;
  g->out.insert(g->out.end(), exact.out.begin(), exact.out.end());
  g->lse.insert(g->lse.end(), exact.lse.begin(), exact.lse.end());
  if (q.dtype == DType::kFloat32) return;
  reference::Result plain;
  const Status p = reference::attention_plain(q, k, v, o, &plain);
  ASSERT_TRUE(p.ok) << p.message;
  g->plain_out.insert(g->plain_out.end(), plain.out.begin(), plain.out.end());
  g->plain_lse.insert(g->plain_lse.end(), plain.lse.begin(), plain.lse.end());
}

// One sequence as the oracle's problem: `heads` query heads of `rows` rows over `keys` keys of
// kv_heads KV heads (query head h reads KV head h / (heads / kv_heads)), row i seeing keys
// [lo[i], hi[i]), with one sink per query head (kNoSink: none).
struct Problem {
  int64_t heads, kv_heads, rows, keys, d, dv;
  std::vector<double> q, k, v;  // (heads, rows, d), (kv_heads, keys, d), (kv_heads, keys, dv)
  std::vector<int64_t> lo, hi;
  std::vector<float> sink;

  Problem(int64_t heads_, int64_t kv_heads_, int64_t rows_, int64_t keys_, int64_t d_, int64_t dv_)
      : heads(heads_),
        kv_heads(kv_heads_),
        rows(rows_),
        keys(keys_),
        d(d_),
        dv(dv_),
        q(static_cast<size_t>(heads * rows * d)),
        k(static_cast<size_t>(kv_heads * keys * d)),
        v(static_cast<size_t>(kv_heads * keys * dv)),
        lo(static_cast<size_t>(rows), 0),
        hi(static_cast<size_t>(rows), keys),
        sink(static_cast<size_t>(heads), kNoSink) {}
  double& qa(int64_t h, int64_t i, int64_t x) {
    return q[static_cast<size_t>((h * rows + i) * d + x)];
  }
  double& ka(int64_t h, int64_t j, int64_t x) {
    return k[static_cast<size_t>((h * keys + j) * d + x)];
  }
  double& va(int64_t h, int64_t j, int64_t x) {
    return v[static_cast<size_t>((h * keys + j) * dv + x)];
  }
};

// The oracle on `p`, its values held in `dtype` (which must hold them: q's dtype, or float32 for
// dequantized 8-bit caches, whose code x scale products float32 rounds by at most 2^-24).
void add_oracle(const Problem& p, DType dtype, Oracle* g) {
  HostTensor q(dtype, {p.heads, p.rows, p.d}), k(dtype, {p.kv_heads, p.keys, p.d});
  HostTensor v(dtype, {p.kv_heads, p.keys, p.dv}), sink(DType::kFloat32, {p.heads, 1});
  HostTensor lo(DType::kInt64, {p.rows, 1}), hi(DType::kInt64, {p.rows, 1});
  for (int64_t h = 0; h < p.heads; ++h) {
    for (int64_t i = 0; i < p.rows; ++i) {
      for (int64_t x = 0; x < p.d; ++x) {
        q.set(h, i, x, p.q[static_cast<size_t>((h * p.rows + i) * p.d + x)]);
      }
    }
    sink.set(h, 0, 0, p.sink[static_cast<size_t>(h)]);
  }
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    for (int64_t j = 0; j < p.keys; ++j) {
      for (int64_t x = 0; x < p.d; ++x) {
        k.set(h, j, x, p.k[static_cast<size_t>((h * p.keys + j) * p.d + x)]);
      }
      for (int64_t x = 0; x < p.dv; ++x) {
        v.set(h, j, x, p.v[static_cast<size_t>((h * p.keys + j) * p.dv + x)]);
      }
    }
  }
  for (int64_t i = 0; i < p.rows; ++i) {
    lo.set_raw_int(i, 0, p.lo[static_cast<size_t>(i)]);
    hi.set_raw_int(i, 0, p.hi[static_cast<size_t>(i)]);
  }
  Options o;
  o.tp_k = true;
  o.causal_mask = false;
  o.scale = kScale;
  o.bound_min = lo.view();
  o.bound_max = hi.view();
  o.sink = sink.view();
  add_oracle(q.view(), k.view(), v.view(), o, g);
}

// The suite's rule (tests/varlen_kvcache_test.cc, FlashAttention's): at most 3 times the error of
// a plain same-precision implementation, plus 1e-5, plus one rounding of the largest value to
// the output's dtype; float32 (no plain run) within that 1e-5.
::testing::AssertionResult matches(const Outcome& r, const Oracle& g, DType dtype) {
  const double u = unit_roundoff(dtype);
  const bool plain = !g.plain_out.empty();
  ::testing::AssertionResult out =
      within_plain_error(r.out, plain ? g.plain_out : g.out, g.out, 3, 1e-5 + u * largest(g.out));
  if (!out) return out << " (out)";
  ::testing::AssertionResult lse = within_plain_error(r.lse, plain ? g.plain_lse : g.lse, g.lse, 3,
                                                      1e-5 + u * std::max(1.0, largest(g.lse)));
  if (!lse) return lse << " (lse)";
  return ::testing::AssertionSuccess();
}

// ---- caches ------------------------------------------------------------------------------------

// Where the slots of `batch` sequences live: dense, row b for sequence b, or in pages of `block`
// slots at shuffled places among two spare pages (one block table for K and V). heads_outer:
// decode's (rows, kv_heads, slots, channels); otherwise FlashAttention's (rows, slots, kv_heads,
// channels).
struct CacheShape {
  int64_t batch, slots, block;
  bool heads_outer;
  std::vector<int32_t> table;  // paged: (batch, pages)

  CacheShape(int64_t batch_, int64_t min_slots, int64_t block_, bool heads_outer_, uint32_t seed)
      : batch(batch_),
        slots(block_ > 0 ? (min_slots + block_ - 1) / block_ * block_ : min_slots),
        block(block_),
        heads_outer(heads_outer_) {
    if (block == 0) return;
    table.resize(static_cast<size_t>(rows()));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(seed));
    table.resize(static_cast<size_t>(batch * pages()));
  }
  int64_t pages() const { return block > 0 ? slots / block : 1; }
  int64_t rows() const { return block > 0 ? batch * pages() + 2 : batch; }
  int64_t row_slots() const { return block > 0 ? block : slots; }
  std::pair<int64_t, int64_t> where(int64_t b, int64_t j) const {
    if (block == 0) return {b, j};
    return {table[static_cast<size_t>(b * pages() + j / block)], j % block};
  }
  TensorView table_view() const {
    if (block == 0) return {};
    return TensorView::contiguous(table.data(), DType::kInt32, {batch, pages()});
  }
  std::array<int64_t, 4> dims(int64_t channels) const {
    if (heads_outer) return {rows(), kKvHeads, row_slots(), channels};
    return {rows(), row_slots(), kKvHeads, channels};
  }
};

enum class Scales { kTensor, kHead, kToken };

// A K or V cache of `channels` channels in `format`: q's float dtype, or an 8-bit format whose
// codes stand for code x a float32 scale, one per cache, per KV head or per slot (laid out like
// the cache without its channel axis). The scales leave 10% of the format's range free, so the
// values drawn (uniform in [-1, 1]) never saturate.
class Cache {
 public:
  Cache(const CacheShape& shape, DType format, int64_t channels, Scales scales)
      : shape_(shape),
        format_(format),
        channels_(channels),
        scales_(scales),
        data_(format, shape.dims(channels)) {
    if (!kv8::is_8bit(format)) return;
    const double base = 1.0 / (0.9 * kv8::format_max(format));
    const int64_t n = scales == Scales::kTensor ? 1
                      : scales == Scales::kHead ? kKvHeads
                                                : shape.rows() * kKvHeads * shape.row_slots();
    for (int64_t i = 0; i < n; ++i) {
      scale_.push_back(static_cast<float>(base * (1 + 0.01 * (i % 11))));
    }
  }

  // Sequence b's slots [0, filled[b]) uniform in [-1, 1]; the rest stay 0 (codes 0).
  template <class Int>
  void fill(const std::vector<Int>& filled, std::mt19937_64* rng) {
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t b = 0; b < shape_.batch; ++b) {
      for (int64_t j = 0; j < filled[static_cast<size_t>(b)]; ++j) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t x = 0; x < channels_; ++x) set(b, h, j, x, u(*rng));
        }
      }
    }
  }
  // Channel x of KV head h at sequence b's slot j: the exact value it stands for.
  double get(int64_t b, int64_t h, int64_t j, int64_t x) const {
    const int64_t at = offset(b, h, j, x);
    if (!kv8::is_8bit(format_)) return reference::load_element(data_.bytes().data(), format_, at);
    return kv8::decode(format_, data_.bytes()[static_cast<size_t>(at)]) *
           static_cast<double>(scale_[scale_index(b, h, j)]);
  }
  void set(int64_t b, int64_t h, int64_t j, int64_t x, double value) {
    if (!kv8::is_8bit(format_)) {
      const auto [row, slot] = shape_.where(b, j);
      if (shape_.heads_outer) {
        data_.set(row, h, slot, x, value);
      } else {
        data_.set(row, slot, h, x, value);
      }
      return;
    }
    data_.bytes()[static_cast<size_t>(offset(b, h, j, x))] =
        kv8::encode(format_, value / scale_[scale_index(b, h, j)]);
  }

  TensorView view() const { return data_.view(); }
  MutableTensorView mutable_view() { return data_.mutable_view(); }
  TensorView scale_view() const {
    if (scale_.empty()) return {};
    return TensorView::contiguous(scale_.data(), DType::kFloat32, scale_dims());
  }
  MutableTensorView mutable_scale_view() {
    if (scale_.empty()) return {};
    return MutableTensorView::contiguous(scale_.data(), DType::kFloat32, scale_dims());
  }
  // The storage and the scales.
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> all(data_.bytes().begin(), data_.bytes().end());
    append_bytes(&all, scale_.data(), scale_.size() * sizeof(float));
    return all;
  }

 private:
  int64_t offset(int64_t b, int64_t h, int64_t j, int64_t x) const {
    const auto [row, slot] = shape_.where(b, j);
    return shape_.heads_outer ? data_.offset(row, h, slot, x) : data_.offset(row, slot, h, x);
  }
  size_t scale_index(int64_t b, int64_t h, int64_t j) const {
    if (scales_ == Scales::kTensor) return 0;
    if (scales_ == Scales::kHead) return static_cast<size_t>(h);
    const auto [row, slot] = shape_.where(b, j);
    const int64_t rs = shape_.row_slots();
    return static_cast<size_t>(shape_.heads_outer ? (row * kKvHeads + h) * rs + slot
                                                  : (row * rs + slot) * kKvHeads + h);
  }
  std::vector<int64_t> scale_dims() const {
    if (scales_ != Scales::kToken) return {static_cast<int64_t>(scale_.size())};
    if (shape_.heads_outer) return {shape_.rows(), kKvHeads, shape_.row_slots()};
    return {shape_.rows(), shape_.row_slots(), kKvHeads};
  }

  CacheShape shape_;
  DType format_;
  int64_t channels_;
  Scales scales_;
  Tensor4 data_;
  std::vector<float> scale_;
};

// K and V formats of a case: both q's dtype (float caches), or 8-bit with their scales.
struct Formats {
  DType k = DType::kFloat32, v = DType::kFloat32;
  Scales k_scales = Scales::kTensor, v_scales = Scales::kTensor;
};
Formats float_caches(DType dtype) { return {dtype, dtype, Scales::kTensor, Scales::kTensor}; }

// Sinks around the logits' scale, one head without.
std::vector<float> sinks(std::mt19937_64* rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<float> s;
  for (int64_t h = 0; h < kHeads; ++h) {
    s.push_back(h == 1 ? kNoSink : static_cast<float>(2 * u(*rng)));
  }
  return s;
}

void fill(Tensor4* t, std::mt19937_64* rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const TensorView v = t->view();
  for (int64_t a = 0; a < v.shape[0]; ++a) {
    for (int64_t b = 0; b < v.shape[1]; ++b) {
      for (int64_t c = 0; c < v.shape[2]; ++c) {
        for (int64_t x = 0; x < v.shape[3]; ++x) t->set(a, b, c, x, u(*rng));
      }
    }
  }
}

// The dtype that holds a case's values exactly for the oracle.
DType oracle_dtype(DType q_dtype, const Formats& f) {
  return kv8::is_8bit(f.k) || kv8::is_8bit(f.v) ? DType::kFloat32 : q_dtype;
}

// ---- decode_attention --------------------------------------------------------------------------

// 3 sequences, T = 2 new tokens each, at the end of 1300 slots (2 chunks of 1024), in the middle
// (1) and at the start: 4 (sequence, chunk) pairs per KV head, 8 items for the threads, and two
// chunk merges.
struct DecodeSetup {
  static constexpr int64_t kBatch = 3, kTokens = 2;
  DType dtype;
  Formats formats;
  int64_t window;
  std::vector<int64_t> last = {1299, 700, 5};
  CacheShape shape;
  Tensor4 q;
  Cache k, v;
  std::vector<int64_t> positions;
  std::vector<float> sink;

  DecodeSetup(DType dtype_, Formats f, int64_t block, int64_t window_)
      : dtype(dtype_),
        formats(f),
        window(window_),
        shape(kBatch, 1300, block, /*heads_outer=*/true, 3),
        q(dtype_, {kBatch, kHeads, kTokens, kD}),
        k(shape, f.k, kD, f.k_scales),
        v(shape, f.v, kDv, f.v_scales) {
    std::mt19937_64 rng(17);
    fill(&q, &rng);
    std::vector<int64_t> filled;
    for (int64_t l : last) filled.push_back(l + 1);
    k.fill(filled, &rng);
    v.fill(filled, &rng);
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t t = 0; t < kTokens; ++t) positions.push_back(last[b] - (kTokens - 1) + t);
    }
    sink = sinks(&rng);
  }

  Outcome run(int threads) const {
    Tensor4 out(dtype, {kBatch, kHeads, kTokens, kDv});
    out.fill_nan();
    std::vector<float> lse = nan_floats(kBatch * kHeads * kTokens);
    DecodeOptions o;
    o.scale = kScale;
    o.sliding_window = window;
    o.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {kHeads});
    o.block_table = shape.table_view();
    o.k_scale = k.scale_view();
    o.v_scale = v.scale_view();
    o.num_threads = threads;
    DecodeOutputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse =
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, kTokens});
    const Status s = decode_attention(
        q.view(), k.view(), v.view(),
        TensorView::contiguous(positions.data(), DType::kInt64, {kBatch, kTokens}), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t t = 0; t < kTokens; ++t) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(b, h, t, x));
          r.lse.push_back(lse[static_cast<size_t>((b * kHeads + h) * kTokens + t)]);
        }
      }
    }
    return r;
  }

  // Sequence b: its query heads over slots [0, last + 1), token t seeing the slots up to its
  // position (and within the window).
  ::testing::AssertionResult exact(const Outcome& r) const {
    Oracle g;
    for (int64_t b = 0; b < kBatch; ++b) {
      Problem p(kHeads, kKvHeads, kTokens, last[b] + 1, kD, kDv);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t t = 0; t < kTokens; ++t) {
          for (int64_t x = 0; x < kD; ++x) p.qa(h, t, x) = q.get(b, h, t, x);
        }
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < p.keys; ++j) {
          for (int64_t x = 0; x < kD; ++x) p.ka(h, j, x) = k.get(b, h, j, x);
          for (int64_t x = 0; x < kDv; ++x) p.va(h, j, x) = v.get(b, h, j, x);
        }
      }
      for (int64_t t = 0; t < kTokens; ++t) {
        const int64_t pos = positions[static_cast<size_t>(b * kTokens + t)];
        p.lo[t] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        p.hi[t] = pos + 1;
      }
      p.sink = sink;
      add_oracle(p, oracle_dtype(dtype, formats), &g);
    }
    return matches(r, g, dtype);
  }
};

void expect_decode(const DecodeSetup& s) {
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

TEST(ThreadsServing, DecodeDenseGqaAcrossChunks) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    const int64_t window = dtype == DType::kFloat32 ? 0 : 1100;  // 1100: still 2 chunks
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", window " + std::to_string(window));
    expect_decode(DecodeSetup(dtype, float_caches(dtype), 0, window));
  }
}

TEST(ThreadsServing, DecodePagedBlockTable) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16}) {
    // Pages of 16 slots, and of 5 (a window edge and the chunk edge inside pages).
    const int64_t block = dtype == DType::kFloat32 ? 16 : 5;
    const int64_t window = dtype == DType::kFloat32 ? 0 : 1100;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", pages of " + std::to_string(block));
    expect_decode(DecodeSetup(dtype, float_caches(dtype), block, window));
  }
}

TEST(ThreadsServing, DecodeInt8AndFp8Caches) {
  const Formats int8_k{DType::kInt8, DType::kFloat8E4M3, Scales::kToken, Scales::kHead};
  const Formats fp8_k{DType::kFloat8E5M2, DType::kInt8, Scales::kTensor, Scales::kToken};
  {
    SCOPED_TRACE("k int8 per token, v e4m3 per KV head, dense");
    expect_decode(DecodeSetup(DType::kFloat32, int8_k, 0, 0));
  }
  {
    SCOPED_TRACE("k e5m2 per tensor, v int8 per token, pages of 16");
    expect_decode(DecodeSetup(DType::kFloat32, fp8_k, 16, 0));
  }
}

// ---- flash_attn_with_kvcache -------------------------------------------------------------------

// The largest difference between an appended value and its 8-bit code x scale: half an int8
// quantum (scales here <= 1.1 / (0.9 x 127) < 0.01), or half an fp8 ulp (3 and 2 mantissa bits)
// plus half the smallest subnormal step (scales < 0.003); exact in a float cache.
double quantization_bound(DType format, double x) {
  switch (format) {
    case DType::kInt8:
      return 0.005;
    case DType::kFloat8E4M3:
      return std::fabs(x) / 16 + 1e-5;
    case DType::kFloat8E5M2:
      return std::fabs(x) / 8 + 1e-5;
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  return 0;
}

// 3 sequences with 2100, 500 and 3 cached tokens in FlashAttention's (batch, slots, kv_heads, d)
// (dense or paged), `tokens` new ones appended and attended, causal, with sinks. T = 2 runs on the
// decode kernel (the first sequence in 3 chunks), T = 20 on the prefill kernel with the cache as
// the prior (the first sequence's 2120 keys split in two, then merged).
struct KvCacheSetup {
  static constexpr int64_t kBatch = 3;
  DType dtype;
  Formats formats;
  int64_t tokens;
  std::vector<int32_t> seqlens = {2100, 500, 3};
  CacheShape shape;
  Tensor4 q, k_new, v_new;
  Cache k, v;
  std::vector<float> sink;

  KvCacheSetup(DType dtype_, Formats f, int64_t block, int64_t tokens_)
      : dtype(dtype_),
        formats(f),
        tokens(tokens_),
        shape(kBatch, 2100 + tokens_, block, /*heads_outer=*/false, 5),
        q(dtype_, {kBatch, tokens_, kHeads, kD}),
        k_new(dtype_, {kBatch, tokens_, kKvHeads, kD}),
        v_new(dtype_, {kBatch, tokens_, kKvHeads, kDv}),
        k(shape, f.k, kD, f.k_scales),
        v(shape, f.v, kDv, f.v_scales) {
    std::mt19937_64 rng(23);
    fill(&q, &rng);
    fill(&k_new, &rng);
    fill(&v_new, &rng);
    k.fill(seqlens, &rng);
    v.fill(seqlens, &rng);
    sink = sinks(&rng);
  }

  Outcome run(int threads) const {
    Cache kc = k, vc = v;  // the call appends into them
    Tensor4 out(dtype, {kBatch, tokens, kHeads, kDv});
    out.fill_nan();
    std::vector<float> lse = nan_floats(kBatch * kHeads * tokens);
    KvCacheOptions o;
    o.k = k_new.view();
    o.v = v_new.view();
    o.cache_seqlens = TensorView::contiguous(seqlens.data(), DType::kInt32, {kBatch});
    o.block_table = shape.table_view();
    o.k_scale = kc.mutable_scale_view();
    o.v_scale = vc.mutable_scale_view();
    o.sinks = TensorView::contiguous(sink.data(), DType::kFloat32, {kHeads});
    o.causal = true;
    o.num_threads = threads;
    const Status s = flash_attn_with_kvcache(
        q.view(), kc.mutable_view(), vc.mutable_view(), out.mutable_view(),
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, kHeads, tokens}), o);
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (const Cache* c : {&kc, &vc}) {
      const std::vector<uint8_t> b = c->bytes();
      r.bytes.insert(r.bytes.end(), b.begin(), b.end());
    }
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < tokens; ++i) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(b, i, h, x));
          r.lse.push_back(lse[static_cast<size_t>((b * kHeads + h) * tokens + i)]);
        }
      }
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          const int64_t j = seqlens[b] + t;
          for (int64_t x = 0; x < kD; ++x) r.appended_k.push_back(kc.get(b, h, j, x));
          for (int64_t x = 0; x < kDv; ++x) r.appended_v.push_back(vc.get(b, h, j, x));
        }
      }
    }
    return r;
  }

  // The appended rows hold the new tokens (exactly, or within the quantization), then each
  // sequence's query heads over its cache: the slots as they were and the appended rows as
  // written, row i seeing slots [0, seqlen + i] (bottom-right causal).
  ::testing::AssertionResult exact(const Outcome& r) const {
    size_t ak = 0, av = 0;
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t x = 0; x < kD; ++x, ++ak) {
            const double want = k_new.get(b, t, h, x);
            if (!(std::fabs(r.appended_k[ak] - want) <= quantization_bound(formats.k, want))) {
              return ::testing::AssertionFailure()
                     << "appended k of sequence " << b << ", token " << t << ", head " << h
                     << ", channel " << x << ": " << r.appended_k[ak] << ", want " << want;
            }
          }
          for (int64_t x = 0; x < kDv; ++x, ++av) {
            const double want = v_new.get(b, t, h, x);
            if (!(std::fabs(r.appended_v[av] - want) <= quantization_bound(formats.v, want))) {
              return ::testing::AssertionFailure()
                     << "appended v of sequence " << b << ", token " << t << ", head " << h
                     << ", channel " << x << ": " << r.appended_v[av] << ", want " << want;
            }
          }
        }
      }
    }
    Oracle g;
    for (int64_t b = 0; b < kBatch; ++b) {
      const int64_t cached = seqlens[b];
      Problem p(kHeads, kKvHeads, tokens, cached + tokens, kD, kDv);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < tokens; ++i) {
          for (int64_t x = 0; x < kD; ++x) p.qa(h, i, x) = q.get(b, i, h, x);
        }
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < p.keys; ++j) {
          const auto row = static_cast<size_t>((b * tokens + j - cached) * kKvHeads + h);
          for (int64_t x = 0; x < kD; ++x) {
            p.ka(h, j, x) = j < cached ? k.get(b, h, j, x) : r.appended_k[row * kD + x];
          }
          for (int64_t x = 0; x < kDv; ++x) {
            p.va(h, j, x) = j < cached ? v.get(b, h, j, x) : r.appended_v[row * kDv + x];
          }
        }
      }
      for (int64_t i = 0; i < tokens; ++i) p.hi[i] = cached + i + 1;
      p.sink = sink;
      add_oracle(p, oracle_dtype(dtype, formats), &g);
    }
    return matches(r, g, dtype);
  }
};

void expect_kvcache(const KvCacheSetup& s) {
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

TEST(ThreadsServing, KvCacheAppendDense) {
  for (int64_t tokens : {2, 20}) {
    const DType dtype = tokens == 2 ? DType::kBFloat16 : DType::kFloat32;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(tokens) + " new tokens");
    expect_kvcache(KvCacheSetup(dtype, float_caches(dtype), 0, tokens));
  }
}

TEST(ThreadsServing, KvCacheAppendPaged) {
  for (int64_t tokens : {2, 20}) {
    const DType dtype = tokens == 2 ? DType::kFloat16 : DType::kFloat32;
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", " + std::to_string(tokens) + " new tokens");
    expect_kvcache(KvCacheSetup(dtype, float_caches(dtype), 16, tokens));
  }
}

TEST(ThreadsServing, KvCacheAppendInt8AndFp8) {
  {
    SCOPED_TRACE("k int8 per token (written by the append), v e4m3 per KV head, pages of 16, T 2");
    const Formats f{DType::kInt8, DType::kFloat8E4M3, Scales::kToken, Scales::kHead};
    expect_kvcache(KvCacheSetup(DType::kFloat32, f, 16, 2));
  }
  {
    SCOPED_TRACE("k e5m2 per tensor, v int8 per token, dense, T 20");
    const Formats f{DType::kFloat8E5M2, DType::kInt8, Scales::kTensor, Scales::kToken};
    expect_kvcache(KvCacheSetup(DType::kFloat32, f, 0, 20));
  }
}

// ---- flash_attn_varlen_kvcache -----------------------------------------------------------------

// A serving step's mixed batch: decodes (1 and 3 tokens; 1300 and 900 cached: 2 chunks and 1),
// prefill chunks of 17 tokens over 2100 keys (the KV axis split) and of 20 over 150, a sequence
// without queries this step; causal, with sinks. One parallel region for all of it.
struct VarlenSetup {
  DType dtype;
  Formats formats;
  std::vector<int64_t> q_lens = {1, 17, 1, 3, 0, 20};
  std::vector<int32_t> used = {1300, 2100, 40, 900, 30, 150};
  std::vector<int32_t> cu = {0};
  CacheShape shape;
  HostTensor q;
  Cache k, v;
  std::vector<float> sink;

  VarlenSetup(DType dtype_, Formats f, int64_t block)
      : dtype(dtype_),
        formats(f),
        shape(6, 2100, block, /*heads_outer=*/false, 7),
        q(dtype_, {std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0}), kHeads, kD}),
        k(shape, f.k, kD, f.k_scales),
        v(shape, f.v, kDv, f.v_scales) {
    for (int64_t len : q_lens) cu.push_back(cu.back() + static_cast<int32_t>(len));
    std::mt19937_64 rng(29);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t i = 0; i < total(); ++i) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t x = 0; x < kD; ++x) q.set(i, h, x, u(rng));
      }
    }
    k.fill(used, &rng);
    v.fill(used, &rng);
    sink = sinks(&rng);
  }
  int64_t batch() const { return static_cast<int64_t>(q_lens.size()); }
  int64_t total() const { return cu.back(); }

  Outcome run(int threads) const {
    HostTensor out(dtype, {total(), kHeads, kDv});
    out.fill_sentinel();
    std::vector<float> lse = nan_floats(kHeads * total());
    VarlenKvCacheOptions o;
    o.cu_seqlens_q = TensorView::contiguous(cu.data(), DType::kInt32, {batch() + 1});
    o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {batch()});
    o.block_table = shape.table_view();
    o.k_scale = k.scale_view();
    o.v_scale = v.scale_view();
    o.sinks = TensorView::contiguous(sink.data(), DType::kFloat32, {kHeads});
    o.causal = true;
    o.num_threads = threads;
    ThreadProfile profile;
    o.profile = &profile;
    const Status s = flash_attn_varlen_kvcache(
        q.view(), k.view(), v.view(), out.mutable_view(),
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, total()}), o);
    EXPECT_TRUE(s.ok) << s.message;
    if (threads > 0) {
      EXPECT_EQ(profile.busy_seconds.size(), static_cast<size_t>(threads))
          << "the region did not run on " << threads << " threads";
    }
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (int64_t b = 0; b < batch(); ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = cu[b]; i < cu[b + 1]; ++i) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(i, h, x));
          r.lse.push_back(lse[static_cast<size_t>(h * total() + i)]);
        }
      }
    }
    return r;
  }

  // Sequence b: its query rows over its used slots, query i at position used - rows + i.
  ::testing::AssertionResult exact(const Outcome& r) const {
    Oracle g;
    for (int64_t b = 0; b < batch(); ++b) {
      const int64_t rows = q_lens[b], keys = used[b];
      if (rows == 0) continue;
      Problem p(kHeads, kKvHeads, rows, keys, kD, kDv);
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t x = 0; x < kD; ++x) p.qa(h, i, x) = q.get(cu[b] + i, h, x);
        }
      }
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t x = 0; x < kD; ++x) p.ka(h, j, x) = k.get(b, h, j, x);
          for (int64_t x = 0; x < kDv; ++x) p.va(h, j, x) = v.get(b, h, j, x);
        }
      }
      for (int64_t i = 0; i < rows; ++i) p.hi[i] = keys - rows + i + 1;
      p.sink = sink;
      add_oracle(p, oracle_dtype(dtype, formats), &g);
    }
    return matches(r, g, dtype);
  }
};

void expect_varlen(const VarlenSetup& s) {
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

TEST(ThreadsServing, VarlenMixedBatchPaged) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)) + ", pages of 16");
    expect_varlen(VarlenSetup(dtype, float_caches(dtype), 16));
  }
  SCOPED_TRACE("float32, dense");
  expect_varlen(VarlenSetup(DType::kFloat32, float_caches(DType::kFloat32), 0));
}

TEST(ThreadsServing, VarlenMixedBatchInt8Fp8Paged) {
  const Formats f{DType::kInt8, DType::kFloat8E5M2, Scales::kToken, Scales::kHead};
  SCOPED_TRACE("k int8 per token, v e5m2 per KV head, pages of 16");
  expect_varlen(VarlenSetup(DType::kFloat32, f, 16));
}

// ---- attention_cte on rank-4 batches -----------------------------------------------------------

// Entry b of a rank-4 view along axis 0: the rank-3 view of the single call.
TensorView entry(const TensorView& t, int64_t b) {
  TensorView r;
  r.data = static_cast<const uint8_t*>(t.data) + b * t.strides[0] * dtype_size(t.dtype);
  r.dtype = t.dtype;
  r.rank = 3;
  for (int i = 0; i < 3; ++i) {
    r.shape[i] = t.shape[i + 1];
    r.strides[i] = t.strides[i + 1];
  }
  return r;
}

// A batch of 3 problems of `heads` query heads over kv_heads in one call: q (3, heads, sq, d),
// k (3, kv_heads, skv, d) (tp_k), v (3, kv_heads, skv, dv), a sink per entry and head.
struct BatchSetup {
  static constexpr int64_t kBatch = 3;
  DType dtype;
  int64_t heads, kv_heads, sq, skv;
  bool causal;
  TileConfig tiles;
  Tensor4 q, k, v;
  std::vector<float> sink;

  BatchSetup(DType dtype_, int64_t heads_, int64_t kv_heads_, int64_t sq_, int64_t skv_,
             bool causal_, TileConfig tiles_)
      : dtype(dtype_),
        heads(heads_),
        kv_heads(kv_heads_),
        sq(sq_),
        skv(skv_),
        causal(causal_),
        tiles(tiles_),
        q(dtype_, {kBatch, heads_, sq_, kD}),
        k(dtype_, {kBatch, kv_heads_, skv_, kD}),
        v(dtype_, {kBatch, kv_heads_, skv_, kDv}) {
    std::mt19937_64 rng(31);
    fill(&q, &rng);
    fill(&k, &rng);
    fill(&v, &rng);
    std::uniform_real_distribution<double> u(-2.0, 2.0);
    for (int64_t i = 0; i < kBatch * heads; ++i) sink.push_back(static_cast<float>(u(rng)));
  }
  Options options() const {
    Options o;
    o.tp_k = true;
    o.scale = kScale;
    o.causal_mask = causal;
    o.tiles = tiles;
    return o;
  }

  Outcome run(int threads) const {
    Tensor4 out(dtype, {kBatch, heads, sq, kDv});
    out.fill_nan();
    std::vector<float> lse = nan_floats(kBatch * heads * sq);
    Options o = options();
    o.sink = TensorView::contiguous(sink.data(), DType::kFloat32, {kBatch, heads, 1});
    o.num_threads = threads;
    Outputs outputs;
    outputs.out = out.mutable_view();
    outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kBatch, heads, sq});
    const Status s = attention_cte(q.view(), k.view(), v.view(), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    r.bytes = out.bytes();
    append_bytes(&r.bytes, lse.data(), lse.size() * sizeof(float));
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < sq; ++i) {
          for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(b, h, i, x));
          r.lse.push_back(lse[static_cast<size_t>((b * heads + h) * sq + i)]);
        }
      }
    }
    return r;
  }

  // Entry by entry, the oracle on the rank-3 call with the same options.
  ::testing::AssertionResult exact(const Outcome& r) const {
    Oracle g;
    for (int64_t b = 0; b < kBatch; ++b) {
      Options o = options();
      o.sink = TensorView::contiguous(sink.data() + b * heads, DType::kFloat32, {heads, 1});
      add_oracle(entry(q.view(), b), entry(k.view(), b), entry(v.view(), b), o, &g);
    }
    return matches(r, g, dtype);
  }
};

TEST(ThreadsServing, AttentionCteRank4Batches) {
  const std::vector<BatchSetup> cases = {
      // Many items: 2 GQA groups x 5 query blocks of 16 rows per entry (30 in all), causal.
      BatchSetup(DType::kBFloat16, kHeads, kKvHeads, 70, 90, true, TileConfig{16, 32, 0, 0}),
      // Few items over a long KV axis: each entry's 2 items split in two (12 in all), then
      // merged.
      BatchSetup(DType::kFloat32, 4, 2, 12, 2100, false, TileConfig{}),
  };
  for (const BatchSetup& s : cases) {
    SCOPED_TRACE(std::string(dtype_name(s.dtype)) + ", Sq " + std::to_string(s.sq) + ", Skv " +
                 std::to_string(s.skv));
    expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                            [&](const Outcome& r) { return s.exact(r); });
  }
}

// ---- merge_attn_states -------------------------------------------------------------------------

// Attention over a KV axis cut in two (600 and 700 keys), each half by attention_cte on the
// threads, the halves merged: the result is the attention over all 1300 keys.
struct MergeSetup {
  static constexpr int64_t kSq = 33, kKeysA = 600, kKeysB = 700;
  HostTensor q, ka, va, kb, vb;
  MergeSetup()
      : q(DType::kFloat32, {kHeads, kSq, kD}),
        ka(DType::kFloat32, {kKvHeads, kKeysA, kD}),
        va(DType::kFloat32, {kKvHeads, kKeysA, kDv}),
        kb(DType::kFloat32, {kKvHeads, kKeysB, kD}),
        vb(DType::kFloat32, {kKvHeads, kKeysB, kDv}) {
    std::mt19937_64 rng(37);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (HostTensor* t : {&q, &ka, &va, &kb, &vb}) {
      for (int64_t a = 0; a < t->shape()[0]; ++a) {
        for (int64_t b = 0; b < t->shape()[1]; ++b) {
          for (int64_t c = 0; c < t->shape()[2]; ++c) t->set(a, b, c, u(rng));
        }
      }
    }
  }
  // The two halves' states, on `threads` threads.
  struct Halves {
    HostTensor out_a{DType::kFloat32, {kHeads, kSq, kDv}},
        out_b{DType::kFloat32, {kHeads, kSq, kDv}};
    std::vector<float> lse_a = nan_floats(kHeads * kSq), lse_b = nan_floats(kHeads * kSq);
  };
  Halves halves(int threads) const {
    Halves h;
    Options o;
    o.tp_k = true;
    o.causal_mask = false;
    o.scale = kScale;
    o.tiles = TileConfig{16, 64, 0, 0};  // 2 GQA groups x 3 query blocks: 6 items per call
    o.num_threads = threads;
    Outputs outputs;
    outputs.out = h.out_a.mutable_view();
    outputs.lse = MutableTensorView::contiguous(h.lse_a.data(), DType::kFloat32, {kHeads, kSq});
    Status s = attention_cte(q.view(), ka.view(), va.view(), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    outputs.out = h.out_b.mutable_view();
    outputs.lse = MutableTensorView::contiguous(h.lse_b.data(), DType::kFloat32, {kHeads, kSq});
    s = attention_cte(q.view(), kb.view(), vb.view(), outputs, o);
    EXPECT_TRUE(s.ok) << s.message;
    return h;
  }
  static TensorView lse_view(const std::vector<float>& lse) {
    return TensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, kSq});
  }

  Outcome run(int threads) const {
    Halves h = halves(threads);  // not const: the lists below then hold one pointer type
    HostTensor out(DType::kFloat32, {kHeads, kSq, kDv});
    std::vector<float> lse = nan_floats(kHeads * kSq);
    const Status s = merge_attn_states(
        h.out_a.view(), lse_view(h.lse_a), h.out_b.view(), lse_view(h.lse_b), out.mutable_view(),
        MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kHeads, kSq}));
    EXPECT_TRUE(s.ok) << s.message;
    Outcome r;
    for (const HostTensor* t : {&h.out_a, &h.out_b, &out}) {
      r.bytes.insert(r.bytes.end(), t->bytes().begin(), t->bytes().end());
    }
    for (const std::vector<float>* l : {&h.lse_a, &h.lse_b, &lse}) {
      append_bytes(&r.bytes, l->data(), l->size() * sizeof(float));
    }
    for (int64_t hh = 0; hh < kHeads; ++hh) {
      for (int64_t i = 0; i < kSq; ++i) {
        for (int64_t x = 0; x < kDv; ++x) r.out.push_back(out.get(hh, i, x));
        r.lse.push_back(lse[static_cast<size_t>(hh * kSq + i)]);
      }
    }
    return r;
  }

  ::testing::AssertionResult exact(const Outcome& r) const {
    Problem p(kHeads, kKvHeads, kSq, kKeysA + kKeysB, kD, kDv);
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t i = 0; i < kSq; ++i) {
        for (int64_t x = 0; x < kD; ++x) p.qa(h, i, x) = q.get(h, i, x);
      }
    }
    for (int64_t h = 0; h < kKvHeads; ++h) {
      for (int64_t j = 0; j < p.keys; ++j) {
        const bool a = j < kKeysA;
        const int64_t jj = a ? j : j - kKeysA;
        for (int64_t x = 0; x < kD; ++x) p.ka(h, j, x) = a ? ka.get(h, jj, x) : kb.get(h, jj, x);
        for (int64_t x = 0; x < kDv; ++x) p.va(h, j, x) = a ? va.get(h, jj, x) : vb.get(h, jj, x);
      }
    }
    Oracle g;
    add_oracle(p, DType::kFloat32, &g);
    return matches(r, g, DType::kFloat32);
  }
};

TEST(ThreadsServing, MergeStatesOfSplitKv) {
  const MergeSetup s;
  expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                          [&](const Outcome& r) { return s.exact(r); });
}

// merge_attn_states from 3 std::threads at once over the same two states: rank 3, the rank-4
// (1, heads, rows, dv) view and in place into a private copy of side a, each 20 times; every
// result bitwise the serial merge.
TEST(ThreadsServing, MergeFromConcurrentCallers) {
  using S = MergeSetup;
  const S s;
  const S::Halves h = s.halves(1);
  const int64_t rows = kHeads * S::kSq;
  // The serial merge, out then lse.
  std::vector<float> want(static_cast<size_t>(rows * (kDv + 1)));
  ASSERT_TRUE(
      merge_attn_states(
          h.out_a.view(), S::lse_view(h.lse_a), h.out_b.view(), S::lse_view(h.lse_b),
          MutableTensorView::contiguous(want.data(), DType::kFloat32, {kHeads, S::kSq, kDv}),
          MutableTensorView::contiguous(want.data() + rows * kDv, DType::kFloat32,
                                        {kHeads, S::kSq}))
          .ok);
  // A rank-3 view as the rank-4 (1, ...) one, and a rank-2 lse as rank 3.
  const auto batch_of_one = [](auto v) {
    for (int i = v.rank; i > 0; --i) {
      v.shape[i] = v.shape[i - 1];
      v.strides[i] = v.strides[i - 1];
    }
    v.shape[0] = 1;
    v.strides[0] = v.shape[1] * v.strides[1];
    ++v.rank;
    return v;
  };
  std::atomic<int> mismatches{0}, failures{0};
  const auto worker = [&](int kind) {
    for (int round = 0; round < 20; ++round) {
      std::vector<float> got(want.size());
      TensorView oa = h.out_a.view(), la = S::lse_view(h.lse_a);
      TensorView ob = h.out_b.view(), lb = S::lse_view(h.lse_b);
      MutableTensorView o =
          MutableTensorView::contiguous(got.data(), DType::kFloat32, {kHeads, S::kSq, kDv});
      MutableTensorView l =
          MutableTensorView::contiguous(got.data() + rows * kDv, DType::kFloat32, {kHeads, S::kSq});
      if (kind == 1) {  // rank 4
        oa = batch_of_one(oa);
        ob = batch_of_one(ob);
        o = batch_of_one(o);
        la = batch_of_one(la);
        lb = batch_of_one(lb);
        l = batch_of_one(l);
      } else if (kind == 2) {  // in place into a private copy of side a
        std::memcpy(got.data(), h.out_a.bytes().data(), static_cast<size_t>(rows * kDv) * 4);
        std::memcpy(got.data() + rows * kDv, h.lse_a.data(), static_cast<size_t>(rows) * 4);
        oa = TensorView::contiguous(got.data(), DType::kFloat32, {kHeads, S::kSq, kDv});
        la = TensorView::contiguous(got.data() + rows * kDv, DType::kFloat32, {kHeads, S::kSq});
      }
      if (!merge_attn_states(oa, la, ob, lb, o, l).ok) {
        failures.fetch_add(1);
        continue;
      }
      if (std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) != 0) {
        mismatches.fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(3);
  for (int kind = 0; kind < 3; ++kind) threads.emplace_back(worker, kind);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0) << "merges that differ from the serial one";
}

// ---- the attention layer -----------------------------------------------------------------------

// The layer of tests/layer/attention_layer_test.cc with everything on (GQA 4/2, partial rotary
// with Llama-3 scaling, a window, sinks, biases, q/k norm) over 3 sequences: a 32-token prefill
// (attention_cte), a 20-token chunk over the cached 32 (attention_cte with the cache as the
// prior, paged or dense), then 3 decode steps (decode_attention). The projections are OpenBLAS
// GEMMs below OpenBLAS's own threading threshold (0.3.21 splits an sgemm from m n k = 4 x 65536;
// the largest here, the prefill's QKV projection, is 96 x 64 x 32 = 196,608), so they run on the
// calling thread whatever num_threads says: the thread counts are the attention kernels'.
struct LayerSetup {
  // kHidden: everything_on's hidden size.
  static constexpr int64_t kBatch = 3, kHidden = 32, kMaxLen = 64;
  LayerConfig config;
  LayerWeights weights;
  int64_t block;
  std::unique_ptr<AttentionLayer> layer;
  std::vector<std::pair<int64_t, int64_t>> steps = {{0, 32}, {32, 20}, {52, 1}, {53, 1}, {54, 1}};
  std::vector<std::vector<float>> xs;  // each step's input, (batch, T, hidden)

  LayerSetup(DType dtype, int64_t block_) : block(block_) {
    config = reference::test::everything_on(dtype);
    std::mt19937 rng(41);
    weights = reference::test::random_weights(config, &rng);
    const Status s = AttentionLayer::create(config, weights, &layer);
    EXPECT_TRUE(s.ok) << s.message;
    for (const auto& step : steps) {
      xs.push_back(reference::test::random_vector(&rng, kBatch * step.second * kHidden, 1.0f));
    }
  }
  std::vector<int64_t> positions(size_t step) const {
    std::vector<int64_t> p;
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t t = 0; t < steps[step].second; ++t) p.push_back(steps[step].first + t);
    }
    return p;
  }

  Outcome run(int threads) const {
    KvCache cache;
    if (block == 0) {
      EXPECT_TRUE(layer->new_cache(kBatch, kMaxLen, &cache).ok);
    } else {
      const int64_t pages = kMaxLen / block;
      std::vector<int32_t> order(static_cast<size_t>(kBatch * pages + 2));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(3));
      EXPECT_TRUE(layer->new_paged_cache(kBatch, kBatch * pages + 2, block, &cache).ok);
      for (int64_t b = 0; b < kBatch; ++b) {
        const std::vector<int32_t> own(order.begin() + b * pages, order.begin() + (b + 1) * pages);
        EXPECT_TRUE(cache.assign(b, own, 0).ok);
      }
    }
    Outcome r;
    const DType t = config.dtype;
    for (size_t step = 0; step < steps.size(); ++step) {
      const int64_t tokens = steps[step].second, n = kBatch * tokens * kHidden;
      std::vector<float> out_f(t == DType::kFloat32 ? n : 0);
      std::vector<uint16_t> out_h(t == DType::kFloat32 ? 0 : n);
      void* data = t == DType::kFloat32 ? static_cast<void*>(out_f.data()) : out_h.data();
      const std::vector<int64_t> pos = positions(step);
      const Status s = layer->forward(
          TensorView::contiguous(xs[step].data(), DType::kFloat32, {kBatch, tokens, kHidden}),
          TensorView::contiguous(pos.data(), DType::kInt64, {kBatch, tokens}), &cache,
          MutableTensorView::contiguous(data, t, {kBatch, tokens, kHidden}), threads);
      EXPECT_TRUE(s.ok) << "step " << step << ": " << s.message;
      append_bytes(&r.bytes, data, static_cast<size_t>(n * dtype_size(t)));
      for (int64_t i = 0; i < n; ++i) {
        r.out.push_back(t == DType::kFloat32    ? out_f[i]
                        : t == DType::kBFloat16 ? half::bf16_to_float(out_h[i])
                                                : half::f16_to_float(out_h[i]));
      }
    }
    // The cache's K and V storage after the last step.
    const int64_t rows = cache.paged() ? cache.num_blocks() : cache.batch();
    const int64_t slots = cache.paged() ? cache.block_size() : cache.max_len();
    const auto n = static_cast<size_t>(rows * cache.kv_heads() * slots * cache.head_dim() *
                                       dtype_size(cache.dtype()));
    append_bytes(&r.bytes, cache.k_data(), n);
    append_bytes(&r.bytes, cache.v_data(), n);
    return r;
  }

  // Step by step against the layer's float64 oracle, with attention_layer_test.cc's bound: 12
  // units of the dtype (in float32, 1e-5 x the fan-in) of the step's largest output.
  ::testing::AssertionResult exact(const Outcome& r) const {
    reference::LayerCache cache = reference::test::new_cache(config, kBatch, kMaxLen);
    size_t at = 0;
    for (size_t step = 0; step < steps.size(); ++step) {
      const int64_t tokens = steps[step].second;
      const std::vector<int64_t> pos = positions(step);
      std::vector<double> want;
      const Status s = reference::layer_forward(
          config, weights,
          TensorView::contiguous(xs[step].data(), DType::kFloat32, {kBatch, tokens, kHidden}),
          TensorView::contiguous(pos.data(), DType::kInt64, {kBatch, tokens}), &cache, &want);
      if (!s.ok) return ::testing::AssertionFailure() << "oracle: " << s.message;
      const double unit =
          config.dtype == DType::kFloat32 ? 1e-5 * kHidden : unit_roundoff(config.dtype);
      const double bound = 12 * unit * std::max(largest(want), 1e-3);
      for (size_t i = 0; i < want.size(); ++i, ++at) {
        if (at >= r.out.size() || !(abs_error(r.out[at], want[i]) <= bound)) {
          return ::testing::AssertionFailure() << "step " << step << ", output " << i << ": "
                                               << (at < r.out.size() ? r.out[at] : NAN) << ", want "
                                               << want[i] << " within " << bound;
        }
      }
    }
    if (at != r.out.size()) {
      return ::testing::AssertionFailure() << "more outputs than the oracle's";
    }
    return ::testing::AssertionSuccess();
  }
};

TEST(ThreadsServing, LayerPrefillChunkDecodeDenseAndPaged) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (int64_t block : {0, 16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (block ? ", pages of 16" : ", dense"));
      const LayerSetup s(dtype, block);
      ASSERT_TRUE(s.layer != nullptr);
      expect_exact_and_thread_count_invariant([&](int threads) { return s.run(threads); },
                                              [&](const Outcome& r) { return s.exact(r); });
    }
  }
}

}  // namespace
}  // namespace flashcte::test
