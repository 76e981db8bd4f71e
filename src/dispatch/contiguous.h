// Dense row-major views of the public view types (TensorView::contiguous and its kin).
#ifndef FLASHCTE_SRC_DISPATCH_CONTIGUOUS_H_
#define FLASHCTE_SRC_DISPATCH_CONTIGUOUS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte::internal {

// A view of `shape` (at most the view type's rank; extra dimensions are dropped) over `data`.
template <class View, class Pointer>
View make_contiguous(Pointer data, DType dtype, const std::vector<int64_t>& shape) {
  View t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(std::min<size_t>(shape.size(), t.shape.size()));
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_CONTIGUOUS_H_
