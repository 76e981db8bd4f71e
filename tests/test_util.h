// Shared test machinery: tensors in every dtype and memory layout, a declarative description of
// one attention_cte call (`Case`), running it through the kernel and the float64 reference, and
// comparing the two with tolerances derived from arithmetic (see compare() in test_util.cc).
#ifndef FLASHCTE_TESTS_TEST_UTIL_H_
#define FLASHCTE_TESTS_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/half.h"
#include "src/reference/reference.h"

namespace flashcte::test {

// Physical arrangement of a tensor's elements in memory (its logical shape is unchanged).
enum class Layout {
  kContiguous,  // dense row-major
  kPadded,      // row-major with padding after every row and batch
  kStrided,     // innermost stride 2 (a gap after every element), padded rows
  kReversed,    // column-major: the first axis is innermost
};
const char* layout_name(Layout layout);

enum class Dist { kUniform01, kNormal };
// The Neuron layout (bs, 128, Sq/128) or row-major (bs, Sq) for neg_max / sum_recip.
enum class StatsLayout { kNone, kNeuron, kRowMajor };

// An owned tensor of rank 1 to 3. Elements outside the view (gaps of non-dense layouts) hold a
// NaN sentinel, so a kernel reading them produces NaN and one writing them is caught by
// gaps_intact().
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape, Layout layout = Layout::kContiguous);

  TensorView view() const;
  MutableTensorView mutable_view();
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t offset(int64_t i0, int64_t i1 = 0, int64_t i2 = 0) const;
  // The exact value of an element, and a store that rounds to the dtype (ties to even).
  double get(int64_t i0, int64_t i1 = 0, int64_t i2 = 0) const;
  void set(int64_t i0, int64_t i1, int64_t i2, double value);
  void set_raw_int(int64_t i0, int64_t i1, int64_t value);  // int32/int64 tensors
  // Sets every element of the view (not the gaps) to the NaN sentinel.
  void fill_sentinel();
  // True when no byte outside the view has changed since construction.
  bool gaps_intact() const;
  const std::vector<uint8_t>& bytes() const { return storage_; }

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  std::vector<uint8_t> storage_;
  std::vector<uint8_t> in_view_;  // per storage element: 1 when some index maps to it
};

// The unit roundoff of dtype: 2^-8 (bfloat16), 2^-11 (float16), 2^-24 (float32).
double unit_roundoff(DType dtype);

// One attention_cte call, described by its shape and options; run_case() builds the tensors.
struct Case {
  DType dtype = DType::kFloat32;
  int64_t bs = 1, bs_kv = 1;
  int64_t sq = 16, skv = 16;
  int64_t d = 16;
  int64_t dv = 0;  // 0: same as d
  // Prefix caching: when has_prior, k_prior/v_prior of length s_prior, and
  // options.prior_used_len as given (empty = all of s_prior).
  bool has_prior = false;
  int64_t s_prior = 0;
  bool sink = false;
  double sink_lo = 15, sink_hi = 25;  // the Neuron suite's sinks: uniform in [15, 25]
  std::vector<double> sink_values;    // when not empty: the sinks, one per batch
  Dist dist = Dist::kUniform01;       // q, k, v (and priors) elements
  // Multipliers of the drawn q and k elements, and of v: extreme magnitudes (huge logits,
  // float16 subnormal or near-overflow values) without a new distribution.
  double qk_mult = 1, v_mult = 1;
  Layout q_layout = Layout::kContiguous, k_layout = Layout::kContiguous;
  Layout v_layout = Layout::kContiguous, out_layout = Layout::kContiguous;
  Layout stats_layout = Layout::kContiguous;  // memory layout of neg_max / sum_recip / lse
  StatsLayout stats = StatsLayout::kNone;     // sets options.cache_softmax
  bool lse = false;
  // Sequence packing: the query rows split into consecutive sequences of these lengths (they
  // sum to sq). Sequence s may attend the KV range [kv_start(s), kv_end(s)) obtained by scaling
  // its query range by skv/sq and shifting by the used prior; the first sequence also sees the
  // prior. With pack_empty_sequence, sequence 1 gets an empty range (rows with nothing to attend
  // to unless there is a sink).
  std::vector<int64_t> pack_lengths;
  bool pack_empty_sequence = false;
  DType bound_dtype = DType::kInt32;
  bool bound_rank1 = false;  // (Sq,) instead of (Sq, 1)
  Options options;           // scale, masks, transposes, CP, tiles, threads
  // Query rows compared with the reference; empty: all rows when the reference is cheap,
  // otherwise a sample (sample_rows) so big shapes stay fast.
  std::vector<int64_t> rows;
  uint64_t seed = 1;

