// flashcte._flashcte: the nanobind layer between Python and flashcte::attention_cte, and
// flashcte::AttentionLayer with its KvCache (flashcte/_layer.py wraps those).
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
#include <iterator>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/kvcache.h"
#include "flashcte/layer.h"
#include "flashcte/merge.h"

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

// The 8-bit cache formats by the names Python gives them; "" for an argument that is not one.
std::optional<flashcte::DType> kv8_format(const char* name, const std::string& format) {
  if (format.empty()) return std::nullopt;
  if (format == "int8") return flashcte::DType::kInt8;
  if (format == "float8_e4m3fn") return flashcte::DType::kFloat8E4M3;
  if (format == "float8_e5m2") return flashcte::DType::kFloat8E5M2;
  throw nb::type_error(
      (std::string(name) + ": dtype must be int8, float8_e4m3fn or float8_e5m2, got " + format)
          .c_str());
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

// Keeps every imported array alive (and so its producer's buffer) until the call returns.
struct Imports {
  std::vector<InArray> inputs;
  std::vector<OutArray> outputs;
  bool bf16_bits = false;

  flashcte::TensorView in(const char* name, nb::handle h,
                          std::optional<flashcte::DType> kv8 = std::nullopt) {
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

  flashcte::MutableTensorView out(const char* name, nb::handle h,
                                  std::optional<flashcte::DType> kv8 = std::nullopt) {
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

  // A KV cache or its 8-bit scales: written when the call appends k and v (`appending`), and
  // otherwise only read, so then a read-only array (flash_attn_func's k and v) is taken too.
  bool appending = false;
  flashcte::MutableTensorView cache(const char* name, nb::handle h,
                                    std::optional<flashcte::DType> kv8 = std::nullopt) {
    if (appending) return out(name, h, kv8);
    const flashcte::TensorView view = in(name, h, kv8);
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): never written without an append
    return flashcte::MutableTensorView{const_cast<void*>(view.data), view.dtype, view.rank,
                                       view.shape, view.strides};
  }
};

[[noreturn]] void raise_status(const flashcte::Status& s) {
  switch (s.kind) {
    case flashcte::ErrorKind::kDtype:
      throw nb::type_error(s.message.c_str());
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
  throw nb::value_error(s.message.c_str());
}

// ---- options by name -------------------------------------------------------------------------

// How one Python keyword lands in an options struct (flashcte::Options, KvCacheOptions). The
// tables below are the only place an option is named on this side: a new field is one line in
// its table and one keyword in Python.
template <class O>
using Setter = void (*)(Imports&, O&, nb::handle);
template <class O>
using OptionTable = std::pair<const char*, Setter<O>>;

// A tensor option (None: absent), and a value option (None: the struct's default).
#define FLASHCTE_TENSOR_OPTION(O, field)                                          \
  OptionTable<O> {                                                                \
#field, [](Imports & im, O & o, nb::handle h) { o.field = im.in(#field, h); } \
  }
// A cache's tensor: written when the call appends (Imports::cache).
#define FLASHCTE_CACHE_OPTION(O, field)                                              \
  OptionTable<O> {                                                                   \
#field, [](Imports & im, O & o, nb::handle h) { o.field = im.cache(#field, h); } \
  }
#define FLASHCTE_VALUE_OPTION(O, field, type)           \
  OptionTable<O> {                                      \
#field, [](Imports&, O& o, nb::handle h) {            \
      if (!h.is_none()) o.field = nb::cast<type>(h);      \
    } \
  }

// Sets every keyword of `options` in `o` through `table`; an unknown keyword is a TypeError.
template <class O, size_t N>
void set_options(Imports& im, O& o, const nb::kwargs& options, const OptionTable<O> (&table)[N],
                 const char* call) {
  for (auto [key, value] : options) {
    const std::string name = nb::cast<std::string>(key);
    const auto* entry = std::find_if(std::begin(table), std::end(table),
                                     [&](const OptionTable<O>& e) { return name == e.first; });
    if (entry == std::end(table)) {
      throw nb::type_error((std::string(call) + ": unknown option " + name).c_str());
    }
    entry->second(im, o, value);
  }
}

const OptionTable<flashcte::Options> kAttentionOptions[] = {
    FLASHCTE_TENSOR_OPTION(flashcte::Options, k_prior),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, v_prior),
    FLASHCTE_VALUE_OPTION(flashcte::Options, prior_used_len, std::vector<int64_t>),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, prior_block_table),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, k_prior_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, v_prior_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, sink),
    FLASHCTE_VALUE_OPTION(flashcte::Options, scale, float),
    FLASHCTE_VALUE_OPTION(flashcte::Options, causal_mask, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, sliding_window, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, tp_q, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, tp_k, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, tp_out, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, cache_softmax, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, cp_offset, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, global_cp_deg, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, cp_strided_q_slicing, bool),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, bound_min),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, bound_max),
    FLASHCTE_VALUE_OPTION(flashcte::Options, num_threads, int),
    // (q_block, kv_tile, section, section_threshold), or empty for the kernel's choice.
    OptionTable<flashcte::Options>{"tiles",
                                   [](Imports&, flashcte::Options& o, nb::handle h) {
                                     const auto t = nb::cast<std::vector<int64_t>>(h);
                                     if (t.empty()) return;
                                     if (t.size() != 4) {
                                       throw nb::value_error(
                                           "tiles: must hold (q_block, kv_tile, section, "
                                           "section_threshold)");
                                     }
                                     o.tiles = {t[0], t[1], t[2], t[3]};
                                   }},
    FLASHCTE_VALUE_OPTION(flashcte::Options, softcap, float),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, alibi_slopes),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, key_bias),
    FLASHCTE_VALUE_OPTION(flashcte::Options, window_left, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, window_right, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, bottom_right, bool),
};

