#include "src/kernel/output.h"

#include "src/core/convert.h"

namespace flashcte::internal {

void store_output_row(const simd::Ops& ops, void* base, int64_t offset, int64_t stride, DType dtype,
                      const float* src, int64_t n) {
  if (stride == 1 && (dtype == DType::kBFloat16 || dtype == DType::kFloat16)) {
    (dtype == DType::kBFloat16 ? ops.round_bf16 : ops.round_f16)(
        src, n, static_cast<uint16_t*>(base) + offset);
    return;
  }
  store_row_from_float(base, offset, stride, dtype, src, n);
}

}  // namespace flashcte::internal
