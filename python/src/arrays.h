// What every binding shares: a tensor argument imported as a flashcte view without a copy
// (Imports), a failed Status raised as the Python exception its kind names (raise_status), and
// keyword arguments set into an options struct by name (set_options and its tables).
//
// The bindings are deliberately thin. Python (the flashcte package) resolves defaults, allocates
// the outputs in the caller's framework and turns numpy bfloat16 (ml_dtypes) arrays into uint16
// views; here every tensor argument is imported as a DLPack/buffer view with nanobind's ndarray
// (never copied: no implicit conversion is allowed), mapped onto a flashcte::TensorView with the
// same shape and element strides, and the library is called with the GIL released.
#ifndef FLASHCTE_PYTHON_SRC_ARRAYS_H_
#define FLASHCTE_PYTHON_SRC_ARRAYS_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte::python {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

// The 8-bit cache formats by the names Python gives them; "" for an argument that is not one.
std::optional<flashcte::DType> kv8_format(const char* name, const std::string& format);

// Keeps every imported array alive (and so its producer's buffer) until the call returns.
struct Imports {
  std::vector<InArray> inputs;
  std::vector<OutArray> outputs;
  bool bf16_bits = false;
  // Set for a call that appends k and v to its cache (cache()).
  bool appending = false;

  // An input (None: absent).
  flashcte::TensorView in(const char* name, nb::handle h,
                          std::optional<flashcte::DType> kv8 = std::nullopt);
  // An output, writable (None: absent).
  flashcte::MutableTensorView out(const char* name, nb::handle h,
                                  std::optional<flashcte::DType> kv8 = std::nullopt);
  // A KV cache or its 8-bit scales: written when the call appends k and v (`appending`), and
  // otherwise only read, so then a read-only array (flash_attn_func's k and v) is taken too.
  flashcte::MutableTensorView cache(const char* name, nb::handle h,
                                    std::optional<flashcte::DType> kv8 = std::nullopt);
};

// The refusals of an argument: flashcte.ArgumentError (its value or shape breaks a rule) and
// flashcte.ArgumentTypeError (its dtype), subclasses of ValueError and TypeError, and both of
// RuntimeError as well, which is what PyTorch's and FlashAttention's checks (TORCH_CHECK) raise
// and their users catch. Created once, by add_error_classes (the module's init), which also puts
// them in the module.
void add_error_classes(nb::module_& m);

// A failed Status as the exception its kind names: ArgumentTypeError (a dtype rule),
// MemoryError, RuntimeError (a library bug) or ArgumentError, with the library's
// "<argument>: <rule>" message.
[[noreturn]] void raise_status(const flashcte::Status& s);

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

}  // namespace flashcte::python

#endif  // FLASHCTE_PYTHON_SRC_ARRAYS_H_
