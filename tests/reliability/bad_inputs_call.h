// The call of the bad-input matrix (bad_inputs_test.cc, bad_inputs_memory_test.cc): one valid
// attention_cte call over owned buffers with canary margins, a row (one defect of it, and the
// "<argument>: <rule>" it must be refused with), and the rows of bad_inputs_memory_test.cc.
#ifndef FLASHCTE_TESTS_RELIABILITY_BAD_INPUTS_CALL_H_
#define FLASHCTE_TESTS_RELIABILITY_BAD_INPUTS_CALL_H_

#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "tests/test_util.h"

namespace flashcte::test {

// Bytes on each side of every view; a write just past either end of a view lands here.
inline constexpr size_t kMargin = 256;

// An owned buffer holding one tensor plus margins, filled with a byte pattern.
struct Buffer {
  std::vector<uint8_t> bytes;
  void* data() { return bytes.data() + kMargin; }
  void init(size_t elements, int element_size, uint8_t pattern) {
    bytes.assign(elements * element_size + 2 * kMargin, pattern);
  }
};

// An obviously bogus address: if validation ever dereferenced it, the test would crash.
inline const void* fake_pointer(uintptr_t n) {
  return reinterpret_cast<const void*>(uintptr_t{1} << 40 | n << 12);
}

// One attention_cte call over owned buffers. The default is valid: float32, bs 2, bs_kv 1,
// Sq = Skv = 8, d = dv = 4, causal, with an lse output. Priors, sink, bounds and statistics are
// allocated (and valid) but attached only by the with_*() helpers, so a row breaks exactly one
// thing of a valid configuration.
struct Call {
  struct Shape {
    DType dtype = DType::kFloat32;
    int64_t bs = 2, bs_kv = 1, sq = 8, skv = 8, d = 4, dv = 4, s_prior = 8;
  } shape;
  Buffer q_buf, k_buf, v_buf, kp_buf, vp_buf, sink_buf, bmin_buf, bmax_buf, alibi_buf, kb_buf;
  Buffer out_buf, nm_buf, sr_buf, lse_buf;
  TensorView q, k, v;
  Outputs outputs;
  Options options;

  Call() { build(); }
  // Another shape: every buffer and view is rebuilt.
  void reset(const Shape& s) {
    shape = s;
    build();
  }

  void build() {
    const Shape& s = shape;
    const int es = dtype_size(s.dtype);
    // Inputs: a pattern that is a small finite number in every float dtype (0x3C3C: bf16 0.0115,
    // f16 1.06; 0x3C3C3C3C: f32 0.0115).
    q_buf.init(s.bs * s.sq * s.d, es, 0x3C);
    k_buf.init(s.bs_kv * s.skv * s.d, es, 0x3C);
    v_buf.init(s.bs_kv * s.skv * s.dv, es, 0x3C);
    kp_buf.init(s.bs_kv * s.s_prior * s.d, es, 0x3C);
    vp_buf.init(s.bs_kv * s.s_prior * s.dv, es, 0x3C);
    sink_buf.init(s.bs, 4, 0x3C);
    alibi_buf.init(s.bs, 4, 0x3C);
    kb_buf.init(s.bs * (s.s_prior + s.skv), 4, 0x3C);
    // Bounds: int32 rows [0, Sq) (all keys); written element-wise below.
    bmin_buf.init(s.sq, 4, 0);
    bmax_buf.init(s.sq, 4, 0);
    for (int64_t i = 0; i < s.sq; ++i) {
      const int32_t hi = static_cast<int32_t>(s.skv);
      std::memcpy(static_cast<uint8_t*>(bmax_buf.data()) + 4 * i, &hi, 4);
    }
    // Outputs: the canary (0xA5A5A5A5 is a finite float; any write changes some byte).
    out_buf.init(s.bs * s.sq * s.dv, es, 0xA5);
    nm_buf.init(s.bs * s.sq, 4, 0xA5);
    sr_buf.init(s.bs * s.sq, 4, 0xA5);
    lse_buf.init(s.bs * s.sq, 4, 0xA5);

    q = TensorView::contiguous(q_buf.data(), s.dtype, {s.bs, s.sq, s.d});
    k = TensorView::contiguous(k_buf.data(), s.dtype, {s.bs_kv, s.d, s.skv});
    v = TensorView::contiguous(v_buf.data(), s.dtype, {s.bs_kv, s.skv, s.dv});
    outputs = Outputs{};
    outputs.out = MutableTensorView::contiguous(out_buf.data(), s.dtype, {s.bs, s.sq, s.dv});
    outputs.lse = MutableTensorView::contiguous(lse_buf.data(), DType::kFloat32, {s.bs, s.sq});
    options = Options{};
  }

