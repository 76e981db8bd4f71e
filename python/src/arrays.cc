// Tensor arguments and errors for every binding (arrays.h).
#include "python/src/arrays.h"

#include <cstddef>
#include <cstdint>
#include <string>

namespace flashcte::python {
namespace {

// DLPack device types whose memory the CPU can read: kDLCPU, kDLCUDAHost (pinned), kDLCUDAManaged
// is not included (it may migrate), kDLROCMHost.
bool cpu_readable(int device_type) {
  return device_type == 1 || device_type == 3 || device_type == 11;
}

std::string dtype_str(nb::dlpack::dtype t) {
  // An if-chain, not a switch: nanobind's dtype_code grows with DLPack (the float8 codes), and a
  // switch would have to name every code of whichever nanobind builds this (-Wswitch-enum).
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (code == Code::Bool) return "bool";
  std::string kind = "dlpack-code-" + std::to_string(t.code) + "-";
  if (code == Code::Int) kind = "int";
  if (code == Code::UInt) kind = "uint";
  if (code == Code::Float) kind = "float";
  if (code == Code::Bfloat) kind = "bfloat";
  if (code == Code::Complex) kind = "complex";
  std::string s = kind + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

// Maps a DLPack dtype onto the library's. uint16 stands for bfloat16 bits only when the Python
// layer says so (numpy has no bfloat16 of its own; ml_dtypes arrays reach us as uint16 views).
std::optional<flashcte::DType> to_dtype(nb::dlpack::dtype t, bool bf16_bits) {
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (code == nb::dlpack::dtype_code::Float && t.bits == 32) return flashcte::DType::kFloat32;
  if (code == nb::dlpack::dtype_code::Float && t.bits == 16) return flashcte::DType::kFloat16;
  if (code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) return flashcte::DType::kBFloat16;
  if (code == nb::dlpack::dtype_code::UInt && t.bits == 16 && bf16_bits) {
    return flashcte::DType::kBFloat16;
  }
  if (code == nb::dlpack::dtype_code::Int && t.bits == 32) return flashcte::DType::kInt32;
  if (code == nb::dlpack::dtype_code::Int && t.bits == 64) return flashcte::DType::kInt64;
  return std::nullopt;
}

std::string shape_str(size_t ndim, const int64_t* shape) {
  std::string s = "(";
  for (size_t i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (ndim == 1) s += ",";
  return s + ")";
}

// Fills the rank/shape/strides/dtype of a view from an imported array; raises on what the
// library's views cannot express.
// With `kv8` set, an int8 or uint8 array holds the codes of that 8-bit cache format (numpy has
// no float8 of its own, and DLPack producers differ on float8, so Python passes the bytes).
template <typename Array, typename View>
void fill_view(const char* name, const Array& a, bool bf16_bits, View* view,
               std::optional<flashcte::DType> kv8 = std::nullopt) {
  if (!cpu_readable(a.device_type())) {
    throw nb::value_error((std::string(name) +
                           ": must live in CPU memory, got DLPack device type " +
                           std::to_string(a.device_type()))
                              .c_str());
  }
  const auto code = static_cast<nb::dlpack::dtype_code>(a.dtype().code);
  const bool bytes = a.dtype().bits == 8 && a.dtype().lanes == 1 &&
                     (code == nb::dlpack::dtype_code::Int || code == nb::dlpack::dtype_code::UInt);
  if (kv8 && !bytes) {
    throw nb::type_error((std::string(name) + ": expected the 8-bit cache's bytes as int8 or " +
                          "uint8, got " + dtype_str(a.dtype()))
                             .c_str());
  }
  const auto dtype = kv8 ? kv8 : to_dtype(a.dtype(), bf16_bits);
  if (!dtype) {
    throw nb::type_error((std::string(name) + ": dtype " + dtype_str(a.dtype()) +
                          " is not supported (attention inputs are float32, float16 or bfloat16)")
                             .c_str());
  }
  if (a.ndim() > static_cast<size_t>(flashcte::kMaxRank)) {
    throw nb::value_error((std::string(name) + ": rank must be at most " +
                           std::to_string(flashcte::kMaxRank) + ", got rank " +
                           std::to_string(a.ndim()) + " with shape " +
                           shape_str(a.ndim(), a.shape_ptr()))
                              .c_str());
  }
  view->dtype = *dtype;
  view->rank = static_cast<int>(a.ndim());
  bool empty = false;
  for (size_t i = 0; i < a.ndim(); ++i) {
    view->shape[i] = static_cast<int64_t>(a.shape(i));
    view->strides[i] = a.stride(i);
    empty = empty || a.shape(i) == 0;
  }
  if (empty) {
    // Producers give empty arrays arbitrary strides (numpy: 0 on the leading axes), which the
    // library's overlap rule for outputs would reject; no element is addressed, so use
    // row-major strides.
    int64_t stride = 1;
    for (int i = view->rank - 1; i >= 0; --i) {
      view->strides[i] = stride;
      stride *= std::max<int64_t>(view->shape[i], 1);
    }
  }
}

}  // namespace

std::optional<flashcte::DType> kv8_format(const char* name, const std::string& format) {
  if (format.empty()) return std::nullopt;
  if (format == "int8") return flashcte::DType::kInt8;
  if (format == "float8_e4m3fn") return flashcte::DType::kFloat8E4M3;
  if (format == "float8_e5m2") return flashcte::DType::kFloat8E5M2;
  throw nb::type_error(
      (std::string(name) + ": dtype must be int8, float8_e4m3fn or float8_e5m2, got " + format)
          .c_str());
}

flashcte::TensorView Imports::in(const char* name, nb::handle h,
                                 std::optional<flashcte::DType> kv8) {
  flashcte::TensorView view;
  if (h.is_none()) return view;
  InArray a;
  if (!nb::try_cast<InArray>(h, a, /*convert=*/false)) {
    throw nb::type_error((std::string(name) +
                          ": expected an array (numpy, or a DLPack tensor such as torch's), "
                          "got " +
                          nb::type_name(h.type()).c_str())
                             .c_str());
  }
  fill_view(name, a, bf16_bits, &view, kv8);
  view.data = a.data();
  inputs.push_back(std::move(a));
  return view;
}

flashcte::MutableTensorView Imports::out(const char* name, nb::handle h,
                                         std::optional<flashcte::DType> kv8) {
  flashcte::MutableTensorView view;
  if (h.is_none()) return view;
  OutArray a;
  if (!nb::try_cast<OutArray>(h, a, /*convert=*/false)) {
    throw nb::type_error((std::string(name) +
                          ": expected a writable array (numpy, or a DLPack tensor), got " +
                          nb::type_name(h.type()).c_str())
                             .c_str());
  }
  fill_view(name, a, bf16_bits, &view, kv8);
  view.data = a.data();
  outputs.push_back(std::move(a));
  return view;
}

flashcte::MutableTensorView Imports::cache(const char* name, nb::handle h,
                                           std::optional<flashcte::DType> kv8) {
  if (appending) return out(name, h, kv8);
  const flashcte::TensorView view = in(name, h, kv8);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): never written without an append
  return flashcte::MutableTensorView{const_cast<void*>(view.data), view.dtype, view.rank,
                                     view.shape, view.strides};
}

namespace {

PyObject* argument_error = nullptr;       // flashcte.ArgumentError
PyObject* argument_type_error = nullptr;  // flashcte.ArgumentTypeError

// A new exception class `name` with the builtin bases given, owned by the module from then on.
PyObject* new_error_class(nb::module_& m, const char* name, const char* doc, PyObject* base) {
  const std::string qualified = std::string("flashcte.") + name;
  nb::object bases = nb::make_tuple(nb::handle(base), nb::handle(PyExc_RuntimeError));
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (cls == nullptr) throw nb::python_error();
  m.attr(name) = nb::steal(cls);
  return cls;
}

}  // namespace

void add_error_classes(nb::module_& m) {
  argument_error = new_error_class(
      m, "ArgumentError",
      "An argument's value or shape breaks a rule of the call; the message is "
      "\"<argument>: <rule>\". A ValueError, and a RuntimeError as PyTorch's and FlashAttention's "
      "argument checks raise.",
      PyExc_ValueError);
  argument_type_error = new_error_class(
      m, "ArgumentTypeError",
      "An argument's dtype or type is not one the call takes; the message is "
      "\"<argument>: <rule>\". A TypeError, and a RuntimeError as PyTorch's and FlashAttention's "
      "argument checks raise.",
      PyExc_TypeError);
}

[[noreturn]] void raise_status(const flashcte::Status& s) {
  switch (s.kind) {
    case flashcte::ErrorKind::kDtype:
      PyErr_SetString(argument_type_error, s.message.c_str());
      throw nb::python_error();
    case flashcte::ErrorKind::kMemory:
      PyErr_SetString(PyExc_MemoryError, s.message.c_str());
      throw nb::python_error();
    case flashcte::ErrorKind::kInternal:
      PyErr_SetString(PyExc_RuntimeError, s.message.c_str());
      throw nb::python_error();
    case flashcte::ErrorKind::kNone:
    case flashcte::ErrorKind::kValue:
      break;
  }
  PyErr_SetString(argument_error, s.message.c_str());
  throw nb::python_error();
}

}  // namespace flashcte::python
