#include "tools/bench_softmax.h"

#include <cmath>
#include <cstring>

namespace flashcte::tools {
namespace {

// Cloned for AVX2 so the loop uses 8-wide libmvec expf on machines that have it; the default
// clone keeps the binary portable. x86 only: elsewhere GCC rejects the "avx2" clone (aarch64's
// baseline already includes NEON, which the plain build vectorizes for).
#if defined(__x86_64__) || defined(__i386__)
#define FLASHCTE_CLONE_AVX2 __attribute__((target_clones("avx2", "default")))
#else
#define FLASHCTE_CLONE_AVX2
#endif

FLASHCTE_CLONE_AVX2 void SoftmaxRow(float* row, int64_t valid, int64_t cols) {
  float max = row[0];
  for (int64_t j = 1; j < valid; ++j) max = row[j] > max ? row[j] : max;
  float sum = 0;
  for (int64_t j = 0; j < valid; ++j) {
    row[j] = std::exp(row[j] - max);
    sum += row[j];
  }
  const float recip = 1.0f / sum;
  for (int64_t j = 0; j < valid; ++j) row[j] *= recip;
  if (cols > valid) std::memset(row + valid, 0, (cols - valid) * sizeof(float));
}

}  // namespace

void MaskedSoftmaxRows(float* s, int64_t rows, int64_t cols, int64_t ld, bool causal, int threads) {
  if (cols == 0) return;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t valid = causal ? (i + 1 < cols ? i + 1 : cols) : cols;
    SoftmaxRow(s + i * ld, valid, cols);
  }
}

}  // namespace flashcte::tools
