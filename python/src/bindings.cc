// flashcte._flashcte: the nanobind layer between Python and flashcte::attention_cte.
//
// This layer is deliberately thin. Python (flashcte/_attention.py) resolves defaults, allocates
// the outputs in the caller's framework and turns numpy bfloat16 (ml_dtypes) arrays into uint16
// views; here every tensor argument is imported as a DLPack/buffer view with nanobind's ndarray
// (never copied: no implicit conversion is allowed), mapped onto a flashcte::TensorView with the
// same shape and element strides, and the library is called with the GIL released. A failed
// Status becomes TypeError when it is about a dtype and ValueError otherwise, carrying the
// library's "<argument>: <rule>" message unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"

namespace nb = nanobind;

namespace {

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

// DLPack device types whose memory the CPU can read: kDLCPU, kDLCUDAHost (pinned), kDLCUDAManaged
// is not included (it may migrate), kDLROCMHost.
bool cpu_readable(int device_type) {
  return device_type == 1 || device_type == 3 || device_type == 11;
}

std::string dtype_str(nb::dlpack::dtype t) {
  std::string kind;
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int:
      kind = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      kind = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      kind = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      kind = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      kind = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:
      kind = "dlpack-code-" + std::to_string(t.code) + "-";
  }
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
template <typename Array, typename View>
void fill_view(const char* name, const Array& a, bool bf16_bits, View* view) {
  if (!cpu_readable(a.device_type())) {
    throw nb::value_error((std::string(name) +
                           ": must live in CPU memory, got DLPack device type " +
                           std::to_string(a.device_type()))
                              .c_str());
  }
  const auto dtype = to_dtype(a.dtype(), bf16_bits);
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

// Keeps every imported array alive (and so its producer's buffer) until the call returns.
struct Imports {
  std::vector<InArray> inputs;
  std::vector<OutArray> outputs;
  bool bf16_bits = false;

  flashcte::TensorView in(const char* name, nb::handle h) {
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
    fill_view(name, a, bf16_bits, &view);
    view.data = a.data();
    inputs.push_back(std::move(a));
    return view;
  }

  flashcte::MutableTensorView out(const char* name, nb::handle h) {
    flashcte::MutableTensorView view;
    if (h.is_none()) return view;
    OutArray a;
    if (!nb::try_cast<OutArray>(h, a, /*convert=*/false)) {
      throw nb::type_error((std::string(name) +
                            ": expected a writable array (numpy, or a DLPack tensor), got " +
                            nb::type_name(h.type()).c_str())
                               .c_str());
    }
    fill_view(name, a, bf16_bits, &view);
    view.data = a.data();
    outputs.push_back(std::move(a));
    return view;
  }
};

[[noreturn]] void raise_status(const flashcte::Status& s) {
  // Every dtype rule in the library reads "<argument>: dtype ...".
  if (s.message.find(": dtype") != std::string::npos) throw nb::type_error(s.message.c_str());
  throw nb::value_error(s.message.c_str());
}

void attention_cte(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle neg_max,
                   nb::handle sum_recip, nb::handle lse, nb::handle k_prior, nb::handle v_prior,
                   std::vector<int64_t> prior_used_len, nb::handle sink, float scale,
                   bool causal_mask, int64_t sliding_window, bool tp_q, bool tp_k, bool tp_out,
                   bool cache_softmax, std::optional<int64_t> cp_offset,
                   std::optional<int64_t> global_cp_deg, bool cp_strided_q_slicing,
                   nb::handle bound_min, nb::handle bound_max, int num_threads,
                   std::vector<int64_t> tiles, float softcap, nb::handle alibi_slopes,
                   nb::handle key_bias, int64_t window_left, int64_t window_right,
                   bool bottom_right, bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView qv = im.in("q", q);
  const flashcte::TensorView kv = im.in("k", k);
  const flashcte::TensorView vv = im.in("v", v);
  flashcte::Outputs outputs;
  outputs.out = im.out("out", out);
  outputs.neg_max = im.out("neg_max", neg_max);
  outputs.sum_recip = im.out("sum_recip", sum_recip);
  outputs.lse = im.out("lse", lse);

  flashcte::Options o;
  o.scale = scale;
  o.causal_mask = causal_mask;
  o.k_prior = im.in("k_prior", k_prior);
  o.v_prior = im.in("v_prior", v_prior);
  o.prior_used_len = std::move(prior_used_len);
  o.sink = im.in("sink", sink);
  o.sliding_window = sliding_window;
  o.tp_q = tp_q;
  o.tp_k = tp_k;
  o.tp_out = tp_out;
  o.cache_softmax = cache_softmax;
  o.cp_offset = cp_offset;
  o.global_cp_deg = global_cp_deg;
  o.cp_strided_q_slicing = cp_strided_q_slicing;
  o.bound_min = im.in("bound_min", bound_min);
  o.bound_max = im.in("bound_max", bound_max);
  o.num_threads = num_threads;
  if (!tiles.empty()) {
    if (tiles.size() != 4) {
      throw nb::value_error("tiles: must hold (q_block, kv_tile, section, section_threshold)");
    }
    o.tiles = {tiles[0], tiles[1], tiles[2], tiles[3]};
  }
  o.softcap = softcap;
  o.alibi_slopes = im.in("alibi_slopes", alibi_slopes);
  o.key_bias = im.in("key_bias", key_bias);
  o.window_left = window_left;
  o.window_right = window_right;
  o.bottom_right = bottom_right;

  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::attention_cte(qv, kv, vv, outputs, o);
  }
  if (!status.ok) raise_status(status);
}

}  // namespace

NB_MODULE(_flashcte, m) {
  m.doc() =
      "Native layer of flashcte. Use the functions of the `flashcte` package; this module's "
      "signature is private and may change.";
  m.def("attention_cte", &attention_cte, nb::kw_only(), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("neg_max").none(), nb::arg("sum_recip").none(),
        nb::arg("lse").none(), nb::arg("k_prior").none(), nb::arg("v_prior").none(),
        nb::arg("prior_used_len"), nb::arg("sink").none(), nb::arg("scale"), nb::arg("causal_mask"),
        nb::arg("sliding_window"), nb::arg("tp_q"), nb::arg("tp_k"), nb::arg("tp_out"),
        nb::arg("cache_softmax"), nb::arg("cp_offset").none(), nb::arg("global_cp_deg").none(),
        nb::arg("cp_strided_q_slicing"), nb::arg("bound_min").none(), nb::arg("bound_max").none(),
        nb::arg("num_threads"), nb::arg("tiles"), nb::arg("softcap"),
        nb::arg("alibi_slopes").none(), nb::arg("key_bias").none(), nb::arg("window_left"),
        nb::arg("window_right"), nb::arg("bottom_right"), nb::arg("bf16_bits"),
        "attention_cte into caller-allocated outputs (all tensors as numpy arrays or DLPack "
        "tensors, read in place). Raises TypeError/ValueError with the library's message.");
  m.def("simd_target", &flashcte::simd_target,
        "The SIMD target the library dispatched to on this machine, e.g. 'AVX3_ZEN4'.");
}
