// The GEMM library of the layer's projections: OpenBLAS (Debian's libopenblas0, DYNAMIC_ARCH),
// loaded with dlopen on first use so that (1) the library links no BLAS and (2) OpenBLAS runs its
// best kernels for this CPU. OpenBLAS picks its kernel set from CPUID once, when it loads, and
// 0.3.21 misdetects recent Xeons as Prescott (57 GFLOP/s SGEMM where its SkylakeX/Cooperlake
// kernels run 312, issue 10). So unless the caller set OPENBLAS_CORETYPE, it is set to the best
// core for this CPU's ISA for the one dlopen and removed again (tools/openblas_core.cc has the
// measurements behind the table). A process that loaded OpenBLAS before keeps its kernels; the
// backend description says which ones run. Without libopenblas.so.0 it loads the fallback set
// by set_gemm_fallback (the Python package's: pip's scipy-openblas32), the same way.
#ifndef FLASHCTE_SRC_LAYER_BLAS_H_
#define FLASHCTE_SRC_LAYER_BLAS_H_

#include <cstdint>
#include <string>

#include "flashcte/flashcte.h"

namespace flashcte::layer {

// C[m x n] = A[m x k] . B^T (B is [n x k], torch.nn.Linear's weight layout), all row-major float32
// with leading dimensions lda, ldb, ldc; beta 0 (C is overwritten). Single call, OpenBLAS's own
// threads (`threads` > 0 sets their count for the call).
Status gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c, int64_t ldc, int threads);

// "OpenBLAS <version>, core <name> (<how it was chosen>)", or why it could not be loaded.
std::string gemm_backend();

// The OpenBLAS tried when libopenblas.so.0 does not load, and its symbol prefix
// (flashcte::set_layer_gemm_fallback). Counts only before the first load.
void set_gemm_fallback(const std::string& path, const std::string& symbol_prefix);

}  // namespace flashcte::layer

#endif  // FLASHCTE_SRC_LAYER_BLAS_H_