const OptionTable<flashcte::KvCacheOptions> kKvCacheOptions[] = {
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, k),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, v),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, rotary_cos),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, rotary_sin),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, rotary_interleaved, bool),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, cache_seqlens),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, cache_batch_idx),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, cache_leftpad),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, block_table),
    FLASHCTE_CACHE_OPTION(flashcte::KvCacheOptions, k_scale),
    FLASHCTE_CACHE_OPTION(flashcte::KvCacheOptions, v_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, alibi_slopes),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, sinks),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, softmax_scale, float),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, causal, bool),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, window_left, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, window_right, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, softcap, float),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, num_threads, int),
};
const OptionTable<flashcte::VarlenKvCacheOptions> kVarlenKvCacheOptions[] = {
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, cu_seqlens_q),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, seqused_k),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, block_table),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, k_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, v_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, alibi_slopes),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, sinks),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, softmax_scale, float),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, causal, bool),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, window_left, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, window_right, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, softcap, float),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, num_threads, int),
};
#undef FLASHCTE_TENSOR_OPTION
#undef FLASHCTE_CACHE_OPTION
#undef FLASHCTE_VALUE_OPTION

// attention_cte into caller-allocated outputs; every other argument by keyword, as Options names
// it.
void attention_cte(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle neg_max,
                   nb::handle sum_recip, nb::handle lse, bool bf16_bits,
                   const nb::kwargs& options) {
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
  set_options(im, o, options, kAttentionOptions, "attention_cte");
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::attention_cte(qv, kv, vv, outputs, o);
  }
  if (!status.ok) raise_status(status);
}

