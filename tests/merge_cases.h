// The float32 sides of merge_attn_states's tests (merge_test.cc, merge_split_test.cc): one
// (out, lse) pair as row-major arrays with their tensor views.
#ifndef FLASHCTE_TESTS_MERGE_CASES_H_
#define FLASHCTE_TESTS_MERGE_CASES_H_

#include <cstdint>
#include <limits>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte::test {

inline constexpr float kInf = std::numeric_limits<float>::infinity();

// One side, (batch, rows, dv) and (batch, rows) float32 row-major.
struct State {
  int64_t batch = 0, rows = 0, dv = 0;
  std::vector<float> out, lse;
  State(int64_t b, int64_t r, int64_t d) : batch(b), rows(r), dv(d), out(b * r * d), lse(b * r) {}
  TensorView out_view() const {
    return TensorView::contiguous(out.data(), DType::kFloat32, {batch, rows, dv});
  }
  TensorView lse_view() const {
    return TensorView::contiguous(lse.data(), DType::kFloat32, {batch, rows});
  }
  MutableTensorView out_mut() {
    return MutableTensorView::contiguous(out.data(), DType::kFloat32, {batch, rows, dv});
  }
  MutableTensorView lse_mut() {
    return MutableTensorView::contiguous(lse.data(), DType::kFloat32, {batch, rows});
  }
};

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_MERGE_CASES_H_
