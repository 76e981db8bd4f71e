#include "src/layer/blas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace flashcte::layer {
namespace {

// cblas.h's enums, so that no BLAS header is needed at build time.
constexpr int kCblasRowMajor = 101;
constexpr int kCblasNoTrans = 111;
constexpr int kCblasTrans = 112;

// Up to this many rows a product runs as matrix-vector products. OpenBLAS 0.3.21's sgemm repacks
// all of B on every call: one decode row through the Llama-3-8B layer's 168 MB of float32
// weights took a median 2.6x longer as sgemm than as sgemv (4 interleaved pairs of
// `flashcte demo --layer --tokens 128 --decode-steps 24 --dtype float32`, Zen 4 EPYC, 2 threads,
// a loaded machine: 51-94 ms vs 22-50 ms per step). Each sgemv reads B once, the repack about
// twice, so past 2 rows sgemm is assumed to win (not measured).
constexpr int64_t kMaxGemvRows = 2;

using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                         float, float*, int);
using SgemvFn = void (*)(int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
using NameFn = char* (*)();
using SetThreadsFn = void (*)(int);
using GetThreadsFn = int (*)();

struct OpenBlas {
  SgemmFn sgemm = nullptr;
  SgemvFn sgemv = nullptr;
  SetThreadsFn set_threads = nullptr;
  GetThreadsFn get_threads = nullptr;
  std::string description;  // the backend line, or the load error
};

// The best OpenBLAS 0.3.21 core for this CPU's ISA (tools/openblas_core.cc, BestCoreFor, has the
// Zen 4 and Xeon measurements: the modern sets are within 2-3% of each other where the ISA
// allows them, an older one costs up to 5x). Empty: leave OpenBLAS's own choice.
const char* best_core_for_cpu() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return __builtin_cpu_is("amd") ? "Zen" : "Haswell";
  }
#endif
  return "";
}

OpenBlas load() {
  OpenBlas blas;
  std::string how = "OpenBLAS's own choice";
  bool set_here = false;
  if (const char* user = std::getenv("OPENBLAS_CORETYPE"); user && *user) {
    how = std::string("OPENBLAS_CORETYPE=") + user + " from the environment";
  } else if (const char* best = best_core_for_cpu(); *best) {
    // Before the load only: OpenBLAS reads it in its constructor.
    set_here = setenv("OPENBLAS_CORETYPE", best, 0) == 0;
    how = std::string("set by flashcte for this CPU's ISA: ") + best;
  }
  void* handle = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
  if (set_here) unsetenv("OPENBLAS_CORETYPE");
  if (handle == nullptr) {
    const char* why = dlerror();
    blas.description = std::string("OpenBLAS not loadable (install libopenblas0): ") +
                       (why ? why : "dlopen failed");
    return blas;
  }
  blas.sgemm = reinterpret_cast<SgemmFn>(dlsym(handle, "cblas_sgemm"));
  blas.sgemv = reinterpret_cast<SgemvFn>(dlsym(handle, "cblas_sgemv"));
  blas.set_threads = reinterpret_cast<SetThreadsFn>(dlsym(handle, "openblas_set_num_threads"));
  blas.get_threads = reinterpret_cast<GetThreadsFn>(dlsym(handle, "openblas_get_num_threads"));
  const auto core = reinterpret_cast<NameFn>(dlsym(handle, "openblas_get_corename"));
  const auto config = reinterpret_cast<NameFn>(dlsym(handle, "openblas_get_config"));
  if (blas.sgemm == nullptr || blas.sgemv == nullptr) {
    blas.description = "OpenBLAS loaded but without cblas_sgemm / cblas_sgemv";
    return blas;
  }
  blas.description = std::string(config ? config() : "OpenBLAS") + ", core " +
                     (core ? core() : "unknown") + " (" + how + ")";
  return blas;
}

const OpenBlas& openblas() {
  static const OpenBlas blas = load();
  return blas;
}

}  // namespace

Status gemm_nt(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
               int64_t ldb, float* c, int64_t ldc, int threads) {
  const OpenBlas& blas = openblas();
  if (blas.sgemm == nullptr) return Status::Error("projections: " + blas.description);
  constexpr int64_t kMaxInt = 0x7fffffff;
  if (m > kMaxInt || n > kMaxInt || k > kMaxInt || lda > kMaxInt || ldb > kMaxInt ||
      ldc > kMaxInt) {
    return Status::Error("projections: a GEMM dimension exceeds 2^31 - 1 (the BLAS int)");
  }
  if (m == 0 || n == 0) return Status::Ok();
  // OpenBLAS's thread count is process-wide: the call sets it and puts it back, under one lock
  // so that concurrent layers do not interleave their settings.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  const int before = threads > 0 && blas.get_threads ? blas.get_threads() : 0;
  if (threads > 0 && blas.set_threads) blas.set_threads(threads);
  if (m <= kMaxGemvRows) {
    // A row or two (decode): one matrix-vector product each (kMaxGemvRows).
    for (int64_t r = 0; r < m; ++r) {
      blas.sgemv(kCblasRowMajor, kCblasNoTrans, static_cast<int>(n), static_cast<int>(k), 1.0f, b,
                 static_cast<int>(ldb), a + r * lda, 1, 0.0f, c + r * ldc, 1);
    }
  } else {
    blas.sgemm(kCblasRowMajor, kCblasNoTrans, kCblasTrans, static_cast<int>(m), static_cast<int>(n),
               static_cast<int>(k), 1.0f, a, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f,
               c, static_cast<int>(ldc));
  }
  if (before > 0 && blas.set_threads) blas.set_threads(before);
  return Status::Ok();
}

std::string gemm_backend() { return openblas().description; }

}  // namespace flashcte::layer
