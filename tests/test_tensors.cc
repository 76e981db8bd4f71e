// The tests' memory (test_util.h): HostTensor, a tensor of any dtype in any memory layout whose
// gaps and unwritten elements hold sentinels, and BufferSnapshot, the bytes of buffers a call must
// leave alone. Running a Case and comparing it with the float64 reference: test_util.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>

#include "src/core/kv8.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

int element_size(DType dtype) { return dtype_size(dtype); }

// Gap and "not yet written" filler: NaNs with an unusual payload (so a kernel copying a NaN it
// computed is not mistaken for the sentinel), and an absurd index for integer tensors (a kernel
// reading it as a packing bound would fail validation or mask everything).
void write_sentinel(DType dtype, uint8_t* p) {
  switch (dtype) {
    case DType::kFloat32: {
      const uint32_t bits = 0x7FC0DEADu;
      std::memcpy(p, &bits, 4);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t bits = 0x7FDE;
      std::memcpy(p, &bits, 2);
      break;
    }
    case DType::kFloat16: {
      const uint16_t bits = 0x7E5A;
      std::memcpy(p, &bits, 2);
      break;
    }
    case DType::kInt32: {
      const int32_t v = 0x3EADBEEF;
      std::memcpy(p, &v, 4);
      break;
    }
    case DType::kInt64: {
      const int64_t v = int64_t{0x3EADBEEF} << 20;
      std::memcpy(p, &v, 8);
      break;
    }
    case DType::kInt8:
      *p = 0x5A;
      break;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      *p = 0x7F;  // NaN in both
      break;
  }
}

std::vector<int64_t> layout_strides(const std::vector<int64_t>& shape, Layout layout) {
  const int rank = static_cast<int>(shape.size());
  std::vector<int64_t> strides(rank, 1);
  auto dim = [&](int i) { return std::max<int64_t>(shape[i], 1); };
  switch (layout) {
    case Layout::kContiguous:
      for (int i = rank - 2; i >= 0; --i) strides[i] = strides[i + 1] * dim(i + 1);
      break;
    case Layout::kPadded:
      // Odd paddings so that rows do not start on aligned addresses either.
      for (int i = rank - 2; i >= 0; --i) {
        strides[i] = strides[i + 1] * dim(i + 1) + (i == rank - 2 ? 3 : 5);
      }
      break;
    case Layout::kStrided:
      if (rank > 0) strides[rank - 1] = 2;
      for (int i = rank - 2; i >= 0; --i) strides[i] = strides[i + 1] * dim(i + 1) + 1;
      break;
    case Layout::kReversed:
      for (int i = 1; i < rank; ++i) strides[i] = strides[i - 1] * dim(i - 1);
      break;
  }
  return strides;
}

}  // namespace

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kPadded:
      return "padded";
    case Layout::kStrided:
      return "strided";
    case Layout::kReversed:
      return "reversed";
  }
  return "?";
}

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape, Layout layout)
    : dtype_(dtype), shape_(std::move(shape)) {
  strides_ = layout_strides(shape_, layout);
  int64_t elements = 1, extent = 1;
  for (size_t i = 0; i < shape_.size(); ++i) {
    elements *= shape_[i];
    extent += (std::max<int64_t>(shape_[i], 1) - 1) * strides_[i];
  }
  const int size = element_size(dtype_);
  storage_.resize(extent * size);
  in_view_.assign(extent, 0);
  for (int64_t e = 0; e < extent; ++e) write_sentinel(dtype_, &storage_[e * size]);
  for (int64_t flat = 0; flat < elements; ++flat) {
    int64_t rest = flat, off = 0;
    for (int i = static_cast<int>(shape_.size()) - 1; i >= 0; --i) {
      off += (rest % shape_[i]) * strides_[i];
      rest /= shape_[i];
    }
    in_view_[off] = 1;
  }
}

TensorView HostTensor::view() const {
  TensorView t;
  t.data = storage_.data();
  t.dtype = dtype_;
  t.rank = static_cast<int>(shape_.size());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = shape_[i];
    t.strides[i] = strides_[i];
  }
  return t;
}

