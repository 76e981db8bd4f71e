// `flashcte bench`'s implementations (bench_impls.h):
//   materialized  what a user writes without a flash kernel: per head, OpenBLAS sgemm Q.K^T into
//                 a full Sq x Skv score matrix, a (vectorized) masked row softmax, sgemm P.V.
//                 float32 only; bfloat16/float16 inputs are widened once, outside the timing.
//   sgemm         the roofline: one square OpenBLAS sgemm with about attention's FLOP count.
#include "tools/bench_impls.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "tools/attention_flags.h"
#include "tools/tensors.h"

#if FLASHCTE_HAVE_OPENBLAS
#include <cblas.h>

#include "tools/bench_softmax.h"
#endif

namespace flashcte::tools {
namespace {

class FlashImpl : public Impl {
 public:
  explicit FlashImpl(const BenchConfig& c) : c_(c) {}
  const char* name() const override { return "flashcte"; }
  bool Setup(std::string*) override {
    q_ = HostTensor(c_.dtype, {c_.heads, c_.sq, c_.d});
    k_ = HostTensor(c_.dtype, {c_.kv_heads, c_.d, c_.skv});
    v_ = HostTensor(c_.dtype, {c_.kv_heads, c_.skv, c_.d});
    out_ = HostTensor(c_.dtype, {c_.heads, c_.sq, c_.d});
    FillUniform(&q_, 1, 0.0f, 1.0f);
    FillUniform(&k_, 2, 0.0f, 1.0f);
    FillUniform(&v_, 3, 0.0f, 1.0f);
    options_.scale = c_.scale;
    options_.causal_mask = c_.causal;
    options_.num_threads = c_.threads;
    options_.tiles = c_.tiles;
    return true;
  }
  bool Run(std::string* error) override {
    Outputs outputs;
    outputs.out = out_.mutable_view();
    const Status s = attention_cte(q_.view(), k_.view(), v_.view(), outputs, options_);
    if (!s.ok) *error = "attention_cte: " + s.message;
    return s.ok;
  }
  double Flops() const override {
    return 4.0 * c_.d * c_.heads * UnmaskedPairs(c_.sq, c_.skv, c_.causal);
  }
  void AddJson(Json* j) const override {
    (*j)["compute_dtype"] = dtype_name(c_.dtype);
    (*j)["simd"] = simd_target();
  }

 private:
  BenchConfig c_;
  HostTensor q_, k_, v_, out_;
  Options options_;
};

#if FLASHCTE_HAVE_OPENBLAS
// The OpenBLAS kernels the process runs with, and why, as JSON fields.
void AddOpenBlasJson(const OpenBlasSelection& o, Json* j) {
  (*j)["openblas_core"] = o.used;
  (*j)["openblas_core_detected"] = o.detected.empty() ? Json() : Json(o.detected);
  (*j)["openblas_core_overridden"] = o.overridden;
  (*j)["openblas_core_reason"] = o.reason;
}

class MaterializedImpl : public Impl {
 public:
  explicit MaterializedImpl(const BenchConfig& c) : c_(c) {}
  const char* name() const override { return "materialized"; }
  bool UsesOpenBlas() const override { return true; }
  bool Setup(std::string*) override {
    // Same inputs as flashcte (same seeds, rounded to the dtype), then widened to float32.
    HostTensor q(c_.dtype, {c_.heads, c_.sq, c_.d});
    HostTensor k(c_.dtype, {c_.kv_heads, c_.d, c_.skv});
    HostTensor v(c_.dtype, {c_.kv_heads, c_.skv, c_.d});
    FillUniform(&q, 1, 0.0f, 1.0f);
    FillUniform(&k, 2, 0.0f, 1.0f);
    FillUniform(&v, 3, 0.0f, 1.0f);
    q_ = ToFloat32(q);
    k_ = ToFloat32(k);
    v_ = ToFloat32(v);
    scores_.assign(static_cast<size_t>(c_.sq * c_.skv), 0.0f);
    out_.assign(static_cast<size_t>(c_.heads * c_.sq * c_.d), 0.0f);
    return true;
  }
  bool Run(std::string*) override {
    const int64_t group = c_.heads / c_.kv_heads;
    const int64_t sq = c_.sq, skv = c_.skv, d = c_.d;
    for (int64_t h = 0; h < c_.heads; ++h) {
      const float* q = q_.data() + h * sq * d;
      const float* k = k_.data() + (h / group) * d * skv;  // (d, Skv): the Neuron default layout
      const float* v = v_.data() + (h / group) * skv * d;
      float* o = out_.data() + h * sq * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sq, skv, d, c_.scale, q, d, k, skv,
                  0.0f, scores_.data(), skv);
      MaskedSoftmaxRows(scores_.data(), sq, skv, skv, c_.causal, c_.threads);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, sq, d, skv, 1.0f, scores_.data(), skv,
                  v, d, 0.0f, o, d);
    }
    return true;
  }
  double Flops() const override {
    return 4.0 * c_.d * c_.heads * UnmaskedPairs(c_.sq, c_.skv, c_.causal);
  }
  void AddJson(Json* j) const override {
    (*j)["compute_dtype"] = "float32";
    if (c_.dtype != DType::kFloat32) {
      (*j)["input_conversion"] =
          std::string(dtype_name(c_.dtype)) + " inputs widened to float32 once, outside the timing";
    }
    AddOpenBlasJson(c_.openblas, j);
  }

