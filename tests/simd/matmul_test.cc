// Testers of the two matmul micro-kernels, MM1 (qk) and MM2 (pv), on every SIMD target this CPU
// runs: sizes relative to the target's lane count N, row counts on both sides of the register
// block, tight and loose leading dimensions, canaries around every buffer (tester.h), and a
// float64 reference. The extents checked are the width contracts W2 and W3 of src/simd/ops.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "src/simd/ops.h"
#include "tests/simd/tester.h"

namespace flashcte::test {
namespace {

// One qk call: rows x cols scores over head dim d.
struct QkCase {
  int64_t rows = 1, cols = 1, d = 1;
  int64_t ld_extra = 0;  // added to the tightest leading dimensions the contract allows
  int64_t misalign = 0;  // floats off a cache line for every buffer
  bool fused_max = true;

  std::string describe(const simd::Ops& ops) const {
    std::ostringstream os;
    os << "qk on " << ops.target << ": rows " << rows << ", cols " << cols << ", d " << d
       << ", ld +" << ld_extra << ", misalign " << misalign << (fused_max ? ", fused max" : "");
    return os.str();
  }

  void run(const simd::Ops& ops, std::mt19937& rng) const {
    SCOPED_TRACE(describe(ops));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    // W2: K and S are touched up to round_up(cols, N): the tightest legal leading dimension.
    const int64_t touched = round_up(cols, ops.lanes);
    const int64_t ldq = d + ld_extra, ldk = touched + ld_extra, lds = touched + ld_extra;
    GuardedBuffer q(rows, ldq, misalign), k(d, ldk, misalign), s(rows, lds, misalign);
    GuardedBuffer row_max(1, rows, misalign);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t x = 0; x < d; ++x) q.at(r, x) = u(rng);
    }
    // Padding columns [cols, touched) of K keep their canary NaN: their scores may be written
    // (as NaN) but must stay out of the max.
    for (int64_t x = 0; x < d; ++x) {
      for (int64_t c = 0; c < cols; ++c) k.at(x, c) = u(rng);
    }
    // |score| <= d: a start of d + 1 is above every score.
    const std::vector<float> start = start_row_max(row_max, rows, static_cast<float>(d) + 1.0f);
    Reference ref(rows, cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        double want = 0, abs_sum = 0;
        for (int64_t x = 0; x < d; ++x) {
          const double t = static_cast<double>(q.at(r, x)) * k.at(x, c);
          want += t;
          abs_sum += std::abs(t);
        }
        ref.want[r * cols + c] = want;
        ref.tol[r * cols + c] = dot_tolerance(d, abs_sum);
      }
    }

    q.seal();
    k.seal();
    ops.qk(q.data(), ldq, rows, k.data(), ldk, cols, d, s.data(), lds,
           fused_max ? row_max.data() : nullptr);

    expect_near(s, ref, "S");
    expect_row_max(s, cols, row_max, start, fused_max);
    EXPECT_EQ(s.untouched_outside(rows, touched), "") << "S written past round_up(cols, N)";
    EXPECT_EQ(q.unchanged(), "") << "Q written";
    EXPECT_EQ(k.unchanged(), "") << "K written";
  }
};

// One pv call: rows x dv_pad accumulators over n keys.
struct PvCase {
  int64_t rows = 1, n = 1, dv = 1;
  int64_t ld_extra = 0, misalign = 0;
  bool with_alpha = true;

  std::string describe(const simd::Ops& ops) const {
    std::ostringstream os;
    os << "pv on " << ops.target << ": rows " << rows << ", n " << n << ", dv " << dv << " (dv_pad "
       << simd::padded(dv) << "), ld +" << ld_extra << ", misalign " << misalign
       << (with_alpha ? ", alpha" : ", no alpha");
    return os.str();
  }

  void run(const simd::Ops& ops, std::mt19937& rng) const {
    SCOPED_TRACE(describe(ops));
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    const int64_t dv_pad = simd::padded(dv);
    // W3: V and O are touched up to dv_pad: the tightest legal leading dimension.
    const int64_t ldp = n + ld_extra, ldv = dv_pad + ld_extra, ldo = dv_pad + ld_extra;
    GuardedBuffer p(rows, std::max<int64_t>(ldp, 1), misalign), v(n, ldv, misalign);
    GuardedBuffer o(rows, ldo, misalign), alpha(1, rows, misalign);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < n; ++j) p.at(r, j) = u(rng);
      for (int64_t c = 0; c < dv_pad; ++c) o.at(r, c) = u(rng);
      alpha.at(0, r) = u(rng);
    }
    // V's columns [dv, dv_pad) are finite, as W3 asks (the kernel keeps them zero).
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < dv_pad; ++c) v.at(j, c) = c < dv ? u(rng) : 0.0f;
    }
    Reference ref(rows, dv_pad);
    for (int64_t r = 0; r < rows; ++r) {
      const double a = with_alpha ? alpha.at(0, r) : 1.0;
      for (int64_t c = 0; c < dv_pad; ++c) {
        double acc = a * o.at(r, c), abs_sum = std::abs(acc);
        for (int64_t j = 0; j < n; ++j) {
          const double t = static_cast<double>(p.at(r, j)) * v.at(j, c);
          acc += t;
          abs_sum += std::abs(t);
        }
        ref.want[r * dv_pad + c] = acc;
        ref.tol[r * dv_pad + c] = dot_tolerance(n + 1, abs_sum);
      }
    }

    p.seal();
    v.seal();
    alpha.seal();
    ops.pv(p.data(), ldp, rows, n, v.data(), ldv, dv_pad, with_alpha ? alpha.data() : nullptr,
           o.data(), ldo);

    expect_near(o, ref, "O");
    EXPECT_EQ(o.untouched_outside(rows, dv_pad), "") << "O written past dv_pad";
    EXPECT_EQ(v.unchanged(), "") << "V written";
    EXPECT_EQ(p.unchanged(), "") << "P written";
    EXPECT_EQ(alpha.unchanged(), "") << "alpha written";
  }
};

