#include "tools/tensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/core/pages.h"

namespace flashcte::tools {
namespace {

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  // A zero dimension counts as 1 here: an empty tensor addresses nothing, and nonzero strides
  // keep it from looking like a broadcast (stride-0) view to the library's overlap checks.
  std::vector<int64_t> strides(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * std::max<int64_t>(shape[i + 1], 1);
  }
  return strides;
}

template <typename View>
View make_view(void* data, DType dtype, const std::vector<int64_t>& shape) {
  View v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  const std::vector<int64_t> strides = row_major_strides(shape);
  for (int i = 0; i < v.rank && i < kMaxRank; ++i) {
    v.shape[i] = shape[i];
    v.strides[i] = strides[i];
  }
  return v;
}

// splitmix64: tiny, fast, and good enough for test inputs; fixed so every machine draws the
// same numbers for a seed.
uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  // A zero dimension makes the tensor empty however large the others are (a .npy file may say
  // (0, 2^40, 2^40)); otherwise an overflowing product is simply too much memory.
  elements_ = 1;
  bool empty = false;
  for (int64_t d : shape_) empty |= d == 0;
  for (int64_t d : shape_) {
    if (empty) {
      elements_ = 0;
      break;
    }
    if (d < 0 || __builtin_mul_overflow(elements_, d, &elements_) ||
        elements_ > (int64_t{1} << 56)) {
      throw std::bad_alloc();
    }
  }
  // Zeroed, on whole cache lines (rows of 64 bytes keep the kernel's vector loads from splitting
  // lines at the start of a tensor), on huge pages when large (src/core/pages.h).
  void* p = internal::allocate_pages(static_cast<size_t>(elements_) * dtype_size(dtype_));
  storage_.reset(p);
}

TensorView HostTensor::view() const {
  return make_view<TensorView>(const_cast<void*>(data()), dtype_, shape_);
}

MutableTensorView HostTensor::mutable_view() {
  return make_view<MutableTensorView>(data(), dtype_, shape_);
}

bool ParseFloatDType(const std::string& text, DType* dtype) {
  if (text == "float32" || text == "fp32" || text == "f32") return *dtype = DType::kFloat32, true;
  if (text == "bfloat16" || text == "bf16") return *dtype = DType::kBFloat16, true;
  if (text == "float16" || text == "fp16" || text == "f16") return *dtype = DType::kFloat16, true;
  return false;
}

DType NaturalDType(NpyDtype dtype) {
  return dtype == NpyDtype::kFloat16 ? DType::kFloat16 : DType::kFloat32;
}

bool ConvertFloatArray(const NpyArray& a, DType target, HostTensor* out) {
  if (a.dtype != NpyDtype::kFloat16 && a.dtype != NpyDtype::kFloat32 &&
      a.dtype != NpyDtype::kFloat64) {
    return false;
  }
  *out = HostTensor(target, a.shape);
  const int64_t n = a.elements();
  const uint8_t* src = a.data.data();
  for (int64_t i = 0; i < n; ++i) {
    // Decode the source element exactly (float16 and float32 widen to double without loss).
    double x = 0;
    uint16_t h = 0;
    switch (a.dtype) {
      case NpyDtype::kFloat16:
        std::memcpy(&h, src + 2 * i, 2);
        x = half::f16_to_float(h);
        break;
      case NpyDtype::kFloat32: {
        float f;
        std::memcpy(&f, src + 4 * i, 4);
        x = f;
        break;
      }
      case NpyDtype::kFloat64:
        std::memcpy(&x, src + 8 * i, 8);
        break;
      case NpyDtype::kInt32:
      case NpyDtype::kInt64:
        return false;  // LoadFloatTensor takes float files only
    }
    switch (target) {
      case DType::kFloat32:
        out->as<float>()[i] = static_cast<float>(x);
        break;
      case DType::kBFloat16:
        out->as<uint16_t>()[i] = half::double_to_bf16(x);
        break;
      case DType::kFloat16:
        // A float16 source is already exact; skip the round trip for speed and bit-exactness of
        // NaN payloads.
        out->as<uint16_t>()[i] = a.dtype == NpyDtype::kFloat16 ? h : half::double_to_f16(x);
        break;
      case DType::kInt32:
      case DType::kInt64:
      case DType::kInt8:
      case DType::kFloat8E4M3:
      case DType::kFloat8E5M2:
        return false;
    }
  }
  return true;
}