  int64_t value_dim() const { return dv > 0 ? dv : d; }
  std::string describe() const;
};

// A spread of rows: both ends, both sides of every multiple of 128 up to a limit, and random
// rows; all rows when n >= sq. Sorted and unique.
std::vector<int64_t> sample_rows(int64_t sq, int64_t n, uint64_t seed);

// Everything one run produced.
struct Outcome {
  Status status;
  std::vector<int64_t> rows;  // the compared query rows
  // Kernel outputs on `rows`, as (bs, rows.size(), dv) / (bs, rows.size()) in a Result.
  reference::Result kernel;
  reference::Result exact;      // reference::attention_rows
  reference::Result plain;      // reference::attention_plain_rows (low-precision dtypes only)
  bool outputs_written = true;  // no sentinel left anywhere in out / the statistics
  bool gaps_intact = true;      // nothing written outside the output views
  std::vector<uint8_t> raw;     // all output bytes, for bitwise comparisons across runs
};

// The tensors of a case, built deterministically from its seed.
struct CaseTensors {
  HostTensor q, k, v, k_prior, v_prior, sink, bound_min, bound_max;
  HostTensor out, neg_max, sum_recip, lse;
  Options options;  // the case's options with every tensor attached
  Outputs outputs;
};
void build_tensors(const Case& c, CaseTensors* t);

// Runs the kernel and (unless skip_reference) the reference on the same inputs.
Outcome run_case(const Case& c, bool skip_reference = false);

// The kernel's outcome against the reference, with the tolerance rules of the suite.
::testing::AssertionResult compare(const Case& c, const Outcome& o);

// run_case + a successful status + compare.
::testing::AssertionResult check_case(const Case& c);

// True when the environment asks for the full-size (`long`) tests: FLASHCTE_LONG_TESTS=1.
bool long_tests_enabled();

// The Neuron kernel's tiling and a small odd one that forces multi-tile sections and ragged
// edges on small shapes.
TileConfig neuron_tiles();
TileConfig odd_tiles();

// A failed Status whose message names `argument` first ("<argument>: <rule>"), as every entry
// point's errors do.
::testing::AssertionResult refused_for(const Status& s, const std::string& argument);

// Byte snapshots of the caller-owned buffers of a call, to prove that a refused call wrote
// nothing: add() every buffer the call could write or read (caches, scales, codes, tables,
// lengths, inputs) and add_output() every output (first filled with 0xFF bytes, a NaN in every
// float dtype, so that any write shows), all after the call's arguments are set up and before the
// call; then EXPECT_TRUE(snapshot.unchanged()). A buffer must stay where it is in between (no
// vector resized). A failure names each buffer that changed, its first changed byte offset with
// the bytes before and after, and how many bytes changed.
class BufferSnapshot {
 public:
  BufferSnapshot& add(std::string name, const void* data, size_t bytes);
  template <class T>
  BufferSnapshot& add(std::string name, const std::vector<T>& buffer) {
    return add(std::move(name), buffer.data(), buffer.size() * sizeof(T));
  }
  BufferSnapshot& add_output(std::string name, void* data, size_t bytes);
  template <class T>
  BufferSnapshot& add_output(std::string name, std::vector<T>& buffer) {
    return add_output(std::move(name), buffer.data(), buffer.size() * sizeof(T));
  }
  ::testing::AssertionResult unchanged() const;

 private:
  struct Buffer {
    std::string name;
    const unsigned char* data;
    std::vector<unsigned char> before;
  };
  std::vector<Buffer> buffers_;
};