// Row counts on both sides of the register block, and past qk's 48-row max group.
std::vector<int64_t> row_counts(const simd::Ops& ops) {
  std::vector<int64_t> rows;
  for (int64_t r = 1; r <= ops.mm_rows + 1; ++r) rows.push_back(r);
  rows.push_back(2 * ops.mm_rows + 1);
  rows.push_back(49);
  return rows;
}

TEST(SimdQk, EveryHeadDimAndColumnEdge) {
  std::mt19937 rng(1);
  for_each_target([&](const simd::Ops& ops) {
    // Every head dim 1 .. 2N+1, and across the d tiling of 128.
    std::vector<int64_t> dims;
    for (int64_t d = 1; d <= 2 * ops.lanes + 1; ++d) dims.push_back(d);
    for (int64_t d : {127, 128, 129, 257}) dims.push_back(d);
    for (int64_t d : dims) {
      for (int64_t cols : edge_lengths(ops.lanes)) {
        for (int64_t rows : {int64_t{1}, ops.mm_rows, ops.mm_rows + 1}) {
          QkCase c;
          c.rows = rows;
          c.cols = cols;
          c.d = d;
          c.run(ops, rng);
        }
      }
    }
  });
}

TEST(SimdQk, EveryRowCountLayoutAndMaxMode) {
  std::mt19937 rng(2);
  for_each_target([&](const simd::Ops& ops) {
    for (int64_t rows : row_counts(ops)) {
      for (int64_t cols : edge_lengths(ops.lanes)) {
        for (int64_t d : {int64_t{1}, ops.lanes + 1, int64_t{129}}) {
          for (int variant = 0; variant < 3; ++variant) {
            QkCase c;
            c.rows = rows;
            c.cols = cols;
            c.d = d;
            c.ld_extra = variant == 1 ? 3 : 0;  // unaligned rows
            c.misalign = variant == 1 ? 1 : 0;
            c.fused_max = variant != 2;
            c.run(ops, rng);
          }
        }
      }
    }
  });
}

TEST(SimdPv, EveryValueDimAndKeyEdge) {
  std::mt19937 rng(3);
  for_each_target([&](const simd::Ops& ops) {
    // Every value dim 1 .. 2N+1 (dv_pad a multiple of N but not of 2N on the widest target),
    // and head dims of real models.
    std::vector<int64_t> dims;
    for (int64_t dv = 1; dv <= 2 * ops.lanes + 1; ++dv) dims.push_back(dv);
    for (int64_t dv : {80, 112, 128, 576}) dims.push_back(dv);
    std::vector<int64_t> keys = edge_lengths(ops.lanes);
    keys.insert(keys.begin(), 0);  // no key: O = alpha O
    for (int64_t dv : dims) {
      for (int64_t n : keys) {
        for (int64_t rows : {int64_t{1}, ops.mm_rows, ops.mm_rows + 1}) {
          PvCase c;
          c.rows = rows;
          c.n = n;
          c.dv = dv;
          c.run(ops, rng);
        }
      }
    }
  });
}

TEST(SimdPv, EveryRowCountLayoutAndAlphaMode) {
  std::mt19937 rng(4);
  for_each_target([&](const simd::Ops& ops) {
    for (int64_t rows : row_counts(ops)) {
      for (int64_t n : edge_lengths(ops.lanes)) {
        for (int64_t dv : {int64_t{1}, ops.lanes + 1, 2 * ops.lanes + 1}) {
          for (int variant = 0; variant < 3; ++variant) {
            PvCase c;
            c.rows = rows;
            c.n = n;
            c.dv = dv;
            c.ld_extra = variant == 1 ? 3 : 0;
            c.misalign = variant == 1 ? 1 : 0;
            c.with_alpha = variant != 2;
            c.run(ops, rng);
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace flashcte::test
