// Machinery of the micro-kernel testers (tests/simd/): a loop over every SIMD target this CPU
// runs, sizes relative to a target's lane count, and guarded buffers.
//
// GuardedBuffer is a float matrix: rows x ld floats inside guard zones, every float of
// which (guards, row tails, padding) starts as a canary NaN with a payload no arithmetic produces.
// A kernel may write only inside the extent its contract allows (src/simd/ops.h, W1-W5); after the
// call, untouched_outside() names the first canary it changed anywhere else; an input buffer,
// once sealed, must come back unchanged. A canary read into a
// result propagates as NaN, so reading past the contract shows up in the results too.
#ifndef FLASHCTE_TESTS_SIMD_TESTER_H_
#define FLASHCTE_TESTS_SIMD_TESTER_H_

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "src/simd/ops.h"
#include "tests/cpu_requirements.h"

namespace flashcte::test {

inline constexpr uint32_t kCanaryBits = 0x7FC0DEADu;  // a quiet NaN; arithmetic makes 0x7FC00000

inline float canary() {
  float f;
  std::memcpy(&f, &kCanaryBits, sizeof f);
  return f;
}
inline bool is_canary(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits == kCanaryBits;
}

class GuardedBuffer {
 public:
  // Guard zones of kGuard floats before and after; the matrix starts 64-byte aligned plus
  // `misalign` floats, so kernels meet both aligned and unaligned rows.
  static constexpr int64_t kGuard = 64;

  GuardedBuffer(int64_t rows, int64_t ld, int64_t misalign = 0)
      : rows_(rows),
        ld_(ld),
        storage_(static_cast<size_t>(2 * kGuard + 16 + misalign + rows * ld), canary()) {
    const auto addr = reinterpret_cast<uintptr_t>(storage_.data() + kGuard);
    const int64_t to_line = static_cast<int64_t>((64 - addr % 64) % 64 / sizeof(float));
    start_ = kGuard + to_line + misalign;
  }

  float* data() { return storage_.data() + start_; }
  const float* data() const { return storage_.data() + start_; }
  float& at(int64_t r, int64_t c) { return data()[r * ld_ + c]; }
  float at(int64_t r, int64_t c) const { return data()[r * ld_ + c]; }
  int64_t ld() const { return ld_; }
  int64_t rows() const { return rows_; }

  // For inputs: remembers the contents, filled values and canaries alike; unchanged() then
  // names the first float that differs.
  void seal() { sealed_ = storage_; }
  std::string unchanged() const {
    for (size_t i = 0; i < storage_.size(); ++i) {
      if (std::memcmp(&storage_[i], &sealed_[i], sizeof(float)) != 0) {
        return "float " + std::to_string(static_cast<int64_t>(i) - start_) +
               " from the matrix start changed";
      }
    }
    return "";
  }

  // Empty when every canary outside rows [0, rows) x columns [0, cols) of the matrix is intact;
  // otherwise where the first changed one is.
  std::string untouched_outside(int64_t rows, int64_t cols) const {
    for (int64_t i = 0; i < static_cast<int64_t>(storage_.size()); ++i) {
      const int64_t rel = i - start_;
      const bool in_matrix = rel >= 0 && rel < rows_ * ld_;
      const int64_t r = in_matrix ? rel / ld_ : -1, c = in_matrix ? rel % ld_ : -1;
      const bool allowed = in_matrix && r < rows && c < cols;
      if (allowed || is_canary(storage_[i])) continue;
      if (!in_matrix) {
        return "guard zone, " + std::to_string(rel < 0 ? -rel : rel - rows_ * ld_) +
               (rel < 0 ? " floats before the matrix" : " floats after the matrix");
      }
      return "row " + std::to_string(r) + ", column " + std::to_string(c) + " (allowed: rows < " +
             std::to_string(rows) + ", columns < " + std::to_string(cols) + ")";
    }
    return "";
  }