// The error of one value against its reference: |got - want| where both are finite, 0 where both
// are NaN or the same infinity (an empty row's lse), and +inf where only one side is finite or the
// infinities differ. So a `<= tolerance` check on it, or on a maximum of it, never passes a NaN,
// an Inf or an element left at the NaN sentinel where the reference is finite, nor the reverse;
// `std::max(m, |a - b|)` would drop a NaN.
double abs_error(double got, double want);

// The largest abs_error(got[i], want[i]); +inf when the lengths differ.
double max_abs_diff(const std::vector<double>& got, const std::vector<double>& want);

// got's largest error against `exact` is at most `factor` times that of a plain same-precision
// implementation (`plain`) plus `floor` (FlashAttention's rule). Fails on a NaN/Inf mismatch in
// `got`, and when the plain implementation's own error is not finite (no bound to hold it to).
::testing::AssertionResult within_plain_error(const std::vector<double>& got,
                                              const std::vector<double>& plain,
                                              const std::vector<double>& exact, double factor,
                                              double floor);

// n float32 NaNs: an lse output that the kernel must overwrite everywhere.
inline std::vector<float> nan_floats(int64_t n) {
  return std::vector<float>(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN());
}

// Each case of `shapes` once per attention dtype (float32, bfloat16, float16), its name suffixed
// with the dtype's ("<name>_bfloat16"); Case has `name` and `dtype`.
template <class Case>
std::vector<Case> in_every_dtype(const std::vector<Case>& shapes) {
  std::vector<Case> cases;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (Case c : shapes) {
      c.dtype = dtype;
      c.name += std::string("_") + dtype_name(dtype);
      cases.push_back(c);
    }
  }
  return cases;
}

// An owned rank-4 tensor in any float dtype, row-major; strided: channel stride 2 and padded rows.
class Tensor4 {
 public:
  Tensor4(DType dtype, std::array<int64_t, 4> shape, bool strided = false)
      : dtype_(dtype), shape_(shape) {
    int64_t stride = strided ? 2 : 1;
    for (int i = 3; i >= 0; --i) {
      strides_[i] = stride;
      stride = stride * shape[i] + (strided && i == 3 ? 3 : 0);
    }
    bytes_.assign(static_cast<size_t>(stride * dtype_size(dtype)), 0);
  }
  int64_t offset(int64_t a, int64_t b, int64_t c, int64_t x) const {
    return a * strides_[0] + b * strides_[1] + c * strides_[2] + x * strides_[3];
  }
  void set(int64_t a, int64_t b, int64_t c, int64_t x, double value) {
    const float f = static_cast<float>(reference::round_to_dtype(value, dtype_));
    unsigned char* p = bytes_.data() + offset(a, b, c, x) * dtype_size(dtype_);
    if (dtype_ == DType::kFloat32) {
      std::memcpy(p, &f, 4);
      return;
    }
    const uint16_t h = dtype_ == DType::kBFloat16 ? half::float_to_bf16(f) : half::float_to_f16(f);
    std::memcpy(p, &h, 2);
  }
  double get(int64_t a, int64_t b, int64_t c, int64_t x) const {
    return reference::load_element(bytes_.data(), dtype_, offset(a, b, c, x));
  }
  TensorView view() const { return {bytes_.data(), dtype_, 4, shape_, strides_}; }
  // The view with axes 1 and 2 swapped (strides permuted, nothing moved).
  TensorView view_swapping_axes_1_2() const {
    TensorView t = view();
    std::swap(t.shape[1], t.shape[2]);
    std::swap(t.strides[1], t.strides[2]);
    return t;
  }
  MutableTensorView mutable_view() { return {bytes_.data(), dtype_, 4, shape_, strides_}; }
  // Every byte 0xFF: a NaN in float32, bfloat16 and float16, so an output element the kernel
  // never writes fails the NaN-aware comparisons (abs_error).
  Tensor4& fill_nan() {
    std::fill(bytes_.begin(), bytes_.end(), static_cast<unsigned char>(0xFF));
    return *this;
  }
  const std::vector<unsigned char>& bytes() const { return bytes_; }
  std::vector<unsigned char>& bytes() { return bytes_; }

 private:
  DType dtype_;
  std::array<int64_t, 4> shape_, strides_{};
  std::vector<unsigned char> bytes_;
};

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_TEST_UTIL_H_
