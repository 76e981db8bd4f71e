#include "tools/bandwidth.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <random>
#include <vector>

#include "src/core/pages.h"

namespace flashcte::tools {

void ReadBandwidth::Free::operator()(uint64_t* p) const { std::free(p); }

ReadBandwidth::ReadBandwidth(size_t bytes) : words_(bytes / 64 * 8) {
  // On the pages the KV cache and the tools' tensors use (huge, src/core/pages.h): the
  // bandwidth a decode call is held to is that of the same kind of memory.
  data_.reset(static_cast<uint64_t*>(internal::allocate_pages(words_ * sizeof(uint64_t))));
  // Touch every page (and give the sums something to chew on).
  for (size_t i = 0; i < words_; ++i) data_.get()[i] = i * 0x9E3779B97F4A7C15ull;
}

namespace {

// The sum of `lines` 64-byte lines from `data`, compiled for the widest vectors the CPU has (one
// clone per target, picked at load time): the default x86-64 flags sum with 16-byte SSE2 loads,
// which on an Intel Xeon read a third less than 64-byte ones (issue 25: 14.1 against 21-25 GB/s,
// 2 threads). On the AMD EPYC Zen 4 the two measured equal (2 threads, 40 interleaved passes:
// 46.3 / 44.0 GB/s SSE2, 42.9 / 44.4 AVX-512), and reading 2, 4 or 8 streams per thread instead
// of one was slower (41.3 one stream, 36.5, 32.5, 33.9 GB/s): one stream per thread it is.
// Integer sums vectorize without -ffast-math. Not under ThreadSanitizer: the clones' resolver
// runs before its runtime is up and the program crashes at load (GCC 12 and clang 14).
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FLASHCTE_TSAN 1
#endif
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__SANITIZE_THREAD__) && !defined(FLASHCTE_TSAN)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
uint64_t
sum_lines(const uint64_t* data, int64_t lines) {
  uint64_t acc[8] = {};  // one line's words: a single vector on AVX-512
  for (int64_t i = 0; i < lines; ++i) {
    for (int w = 0; w < 8; ++w) acc[w] += data[i * 8 + w];
  }
  return std::accumulate(acc, acc + 8, uint64_t{0});
}

}  // namespace

double ReadBandwidth::Measure(int threads) {
  const uint64_t* data = data_.get();
  const int64_t lines = static_cast<int64_t>(words_ / 8);
  uint64_t total = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t lo = lines * t / n, hi = lines * (t + 1) / n;
    total += sum_lines(data + lo * 8, hi - lo);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  checksum_ += total;
  return static_cast<double>(bytes()) / seconds * 1e-9;
}

double ReadBandwidth::MeasureRuns(int threads, size_t run_bytes) {
  const size_t run_words = std::max<size_t>(8, run_bytes / 64 * 8);
  const int64_t runs = static_cast<int64_t>(words_ / run_words);
  std::vector<int64_t> order(static_cast<size_t>(runs));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(7));
  // Runs ahead to prefetch: the decode kernels' distance, kDecodePrefetchBytes = 8 KiB.
  const int64_t ahead = static_cast<int64_t>((8192 + run_words * 8 - 1) / (run_words * 8));
  const uint64_t* data = data_.get();
  uint64_t total = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t lo = runs * t / n, hi = runs * (t + 1) / n;
    for (int64_t i = lo; i < hi; ++i) {
      const uint64_t* run = data + order[static_cast<size_t>(i)] * run_words;
      const uint64_t* next =
          i + ahead < hi ? data + order[static_cast<size_t>(i + ahead)] * run_words : nullptr;
      for (size_t w = 0; w < run_words; w += 8) {
        if (next) __builtin_prefetch(next + w, 0, 2);
        const uint64_t* p = run + w;
        total += (p[0] + p[4]) + (p[1] + p[5]) + (p[2] + p[6]) + (p[3] + p[7]);
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  checksum_ += total;
  return static_cast<double>(runs * run_words * sizeof(uint64_t)) / seconds * 1e-9;
}

// The last-level cache in bytes: Linux's sysfs for cpu0's index3, else sysconf. glibc 2.36's
// sysconf(_SC_LEVEL3_CACHE_SIZE) says 320 MiB on the 32 MiB-L3 Zen 4 EPYC VM this was written on,
// hence sysfs first.
size_t LastLevelCacheBytes() {
  if (std::FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
    unsigned long size = 0;
    char unit = 0;
    const int got = std::fscanf(f, "%lu%c", &size, &unit);
    std::fclose(f);
    if (got >= 1 && size > 0) return size * (unit == 'K' ? 1024 : unit == 'M' ? 1048576 : 1);
  }
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return l3 > 0 ? static_cast<size_t>(l3) : size_t{32} << 20;
}

size_t BandwidthBufferBytes() {
  return std::clamp(LastLevelCacheBytes() * 8, size_t{256} << 20, size_t{1} << 30);
}

}  // namespace flashcte::tools
