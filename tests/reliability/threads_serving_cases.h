// The machinery of the serving paths' thread tests (threads_serving_test.cc,
// threads_serving_varlen_test.cc, threads_serving_layer_test.cc; the design in
// threads_serving_test.cc's file comment): a path's bytes on 1 thread against the float64 oracle,
// then every byte equal on 3 threads and OpenMP's default; the oracle of a set of problems; the
// caches (dense or paged, float or 8-bit with their scales), sinks and random fills.
#ifndef FLASHCTE_TESTS_RELIABILITY_THREADS_SERVING_CASES_H_
#define FLASHCTE_TESTS_RELIABILITY_THREADS_SERVING_CASES_H_

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
// Internal linkage, as in a test file: these names (Outcome, Cache, kD, ...) differ from other
// tests' (test_util.h's Outcome among them).
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

inline void append_bytes(std::vector<uint8_t>* bytes, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  bytes->insert(bytes->end(), p, p + n);
}

inline ::testing::AssertionResult same_bytes(const std::vector<uint8_t>& got,
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
inline void expect_exact_and_thread_count_invariant(
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

inline double largest(const std::vector<double>& xs) {
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

inline void add_oracle(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Options& o, Oracle* g) {
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
inline void add_oracle(const Problem& p, DType dtype, Oracle* g) {
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
inline ::testing::AssertionResult matches(const Outcome& r, const Oracle& g, DType dtype) {
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
inline Formats float_caches(DType dtype) {
  return {dtype, dtype, Scales::kTensor, Scales::kTensor};
}

// Sinks around the logits' scale, one head without.
inline std::vector<float> sinks(std::mt19937_64* rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<float> s;
  for (int64_t h = 0; h < kHeads; ++h) {
    s.push_back(h == 1 ? kNoSink : static_cast<float>(2 * u(*rng)));
  }
  return s;
}

inline void fill(Tensor4* t, std::mt19937_64* rng) {
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
inline DType oracle_dtype(DType q_dtype, const Formats& f) {
  return kv8::is_8bit(f.k) || kv8::is_8bit(f.v) ? DType::kFloat32 : q_dtype;
}

}  // namespace
}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_RELIABILITY_THREADS_SERVING_CASES_H_