  void with_prior() {
    options.k_prior =
        TensorView::contiguous(kp_buf.data(), shape.dtype, {shape.bs_kv, shape.d, shape.s_prior});
    options.v_prior =
        TensorView::contiguous(vp_buf.data(), shape.dtype, {shape.bs_kv, shape.s_prior, shape.dv});
  }
  void with_sink() {
    options.sink = TensorView::contiguous(sink_buf.data(), DType::kFloat32, {shape.bs, 1});
  }
  void with_alibi() {
    options.alibi_slopes = TensorView::contiguous(alibi_buf.data(), DType::kFloat32, {shape.bs});
  }
  // Without a prior the concatenated KV axis is Skv long.
  void with_key_bias() {
    options.key_bias =
        TensorView::contiguous(kb_buf.data(), DType::kFloat32, {shape.bs, shape.skv});
  }
  void with_bounds() {
    options.bound_min = TensorView::contiguous(bmin_buf.data(), DType::kInt32, {shape.sq, 1});
    options.bound_max = TensorView::contiguous(bmax_buf.data(), DType::kInt32, {shape.sq, 1});
  }
  void with_stats() {
    options.cache_softmax = true;
    outputs.neg_max =
        MutableTensorView::contiguous(nm_buf.data(), DType::kFloat32, {shape.bs, shape.sq});
    outputs.sum_recip =
        MutableTensorView::contiguous(sr_buf.data(), DType::kFloat32, {shape.bs, shape.sq});
  }
  void set_bound(Buffer& b, int64_t row, int32_t value) {
    std::memcpy(static_cast<uint8_t*>(b.data()) + 4 * row, &value, 4);
  }

  // Every buffer of the call, margins included.
  BufferSnapshot snapshot() const {
    BufferSnapshot snap;
    for (const auto& [name, b] :
         {std::pair{"q", &q_buf}, std::pair{"k", &k_buf}, std::pair{"v", &v_buf},
          std::pair{"k_prior", &kp_buf}, std::pair{"v_prior", &vp_buf},
          std::pair{"sink", &sink_buf}, std::pair{"bound_min", &bmin_buf},
          std::pair{"bound_max", &bmax_buf}, std::pair{"alibi_slopes", &alibi_buf},
          std::pair{"key_bias", &kb_buf}, std::pair{"out", &out_buf}, std::pair{"neg_max", &nm_buf},
          std::pair{"sum_recip", &sr_buf}, std::pair{"lse", &lse_buf}}) {
      snap.add(name, b->bytes);
    }
    return snap;
  }
  Status run() const { return attention_cte(q, k, v, outputs, options); }
};

struct Row {
  const char* name;
  std::function<void(Call&)> setup;  // builds the call (shape changes first, then defects)
  const char* argument;              // the message must start with "<argument>: "
  const char* rule;                  // and contain this
};

inline Call::Shape with(std::function<void(Call::Shape&)> f) {
  Call::Shape s;
  f(s);
  return s;
}

// The rows of the outputs and the memory: statistics, aliasing, null data, sizes past 2^63 on
// fake pointers, and tiles (bad_inputs_memory_test.cc).
std::vector<Row> memory_rows();

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_RELIABILITY_BAD_INPUTS_CALL_H_