// flash_attn_with_kvcache (flashcte/kvcache.h) into caller-allocated outputs, the caches written
// in place; every other argument by keyword, as KvCacheOptions names it.
void flash_attn_with_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                             nb::handle lse, bool bf16_bits, const std::string& k_cache_format,
                             const std::string& v_cache_format, const nb::kwargs& options) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView qv = im.in("q", q);
  im.appending = options.contains("k") && !options["k"].is_none();
  const flashcte::MutableTensorView kc =
      im.cache("k_cache", k_cache, kv8_format("k_cache", k_cache_format));
  const flashcte::MutableTensorView vc =
      im.cache("v_cache", v_cache, kv8_format("v_cache", v_cache_format));
  const flashcte::MutableTensorView ov = im.out("out", out), lv = im.out("lse", lse);
  flashcte::KvCacheOptions o;
  set_options(im, o, options, kKvCacheOptions, "flash_attn_with_kvcache");
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::flash_attn_with_kvcache(qv, kc, vc, ov, lv, o);
  }
  if (!status.ok) raise_status(status);
}

// flash_attn_varlen_kvcache (flashcte/kvcache.h) into caller-allocated outputs, the caches only
// read; every other argument by keyword, as VarlenKvCacheOptions names it.
void flash_attn_varlen_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                               nb::handle lse, bool bf16_bits, const std::string& k_cache_format,
                               const std::string& v_cache_format, const nb::kwargs& options) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView qv = im.in("q", q);
  const flashcte::TensorView kc = im.in("k_cache", k_cache, kv8_format("k_cache", k_cache_format));
  const flashcte::TensorView vc = im.in("v_cache", v_cache, kv8_format("v_cache", v_cache_format));
  const flashcte::MutableTensorView ov = im.out("out", out), lv = im.out("lse", lse);
  flashcte::VarlenKvCacheOptions o;
  set_options(im, o, options, kVarlenKvCacheOptions, "flash_attn_varlen_kvcache");
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::flash_attn_varlen_kvcache(qv, kc, vc, ov, lv, o);
  }
  if (!status.ok) raise_status(status);
}

// quantize_kv (flashcte/kvcache.h). dst arrives as its bytes (an int8 or uint8 array: numpy has
// no float8 of its own, and DLPack producers differ on float8) with its format by name.
void quantize_kv(nb::handle src, nb::handle dst, nb::handle scale, const std::string& format,
                 bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView sv = im.in("src", src);
  const flashcte::MutableTensorView scv = im.out("scale", scale);
  const flashcte::MutableTensorView dv = im.out("dst", dst, kv8_format("dst", format));
  if (dv.rank != 3) {
    throw nb::value_error(
        ("dst: must have rank 3 (tokens, kv_heads, d), got rank " + std::to_string(dv.rank))
            .c_str());
  }
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::quantize_kv(sv, dv, scv);
  }
  if (!status.ok) raise_status(status);
}

// merge_attn_states (flashcte/merge.h) into caller-allocated outputs; lse may be None.
void merge_attn_states(nb::handle out_a, nb::handle lse_a, nb::handle out_b, nb::handle lse_b,
                       nb::handle out, nb::handle lse, bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView oa = im.in("out_a", out_a), la = im.in("lse_a", lse_a);
  const flashcte::TensorView ob = im.in("out_b", out_b), lb = im.in("lse_b", lse_b);
  const flashcte::MutableTensorView o = im.out("out", out), l = im.out("lse", lse);
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::merge_attn_states(oa, la, ob, lb, o, l);
  }
  if (!status.ok) raise_status(status);
}

// ---- The attention layer (flashcte/layer.h). Python (flashcte/_layer.py) checks shapes and
// converts the weights to float32 C-contiguous arrays; here they are copied into LayerWeights and
// AttentionLayer::create checks them against the config. A layer is held by a shared_ptr so that
// set_weights (a new layer) while another thread's forward runs cannot free the running one.

struct PyLayer {
  std::shared_ptr<const flashcte::AttentionLayer> layer;
};

// A KvCache is mutated by forward while the GIL is released: `busy` (read and written only with
// the GIL held) refuses a second forward, or a reset, on the same cache meanwhile.
struct PyKvCache {
  flashcte::KvCache cache;
  bool busy = false;
};