 private:
  int64_t rows_, ld_, start_ = 0;
  std::vector<float> storage_, sealed_;
};

// Calls body(ops) with the table of every SIMD target this CPU runs (the kernel's dispatch
// follows hwy::SetSupportedTargetsForTest), under a trace that names the target; returns the
// names of the targets that ran. Fails where AVX3 is required here (cpu_requirements.h) and
// is not among them.
template <class Body>
std::vector<std::string> for_each_target(const Body& body) {
  std::vector<std::string> ran;
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  std::string reason;
  if (must_run(FastPath::kAvx3, &reason)) {
    EXPECT_NE(std::find(targets.begin(), targets.end(), HWY_AVX3), targets.end())
        << "AVX3 does not run, " << reason;
  }
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    const simd::Ops& ops = simd::ops();
    ran.emplace_back(ops.target);
    SCOPED_TRACE(std::string("target ") + ops.target + " (N = " + std::to_string(ops.lanes) +
                 " floats)");
    body(ops);
  }
  hwy::SetSupportedTargetsForTest(0);
  return ran;
}

// The lengths where a vector loop's edges are: 1, N-1, N, N+1, 2N-1, 2N, 2N+1, 3N+1 (sorted,
// positive, unique) for lane count N.
inline std::vector<int64_t> edge_lengths(int64_t lanes) {
  const int64_t n = lanes;
  std::vector<int64_t> sizes = {1, n - 1, n, n + 1, 2 * n - 1, 2 * n, 2 * n + 1, 3 * n + 1};
  sizes.erase(std::remove_if(sizes.begin(), sizes.end(), [](int64_t x) { return x < 1; }),
              sizes.end());
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

inline int64_t round_up(int64_t n, int64_t unit) { return (n + unit - 1) / unit * unit; }

// float32 dot products of `terms` terms, accumulated by FMAs in any order: within
// terms * 2^-24 * sum |products| (the classic gamma_n bound), doubled for margin.
inline double dot_tolerance(int64_t terms, double abs_sum) {
  return 2.0 * static_cast<double>(terms + 1) * std::ldexp(abs_sum, -24) + 1e-30;
}

// A matmul call's float64 reference: want[r * cols + c] within tol[r * cols + c], r < rows,
// c < cols.
struct Reference {
  int64_t rows = 0, cols = 0;
  std::vector<double> want, tol;
  Reference(int64_t r, int64_t c)
      : rows(r), cols(c), want(static_cast<size_t>(r * c)), tol(static_cast<size_t>(r * c)) {}
};

// got's rows x cols against the reference (the first three misses reported, named `name`).
inline void expect_near(const GuardedBuffer& got, const Reference& ref, const char* name) {
  int bad = 0;
  for (int64_t r = 0; r < ref.rows; ++r) {
    for (int64_t c = 0; c < ref.cols; ++c) {
      const float g = got.at(r, c);
      const size_t i = static_cast<size_t>(r * ref.cols + c);
      if (!(std::abs(g - ref.want[i]) <= ref.tol[i]) && ++bad <= 3) {
        ADD_FAILURE() << name << "[" << r << "][" << c << "] = " << g << ", want " << ref.want[i];
      }
    }
  }
}

// qk's row max: row_max starts at start_row_max's values (every other row above any score, so a
// fused max must keep it); afterwards it must be exactly max(start, max_{c < cols} S[r][c]) over
// the scores stored (the fused max is taken over the very accumulators stored), and written at
// rows < rows only, or not at all without a fused max.
inline std::vector<float> start_row_max(GuardedBuffer& row_max, int64_t rows, float above) {
  std::vector<float> start(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    start[r] = r % 2 ? above : -std::numeric_limits<float>::infinity();
    row_max.at(0, r) = start[r];
  }
  row_max.seal();
  return start;
}
inline void expect_row_max(const GuardedBuffer& s, int64_t cols, const GuardedBuffer& row_max,
                           const std::vector<float>& start, bool fused) {
  int bad = 0;
  for (int64_t r = 0; r < static_cast<int64_t>(start.size()); ++r) {
    float want = start[r];
    for (int64_t c = 0; fused && c < cols; ++c) want = std::max(want, s.at(r, c));
    if (row_max.at(0, r) != want && ++bad <= 3) {
      ADD_FAILURE() << "row_max[" << r << "] = " << row_max.at(0, r) << ", want " << want;
    }
  }
  if (fused) {
    EXPECT_EQ(row_max.untouched_outside(1, static_cast<int64_t>(start.size())), "")
        << "row_max written past rows";
  } else {
    EXPECT_EQ(row_max.unchanged(), "") << "row_max written without a fused max";
  }
}

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_SIMD_TESTER_H_