 private:
  BenchConfig c_;
  std::vector<float> q_, k_, v_, scores_, out_;
};

class SgemmImpl : public Impl {
 public:
  explicit SgemmImpl(const BenchConfig& c, double attention_flops) : c_(c) {
    // A square GEMM of about the attention's useful FLOPs (2n^3 ~ flops), a multiple of 256
    // within [256, 4096] so it stays in OpenBLAS's steady state and in memory.
    const double n = std::cbrt(attention_flops / 2.0);
    n_ = std::clamp<int64_t>(static_cast<int64_t>(n / 256.0) * 256, 256, 4096);
  }
  const char* name() const override { return "sgemm"; }
  bool UsesOpenBlas() const override { return true; }
  bool Setup(std::string*) override {
    HostTensor a(DType::kFloat32, {n_, n_}), b(DType::kFloat32, {n_, n_});
    FillUniform(&a, 4, 0.0f, 1.0f);
    FillUniform(&b, 5, 0.0f, 1.0f);
    a_ = ToFloat32(a);
    b_ = ToFloat32(b);
    c_out_.assign(static_cast<size_t>(n_ * n_), 0.0f);
    return true;
  }
  bool Run(std::string*) override {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n_, n_, n_, 1.0f, a_.data(), n_,
                b_.data(), n_, 0.0f, c_out_.data(), n_);
    return true;
  }
  double Flops() const override { return 2.0 * n_ * n_ * n_; }
  void AddJson(Json* j) const override {
    (*j)["compute_dtype"] = "float32";
    (*j)["m"] = n_;
    (*j)["n"] = n_;
    (*j)["k"] = n_;
    AddOpenBlasJson(c_.openblas, j);
  }

 private:
  BenchConfig c_;
  int64_t n_;
  std::vector<float> a_, b_, c_out_;
};
#endif  // FLASHCTE_HAVE_OPENBLAS

}  // namespace

std::unique_ptr<Impl> MakeFlashImpl(const BenchConfig& c) { return std::make_unique<FlashImpl>(c); }
#if FLASHCTE_HAVE_OPENBLAS
std::unique_ptr<Impl> MakeMaterializedImpl(const BenchConfig& c) {
  return std::make_unique<MaterializedImpl>(c);
}
std::unique_ptr<Impl> MakeSgemmImpl(const BenchConfig& c, double attention_flops) {
  return std::make_unique<SgemmImpl>(c, attention_flops);
}
#endif

}  // namespace flashcte::tools