flashcte::DType activation_dtype(const std::string& name) {
  for (flashcte::DType t :
       {flashcte::DType::kFloat32, flashcte::DType::kBFloat16, flashcte::DType::kFloat16}) {
    if (name == flashcte::dtype_name(t)) return t;
  }
  throw nb::type_error(("dtype: must be float32, bfloat16 or float16, got " + name).c_str());
}

// One weight as the float32 values LayerWeights holds; None is an empty (absent) weight.
std::vector<float> weight_values(const char* name, nb::handle h) {
  if (h.is_none()) return {};
  nb::ndarray<const float, nb::c_contig, nb::device::cpu> a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    throw nb::type_error(
        (std::string(name) + ": expected a C-contiguous float32 CPU array").c_str());
  }
  const float* data = a.data();
  return std::vector<float>(data, data + a.size());
}

// Config errors only: AttentionLayer::create checks the config before the weights, so with no
// weights a complaint about q_proj means the config itself passed.
void layer_check_config(const flashcte::LayerConfig& config) {
  std::unique_ptr<flashcte::AttentionLayer> layer;
  const flashcte::Status s =
      flashcte::AttentionLayer::create(config, flashcte::LayerWeights{}, &layer);
  if (!s.ok && s.message.rfind("q_proj:", 0) != 0) raise_status(s);
}

flashcte::LayerConfig layer_rank_config(const flashcte::LayerConfig& config) {
  flashcte::LayerConfig rank;
  const flashcte::Status s = flashcte::rank_config(config, &rank);
  if (!s.ok) raise_status(s);
  return rank;
}

// LayerConfig::GqaStrategy by ON's enum values ("auto": ON's own choice).
const char* const kGqaStrategies[] = {"auto", "replicate-to-tp-degree", "convert-to-mha"};

flashcte::LayerConfig::GqaStrategy gqa_strategy(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kGqaStrategies[i]) return static_cast<flashcte::LayerConfig::GqaStrategy>(i);
  }
  const std::string message =
      "gqa_strategy: must be 'auto', 'replicate-to-tp-degree' or 'convert-to-mha', got '" + name +
      "'";
  throw nb::value_error(message.c_str());
}

void layer_init(PyLayer* self, const flashcte::LayerConfig& config, nb::handle q_proj,
                nb::handle k_proj, nb::handle v_proj, nb::handle o_proj, nb::handle q_bias,
                nb::handle k_bias, nb::handle v_bias, nb::handle o_bias, nb::handle q_norm,
                nb::handle k_norm, nb::handle sinks) {
  flashcte::LayerWeights w;
  w.q_proj = weight_values("q_proj", q_proj);
  w.k_proj = weight_values("k_proj", k_proj);
  w.v_proj = weight_values("v_proj", v_proj);
  w.o_proj = weight_values("o_proj", o_proj);
  w.q_bias = weight_values("q_bias", q_bias);
  w.k_bias = weight_values("k_bias", k_bias);
  w.v_bias = weight_values("v_bias", v_bias);
  w.o_bias = weight_values("o_bias", o_bias);
  w.q_norm = weight_values("q_norm", q_norm);
  w.k_norm = weight_values("k_norm", k_norm);
  w.sinks = weight_values("sinks", sinks);
  std::unique_ptr<flashcte::AttentionLayer> layer;
  flashcte::Status status;
  {
    nb::gil_scoped_release release;  // rounding and relayout of the weights: large for real models
    status = flashcte::AttentionLayer::create(config, w, &layer);
  }
  if (!status.ok) raise_status(status);
  new (self) PyLayer{std::shared_ptr<const flashcte::AttentionLayer>(std::move(layer))};
}

