// Host-side tensors for the CLI: owned, 64-byte aligned buffers in one of the library's dtypes,
// loaded from .npy files with the conversions the `run` command promises (round to nearest even
// into bfloat16/float16), and written back as float32 .npy.
#ifndef FLASHCTE_TOOLS_TENSORS_H_
#define FLASHCTE_TOOLS_TENSORS_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/npy.h"

namespace flashcte::tools {

class HostTensor {
 public:
  HostTensor() = default;
  // Zero-filled.
  HostTensor(DType dtype, std::vector<int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t elements() const { return elements_; }
  bool empty() const { return storage_ == nullptr && elements_ == 0; }
  void* data() { return storage_.get(); }
  const void* data() const { return storage_.get(); }
  template <typename T>
  T* as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data());
  }

  // Dense row-major views of the whole tensor (rank must be 1..3).
  TensorView view() const;
  MutableTensorView mutable_view();

 private:
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> shape_;
  int64_t elements_ = 0;
  std::unique_ptr<void, Free> storage_;
};

// "float32" | "bfloat16" | "float16" (and the short forms fp32, bf16, fp16) -> DType.
bool ParseFloatDType(const std::string& text, DType* dtype);
// The dtype a float .npy file naturally computes in: float16 for '<f2', float32 otherwise.
DType NaturalDType(NpyDtype dtype);

// Reads a float .npy (float16, float32 or float64) and converts it to `target` with round to
// nearest even (float64 goes straight to the target, without rounding twice). Errors start with
// "<flag>: <path>: ".
bool LoadFloatTensor(const std::string& flag, const std::string& path, DType target,
                     HostTensor* out, std::string* error);
bool ConvertFloatArray(const NpyArray& array, DType target, HostTensor* out);

// Packing bounds: int32, int64 and float32 files pass through as they are (the library reads
// them); float16 widens to float32; float64 must hold integers and becomes int64.
bool LoadBoundsTensor(const std::string& flag, const std::string& path, HostTensor* out,
                      std::string* error);

// Any float dtype -> float32 (exact for bfloat16/float16).
std::vector<float> ToFloat32(const HostTensor& t);
float ElementAsFloat(const HostTensor& t, int64_t index);

bool SaveFloat32(const std::string& flag, const std::string& path, const std::vector<float>& data,
                 const std::vector<int64_t>& shape, std::string* error);

// Fills a float tensor with independent uniform values in [lo, hi), rounded to its dtype.
// Deterministic for a seed, whatever the machine.
void FillUniform(HostTensor* t, uint64_t seed, float lo, float hi);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_TENSORS_H_