bool LoadFloatTensor(const std::string& flag, const std::string& path, DType target,
                     HostTensor* out, std::string* error) {
  NpyArray a;
  if (!read_npy(path, &a, error)) {
    *error = flag + ": " + *error;
    return false;
  }
  if (a.rank() > kMaxRank) {
    *error = flag + ": " + path + ": shape " + shape_string(a.shape) + " has rank " +
             std::to_string(a.rank()) + "; at most " + std::to_string(kMaxRank) + " is meaningful";
    return false;
  }
  if (!ConvertFloatArray(a, target, out)) {
    *error = flag + ": " + path + ": dtype " + npy_dtype_name(a.dtype) +
             " is not a floating-point type (expected float32, float16 or float64)";
    return false;
  }
  return true;
}

bool LoadBoundsTensor(const std::string& flag, const std::string& path, HostTensor* out,
                      std::string* error) {
  NpyArray a;
  if (!read_npy(path, &a, error)) {
    *error = flag + ": " + *error;
    return false;
  }
  if (a.rank() < 1 || a.rank() > 2) {
    *error = flag + ": " + path + ": shape " + shape_string(a.shape) + " must be (Sq, 1) or (Sq,)";
    return false;
  }
  const int64_t n = a.elements();
  switch (a.dtype) {
    case NpyDtype::kInt32:
      *out = HostTensor(DType::kInt32, a.shape);
      if (n) std::memcpy(out->data(), a.data.data(), a.data.size());
      return true;
    case NpyDtype::kInt64:
      *out = HostTensor(DType::kInt64, a.shape);
      if (n) std::memcpy(out->data(), a.data.data(), a.data.size());
      return true;
    case NpyDtype::kFloat32:
    case NpyDtype::kFloat16:
      return ConvertFloatArray(a, DType::kFloat32, out);
    case NpyDtype::kFloat64:
      *out = HostTensor(DType::kInt64, a.shape);
      for (int64_t i = 0; i < n; ++i) {
        double x;
        std::memcpy(&x, a.data.data() + 8 * i, 8);
        if (!std::isfinite(x) || x != std::floor(x) || std::fabs(x) > 9.0e15) {
          *error = flag + ": " + path + ": element " + std::to_string(i) + " is " +
                   std::to_string(x) + ", not an integral index";
          return false;
        }
        out->as<int64_t>()[i] = static_cast<int64_t>(x);
      }
      return true;
  }
  return false;
}

float ElementAsFloat(const HostTensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kFloat32:
      return t.as<float>()[i];
    case DType::kBFloat16:
      return half::bf16_to_float(t.as<uint16_t>()[i]);
    case DType::kFloat16:
      return half::f16_to_float(t.as<uint16_t>()[i]);
    case DType::kInt32:
      return static_cast<float>(t.as<int32_t>()[i]);
    case DType::kInt64:
      return static_cast<float>(t.as<int64_t>()[i]);
    case DType::kInt8:
      return static_cast<float>(t.as<int8_t>()[i]);
    case DType::kFloat8E4M3:
      return kv8::e4m3_to_float(t.as<uint8_t>()[i]);
    case DType::kFloat8E5M2:
      return kv8::e5m2_to_float(t.as<uint8_t>()[i]);
  }
  return 0;
}

std::vector<float> ToFloat32(const HostTensor& t) {
  std::vector<float> out(t.elements());
  for (int64_t i = 0; i < t.elements(); ++i) out[i] = ElementAsFloat(t, i);
  return out;
}

bool SaveFloat32(const std::string& flag, const std::string& path, const std::vector<float>& data,
                 const std::vector<int64_t>& shape, std::string* error) {
  if (!write_npy(path, NpyDtype::kFloat32, shape, data.data(), error)) {
    *error = flag + ": " + *error;
    return false;
  }
  return true;
}

void FillUniform(HostTensor* t, uint64_t seed, float lo, float hi) {
  uint64_t state = seed;
  const int64_t n = t->elements();
  for (int64_t i = 0; i < n; ++i) {
    // 24 random bits -> a float in [0, 1) exactly.
    const float u = static_cast<float>(splitmix64(&state) >> 40) * (1.0f / 16777216.0f);
    const float x = lo + (hi - lo) * u;
    switch (t->dtype()) {
      case DType::kFloat32:
        t->as<float>()[i] = x;
        break;
      case DType::kBFloat16:
        t->as<uint16_t>()[i] = half::float_to_bf16(x);
        break;
      case DType::kFloat16:
        t->as<uint16_t>()[i] = half::float_to_f16(x);
        break;
      case DType::kInt8:
        t->as<int8_t>()[i] = kv8::float_to_int8(x);
        break;
      case DType::kFloat8E4M3:
        t->as<uint8_t>()[i] = kv8::float_to_e4m3(x);
        break;
      case DType::kFloat8E5M2:
        t->as<uint8_t>()[i] = kv8::float_to_e5m2(x);
        break;
      case DType::kInt32:
      case DType::kInt64:
        break;  // indices: the callers fill them themselves
    }
  }
}

}  // namespace flashcte::tools