void layer_forward(const PyLayer& self, nb::handle x, nb::handle positions, PyKvCache& cache,
                   nb::handle out, int num_threads, bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView xv = im.in("x", x);
  const flashcte::TensorView pv = im.in("positions", positions);
  const flashcte::MutableTensorView ov = im.out("out", out);
  if (cache.busy) {
    throw std::runtime_error("cache: another forward call is using this cache right now");
  }
  const std::shared_ptr<const flashcte::AttentionLayer> layer = self.layer;
  flashcte::Status status;
  {
    // Cleared when the scope ends, with the GIL held again (`busy` outlives `release`).
    struct Busy {
      bool& flag;
      ~Busy() { flag = false; }
    };
    cache.busy = true;
    const Busy busy{cache.busy};
    nb::gil_scoped_release release;
    status = layer->forward(xv, pv, &cache.cache, ov, num_threads);
  }
  if (!status.ok) raise_status(status);
}

// A KV cache's dtype: an activation dtype, or an 8-bit format (LayerConfig::kv_cache_dtype).
flashcte::DType cache_dtype(const std::string& name) {
  for (flashcte::DType t :
       {flashcte::DType::kInt8, flashcte::DType::kFloat8E4M3, flashcte::DType::kFloat8E5M2}) {
    if (name == flashcte::dtype_name(t)) return t;
  }
  return activation_dtype(name);
}

void cache_init(PyKvCache* self, int64_t batch, int64_t kv_heads, int64_t max_len, int64_t head_dim,
                const std::string& dtype) {
  flashcte::KvCache cache;
  const flashcte::Status status =
      flashcte::KvCache::create(batch, kv_heads, max_len, head_dim, cache_dtype(dtype), &cache);
  if (!status.ok) raise_status(status);
  new (self) PyKvCache{std::move(cache), false};
}

void paged_cache_init(PyKvCache* self, int64_t batch, int64_t num_blocks, int64_t block_size,
                      int64_t kv_heads, int64_t head_dim, const std::string& dtype) {
  flashcte::KvCache cache;
  const flashcte::Status status = flashcte::KvCache::create_paged(
      batch, num_blocks, block_size, kv_heads, head_dim, cache_dtype(dtype), &cache);
  if (!status.ok) raise_status(status);
  new (self) PyKvCache{std::move(cache), false};
}

void cache_assign(PyKvCache& self, int64_t b, const std::vector<int32_t>& pages, int64_t length) {
  if (self.busy) {
    throw std::runtime_error("cache: another forward call is using this cache right now");
  }
  const flashcte::Status status = self.cache.assign(b, pages, length);
  if (!status.ok) raise_status(status);
}

void cache_reset(PyKvCache& self, int64_t b) {
  if (b < 0 || b >= self.cache.batch()) {
    throw nb::value_error(("b: must be in [0, batch = " + std::to_string(self.cache.batch()) +
                           "), got " + std::to_string(b))
                              .c_str());
  }
  if (self.busy) {
    throw std::runtime_error("cache: another forward call is using this cache right now");
  }
  self.cache.reset(b);
}

