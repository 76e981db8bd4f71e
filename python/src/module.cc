// flashcte._flashcte: the areas' bindings (bindings.h) and the library's identity.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "flashcte/flashcte.h"
#include "python/src/arrays.h"
#include "python/src/bindings.h"

namespace nb = nanobind;

NB_MODULE(_flashcte, m) {
  m.doc() =
      "Native layer of flashcte. Use the functions of the `flashcte` package; this module's "
      "signature is private and may change.";
  flashcte::python::add_error_classes(m);
  flashcte::python::bind_attention(m);
  m.attr("MAX_HEAD_DIM") = flashcte::kMaxHeadDim;
  m.def("simd_target", &flashcte::simd_target,
        "The SIMD target the library dispatched to on this machine, e.g. 'AVX3_ZEN4'.");
  m.def("version", &flashcte::version,
        "The library's version (CMakeLists.txt's project VERSION), e.g. '0.1.0'.");
  flashcte::python::bind_layer(m);
}
