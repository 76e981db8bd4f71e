// flashcte._flashcte, the nanobind module between the flashcte package and the library, by area:
// the attention calls (attention.cc) and the layer with its cache (layer.cc), on what they share
// (arrays.h); module.cc makes the module. Its signatures are private to the package.
#ifndef FLASHCTE_PYTHON_SRC_BINDINGS_H_
#define FLASHCTE_PYTHON_SRC_BINDINGS_H_

#include <nanobind/nanobind.h>

namespace flashcte::python {

void bind_attention(nanobind::module_& m);
void bind_layer(nanobind::module_& m);

}  // namespace flashcte::python

#endif  // FLASHCTE_PYTHON_SRC_BINDINGS_H_
