// Computes one tiny attention through the installed library and checks it by hand: one query
// against two keys with equal scores averages their values.
#include <cmath>
#include <cstdio>

#include "flashcte/flashcte.h"

int main() {
  const float q[2] = {1.0f, 0.0f};
  const float k[4] = {0.5f, 0.5f, 0.0f, 0.0f};  // (bs_kv=1, d=2, Skv=2): both keys score 0.5
  const float v[4] = {1.0f, 2.0f, 3.0f, 4.0f};  // (1, Skv=2, d=2)
  float out[2] = {0.0f, 0.0f};
  flashcte::Outputs outputs;
  outputs.out = flashcte::MutableTensorView::contiguous(out, flashcte::DType::kFloat32, {1, 1, 2});
  flashcte::Options options;
  options.causal_mask = false;
  const flashcte::Status s = flashcte::attention_cte(
      flashcte::TensorView::contiguous(q, flashcte::DType::kFloat32, {1, 1, 2}),
      flashcte::TensorView::contiguous(k, flashcte::DType::kFloat32, {1, 2, 2}),
      flashcte::TensorView::contiguous(v, flashcte::DType::kFloat32, {1, 2, 2}), outputs, options);
  if (!s.ok) {
    std::printf("error: %s\n", s.message.c_str());
    return 1;
  }
  if (std::fabs(out[0] - 2.0f) > 1e-6f || std::fabs(out[1] - 3.0f) > 1e-6f) {
    std::printf("wrong: %g %g, expected 2 3\n", out[0], out[1]);
    return 1;
  }
  std::printf("consumer ok (%s)\n", flashcte::simd_target().c_str());
  return 0;
}