// A read-only numpy view of the cache's K or V storage, (batch, kv_heads, max_len, head_dim),
// keeping the cache alive; bfloat16 comes as its uint16 bits and fp8 as uint8 codes (Python
// views them as ml_dtypes'). `scales`: an 8-bit cache's scales, the shape without head_dim.
nb::ndarray<nb::numpy, nb::ro> cache_storage(nb::handle self_handle, bool values, bool scales) {
  PyKvCache& self = nb::cast<PyKvCache&>(self_handle);
  const flashcte::KvCache& c = self.cache;
  // Dense (batch, kv_heads, max_len, head_dim); paged (num_blocks, kv_heads, block_size,
  // head_dim).
  const size_t shape[4] = {static_cast<size_t>(c.paged() ? c.num_blocks() : c.batch()),
                           static_cast<size_t>(c.kv_heads()),
                           static_cast<size_t>(c.paged() ? c.block_size() : c.max_len()),
                           static_cast<size_t>(c.head_dim())};
  if (scales) {
    if (c.k_scale_data() == nullptr) {
      throw nb::value_error(("cache: a " + std::string(flashcte::dtype_name(c.dtype())) +
                             " cache has no scales (an 8-bit one has)")
                                .c_str());
    }
    return nb::ndarray<nb::numpy, nb::ro>(values ? c.v_scale_data() : c.k_scale_data(), 3, shape,
                                          self_handle, nullptr, nb::dtype<float>());
  }
  nb::dlpack::dtype dtype = nb::dtype<float>();
  switch (c.dtype()) {
    case flashcte::DType::kBFloat16:
      dtype = nb::dtype<uint16_t>();
      break;
    case flashcte::DType::kFloat16:
      dtype = {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
      break;
    case flashcte::DType::kInt8:
      dtype = nb::dtype<int8_t>();
      break;
    case flashcte::DType::kFloat8E4M3:
    case flashcte::DType::kFloat8E5M2:
      dtype = nb::dtype<uint8_t>();
      break;
    case flashcte::DType::kFloat32:
    case flashcte::DType::kInt32:
    case flashcte::DType::kInt64:
      break;
  }
  return nb::ndarray<nb::numpy, nb::ro>(values ? c.v_data() : c.k_data(), 4, shape, self_handle,
                                        nullptr, dtype);
}

void bind_layer(nb::module_& m) {
  nb::class_<flashcte::Llama3RopeScaling>(m, "Llama3RopeScaling")
      .def(nb::init<>())
      .def_rw("factor", &flashcte::Llama3RopeScaling::factor)
      .def_rw("low_freq_factor", &flashcte::Llama3RopeScaling::low_freq_factor)
      .def_rw("high_freq_factor", &flashcte::Llama3RopeScaling::high_freq_factor)
      .def_rw("original_max_position_embeddings",
              &flashcte::Llama3RopeScaling::original_max_position_embeddings);

  using flashcte::LayerConfig;
  nb::class_<LayerConfig>(m, "LayerConfig",
                          "flashcte::LayerConfig (flashcte/layer.h), field by field.")
      .def(nb::init<>())
      .def_rw("hidden_size", &LayerConfig::hidden_size)
      .def_rw("num_heads", &LayerConfig::num_heads)
      .def_rw("num_kv_heads", &LayerConfig::num_kv_heads)
      .def_rw("head_dim", &LayerConfig::head_dim)
      .def_rw("rope", &LayerConfig::rope)
      .def_rw("rope_theta", &LayerConfig::rope_theta)
      .def_rw("rotary_dim", &LayerConfig::rotary_dim)
      .def_rw("rope_scaling", &LayerConfig::rope_scaling)
      .def_rw("sliding_window", &LayerConfig::sliding_window)
      .def_rw("qk_scale", &LayerConfig::qk_scale)
      .def_rw("qkv_bias", &LayerConfig::qkv_bias)
      .def_rw("o_bias", &LayerConfig::o_bias)
      .def_rw("qk_norm", &LayerConfig::qk_norm)
      .def_rw("qk_norm_eps", &LayerConfig::qk_norm_eps)
      .def_rw("sinks", &LayerConfig::sinks)
      .def_prop_rw(
          "dtype", [](const LayerConfig& c) { return std::string(flashcte::dtype_name(c.dtype)); },
          [](LayerConfig& c, const std::string& name) { c.dtype = activation_dtype(name); })
      .def_prop_rw(
          "kv_cache_dtype",
          [](const LayerConfig& c) -> std::optional<std::string> {
            if (!c.kv_cache_dtype) return std::nullopt;
            return std::string(flashcte::dtype_name(*c.kv_cache_dtype));
          },
          [](LayerConfig& c, const std::optional<std::string>& name) {
            c.kv_cache_dtype.reset();
            if (name) c.kv_cache_dtype = cache_dtype(*name);
          },
          nb::arg("name").none())
      .def_rw("tp_degree", &LayerConfig::tp_degree)
      .def_rw("tp_rank", &LayerConfig::tp_rank)
      .def_prop_rw(
          "gqa_strategy",
          [](const LayerConfig& c) {
            return std::string(kGqaStrategies[static_cast<int>(c.gqa_strategy)]);
          },
          [](LayerConfig& c, const std::string& name) { c.gqa_strategy = gqa_strategy(name); });

  m.def("layer_check_config", &layer_check_config, nb::arg("config"),
        "Raises ValueError/TypeError with the library's message when the config is invalid.");
  m.def("layer_rank_config", &layer_rank_config, nb::arg("config"),
        "flashcte::rank_config: the config a tensor-parallel rank runs (its heads, no o_bias).");

  nb::class_<PyLayer>(m, "Layer", "flashcte::AttentionLayer with its weights.")
      .def("__init__", &layer_init, nb::arg("config"), nb::arg("q_proj"), nb::arg("k_proj"),
           nb::arg("v_proj"), nb::arg("o_proj"), nb::arg("q_bias").none(), nb::arg("k_bias").none(),
           nb::arg("v_bias").none(), nb::arg("o_bias").none(), nb::arg("q_norm").none(),
           nb::arg("k_norm").none(), nb::arg("sinks").none(),
           "AttentionLayer::create from float32 C-contiguous weights (None: absent).")
      .def_prop_ro("head_dim", [](const PyLayer& l) { return l.layer->head_dim(); })
      .def("forward", &layer_forward, nb::kw_only(), nb::arg("x"), nb::arg("positions"),
           nb::arg("cache"), nb::arg("out"), nb::arg("num_threads"), nb::arg("bf16_bits"),
           "AttentionLayer::forward into a caller-allocated out, the GIL released.");

  nb::class_<PyKvCache>(m, "KvCache", "flashcte::KvCache.")
      .def("__init__", &cache_init, nb::arg("batch"), nb::arg("kv_heads"), nb::arg("max_len"),
           nb::arg("head_dim"), nb::arg("dtype"))
      .def("__init__", &paged_cache_init, nb::kw_only(), nb::arg("batch"), nb::arg("num_blocks"),
           nb::arg("block_size"), nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("dtype"),
           "KvCache::create_paged: a block pool.")
      .def_prop_ro("batch", [](const PyKvCache& c) { return c.cache.batch(); })
      .def_prop_ro("kv_heads", [](const PyKvCache& c) { return c.cache.kv_heads(); })
      .def_prop_ro("max_len", [](const PyKvCache& c) { return c.cache.max_len(); })
      .def_prop_ro("head_dim", [](const PyKvCache& c) { return c.cache.head_dim(); })
      .def_prop_ro(
          "dtype",
          [](const PyKvCache& c) { return std::string(flashcte::dtype_name(c.cache.dtype())); })
      .def_prop_ro("lengths", [](const PyKvCache& c) { return c.cache.lengths(); })
      .def_prop_ro("paged", [](const PyKvCache& c) { return c.cache.paged(); })
      .def_prop_ro("num_blocks", [](const PyKvCache& c) { return c.cache.num_blocks(); })
      .def_prop_ro("block_size", [](const PyKvCache& c) { return c.cache.block_size(); })
      .def(
          "pages",
          [](const PyKvCache& c, int64_t b) {
            if (b < 0 || b >= c.cache.batch()) throw nb::value_error("b: out of range");
            return c.cache.pages(b);
          },
          nb::arg("b"))
      .def("assign", &cache_assign, nb::arg("b"), nb::arg("pages"), nb::arg("length"),
           "KvCache::assign: sequence b's pages and its filled slots.")
      .def("reset", &cache_reset, nb::arg("b"), "Forgets every token of sequence b.")
      .def(
          "keys", [](nb::handle self) { return cache_storage(self, false, false); },
          "K storage: a read-only view (batch, kv_heads, max_len, head_dim).")
      .def(
          "values", [](nb::handle self) { return cache_storage(self, true, false); },
          "V storage: a read-only view (batch, kv_heads, max_len, head_dim).")
      .def(
          "key_scales", [](nb::handle self) { return cache_storage(self, false, true); },
          "An 8-bit cache's K scales: a read-only view (batch, kv_heads, max_len).")
      .def(
          "value_scales", [](nb::handle self) { return cache_storage(self, true, true); },
          "An 8-bit cache's V scales: a read-only view (batch, kv_heads, max_len).");

  m.def("layer_gemm_backend", &flashcte::layer_gemm_backend,
        "The GEMM library the layer's projections run on and its kernels.");
  m.def("set_layer_gemm_fallback", &flashcte::set_layer_gemm_fallback, nb::arg("path"),
        nb::arg("symbol_prefix"),
        "The OpenBLAS the projections load when libopenblas.so.0 does not (a shared library's "
        "path and its symbols' prefix); only before the first load counts.");
}

}  // namespace

