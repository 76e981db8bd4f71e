#include "src/kernel/output.h"

#include "src/core/convert.h"

namespace flashcte::internal {

void store_output_row(const simd::Ops& ops, void* base, int64_t offset, int64_t stride, DType dtype,
                      const float* src, int64_t n) {
  if (stride == 1) {
    ops.from_float(src, dtype, n, static_cast<char*>(base) + offset * dtype_size(dtype));
    return;
  }
  store_row_from_float(base, offset, stride, dtype, src, n);
}

}  // namespace flashcte::internal