MutableTensorView HostTensor::mutable_view() {
  MutableTensorView t;
  t.data = storage_.data();
  t.dtype = dtype_;
  t.rank = static_cast<int>(shape_.size());
  for (int i = 0; i < t.rank; ++i) {
    t.shape[i] = shape_[i];
    t.strides[i] = strides_[i];
  }
  return t;
}

int64_t HostTensor::offset(int64_t i0, int64_t i1, int64_t i2) const {
  const int64_t idx[3] = {i0, i1, i2};
  int64_t off = 0;
  for (size_t i = 0; i < shape_.size() && i < 3; ++i) off += idx[i] * strides_[i];
  return off;
}

double HostTensor::get(int64_t i0, int64_t i1, int64_t i2) const {
  return reference::load_element(storage_.data(), dtype_, offset(i0, i1, i2));
}

void HostTensor::set(int64_t i0, int64_t i1, int64_t i2, double value) {
  uint8_t* p = &storage_[offset(i0, i1, i2) * element_size(dtype_)];
  const double r = reference::round_to_dtype(value, dtype_);
  switch (dtype_) {
    case DType::kFloat32: {
      const float f = static_cast<float>(r);
      std::memcpy(p, &f, 4);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t bits = half::double_to_bf16(r);
      std::memcpy(p, &bits, 2);
      break;
    }
    case DType::kFloat16: {
      const uint16_t bits = half::double_to_f16(r);
      std::memcpy(p, &bits, 2);
      break;
    }
    case DType::kInt8: {
      const auto v = static_cast<int8_t>(r);
      std::memcpy(p, &v, 1);
      break;
    }
    case DType::kFloat8E4M3:
      *p = kv8::float_to_e4m3(static_cast<float>(r));
      break;
    case DType::kFloat8E5M2:
      *p = kv8::float_to_e5m2(static_cast<float>(r));
      break;
    case DType::kInt32:
    case DType::kInt64:
      set_raw_int(i0, i1, static_cast<int64_t>(value));
  }
}

void HostTensor::set_raw_int(int64_t i0, int64_t i1, int64_t value) {
  uint8_t* p = &storage_[offset(i0, i1) * element_size(dtype_)];
  if (dtype_ == DType::kInt32) {
    const int32_t v = static_cast<int32_t>(value);
    std::memcpy(p, &v, 4);
  } else if (dtype_ == DType::kInt64) {
    std::memcpy(p, &value, 8);
  } else {
    const float f = static_cast<float>(value);
    std::memcpy(p, &f, 4);
  }
}

void HostTensor::fill_sentinel() {
  const int size = element_size(dtype_);
  for (size_t e = 0; e < in_view_.size(); ++e) {
    if (in_view_[e]) write_sentinel(dtype_, &storage_[e * size]);
  }
}

bool HostTensor::gaps_intact() const {
  const int size = element_size(dtype_);
  uint8_t sentinel[8];
  write_sentinel(dtype_, sentinel);
  for (size_t e = 0; e < in_view_.size(); ++e) {
    if (!in_view_[e] && std::memcmp(&storage_[e * size], sentinel, size) != 0) return false;
  }
  return true;
}

BufferSnapshot& BufferSnapshot::add(std::string name, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  buffers_.push_back({std::move(name), p, std::vector<unsigned char>(p, p + bytes)});
  return *this;
}

BufferSnapshot& BufferSnapshot::add_output(std::string name, void* data, size_t bytes) {
  if (bytes > 0) std::memset(data, 0xFF, bytes);
  return add(std::move(name), data, bytes);
}

::testing::AssertionResult BufferSnapshot::unchanged() const {
  std::ostringstream changed;
  for (const Buffer& b : buffers_) {
    size_t first = b.before.size(), count = 0;
    for (size_t i = 0; i < b.before.size(); ++i) {
      if (b.data[i] == b.before[i]) continue;
      if (count++ == 0) first = i;
    }
    if (count == 0) continue;
    changed << "\n  " << b.name << " (" << b.before.size() << " bytes) changed: " << count
            << " byte(s), the first at byte offset " << first << " (0x" << std::hex << std::setw(2)
            << std::setfill('0') << int{b.before[first]} << " before, 0x" << std::setw(2)
            << int{b.data[first]} << " after)" << std::dec << std::setfill(' ');
  }
  if (changed.str().empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "buffers written by the call:" << changed.str();
}

}  // namespace flashcte::test