NB_MODULE(_flashcte, m) {
  m.doc() =
      "Native layer of flashcte. Use the functions of the `flashcte` package; this module's "
      "signature is private and may change.";
  m.def("attention_cte", &attention_cte, nb::kw_only(), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("neg_max").none(), nb::arg("sum_recip").none(),
        nb::arg("lse").none(), nb::arg("bf16_bits"), nb::arg("options"),
        "attention_cte into caller-allocated outputs (all tensors as numpy arrays or DLPack "
        "tensors, read in place); the other arguments are Options' fields by name. Raises "
        "TypeError/ValueError with the library's message.");
  m.def("merge_attn_states", &merge_attn_states, nb::kw_only(), nb::arg("out_a"), nb::arg("lse_a"),
        nb::arg("out_b"), nb::arg("lse_b"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"),
        "merge_attn_states into caller-allocated outputs (out may be out_a or out_b itself, lse "
        "lse_a or lse_b). Raises TypeError/ValueError with the library's message.");
  m.def("quantize_kv", &quantize_kv, nb::kw_only(), nb::arg("src"), nb::arg("dst"),
        nb::arg("scale"), nb::arg("format"), nb::arg("bf16_bits"),
        "quantize_kv into dst (its bytes, int8 or uint8) in the 8-bit `format`; per-token "
        "scales are written into scale. Raises TypeError/ValueError with the library's message.");
  m.def("flash_attn_with_kvcache", &flash_attn_with_kvcache, nb::kw_only(), nb::arg("q"),
        nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"), nb::arg("k_cache_format") = "", nb::arg("v_cache_format") = "",
        nb::arg("options"),
        "flash_attn_with_kvcache into caller-allocated outputs, the caches appended in place; "
        "the other arguments are KvCacheOptions' fields by name. Raises TypeError/ValueError "
        "with the library's message.");
  m.def("flash_attn_varlen_kvcache", &flash_attn_varlen_kvcache, nb::kw_only(), nb::arg("q"),
        nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"), nb::arg("k_cache_format") = "", nb::arg("v_cache_format") = "",
        nb::arg("options"),
        "flash_attn_varlen_kvcache into caller-allocated outputs, the caches read only; the "
        "other arguments are VarlenKvCacheOptions' fields by name. Raises TypeError/ValueError "
        "with the library's message.");
  m.attr("MAX_HEAD_DIM") = flashcte::kMaxHeadDim;
  m.def("simd_target", &flashcte::simd_target,
        "The SIMD target the library dispatched to on this machine, e.g. 'AVX3_ZEN4'.");
  m.def("version", &flashcte::version,
        "The library's version (CMakeLists.txt's project VERSION), e.g. '0.1.0'.");
  bind_layer(m);
}
