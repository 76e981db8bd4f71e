#include "src/layer/blas.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "src/core/cpu.h"

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

// The system's OpenBLAS (Debian's libopenblas0), tried first; set_gemm_fallback names another.
constexpr char kSystemOpenBlas[] = "libopenblas.so.0";
// The error of every projection when neither loads, followed by dlopen's reasons.
constexpr char kNoOpenBlas[] =
    "OpenBLAS not loadable (install Debian's libopenblas0, or for the Python package pip install "
    "scipy-openblas32): ";

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
  const internal::CpuFeatures& cpu = internal::cpu_features();
  if (cpu.avx512_bf16) return "Cooperlake";
  if (cpu.avx512) return "SkylakeX";
  if (cpu.avx2_fma) return cpu.vendor == internal::CpuVendor::kAmd ? "Zen" : "Haswell";
  return "";
}

// Opens one OpenBLAS build and resolves its functions, whose names carry `prefix`
// (scipy-openblas32 prefixes every symbol with "scipy_"). False, with *why set, when the library
// does not load; a library without cblas_sgemm / cblas_sgemv leaves blas->sgemm null.
bool open_blas(const std::string& path, const std::string& prefix, OpenBlas* blas,
               std::string* why) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    *why = error ? error : path + ": dlopen failed";
    return false;
  }
  const auto sym = [&](const char* name) { return dlsym(handle, (prefix + name).c_str()); };
  blas->sgemm = reinterpret_cast<SgemmFn>(sym("cblas_sgemm"));
  blas->sgemv = reinterpret_cast<SgemvFn>(sym("cblas_sgemv"));
  blas->set_threads = reinterpret_cast<SetThreadsFn>(sym("openblas_set_num_threads"));
  blas->get_threads = reinterpret_cast<GetThreadsFn>(sym("openblas_get_num_threads"));
  const auto core = reinterpret_cast<NameFn>(sym("openblas_get_corename"));
  const auto config = reinterpret_cast<NameFn>(sym("openblas_get_config"));
  if (blas->sgemm == nullptr || blas->sgemv == nullptr) {
    blas->sgemm = nullptr;
    blas->description =
        path + " loaded but without " + prefix + "cblas_sgemm / " + prefix + "cblas_sgemv";
    return true;
  }
  blas->description =
      std::string(config ? config() : "OpenBLAS") + ", core " + (core ? core() : "unknown");
  if (path != kSystemOpenBlas) blas->description += ", " + path;
  return true;
}

std::mutex& fallback_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::string& fallback_path() {
  static std::string path;
  return path;
}
std::string& fallback_prefix() {
  static std::string prefix;
  return prefix;
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
  std::string why;
  bool loaded = open_blas(kSystemOpenBlas, "", &blas, &why);
  std::string path, prefix;
  {
    std::lock_guard<std::mutex> lock(fallback_mutex());
    path = fallback_path();
    prefix = fallback_prefix();
  }
  if (!loaded && !path.empty()) {
    std::string why_fallback;
    loaded = open_blas(path, prefix, &blas, &why_fallback);
    if (!loaded) why += "; " + why_fallback;
  }
  if (set_here) unsetenv("OPENBLAS_CORETYPE");
  if (!loaded) {
    blas.description = std::string(kNoOpenBlas) + why;
  } else if (blas.sgemm != nullptr) {
    blas.description += " (" + how + ")";
  }
  return blas;
}

const OpenBlas& openblas() {
  static const OpenBlas blas = load();
  return blas;
}

}  // namespace

void set_gemm_fallback(const std::string& path, const std::string& symbol_prefix) {
  std::lock_guard<std::mutex> lock(fallback_mutex());
  fallback_path() = path;
  fallback_prefix() = symbol_prefix;
}

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
