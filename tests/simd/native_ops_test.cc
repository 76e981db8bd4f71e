// Testers of the native bfloat16 matmuls (src/simd/native_ops.h) where the CPU runs them: sizes
// relative to the 16 float32 lanes of a zmm vector, row counts on both sides of the register
// block, canaries around every buffer (tester.h), against a float64 reference. Inputs are random
// bfloat16 values; the canaries read as bfloat16 pairs hold a NaN, so a read past the contract
// poisons a result.
#include "src/simd/native_ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "src/reference/reference.h"
#include "src/simd/ops.h"
#include "tests/cpu_requirements.h"
#include "tests/simd/tester.h"

namespace flashcte::test {
namespace {

// The native kernels regardless of the automatic policy, or null where the CPU lacks them.
const simd::NativeOps* native() {
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  const simd::NativeOps* dot = simd::native_ops_for(simd::ops());
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
  return dot;
}

uint16_t random_bf16(std::mt19937& rng, float lo, float hi) {
  const float f = static_cast<float>(reference::round_to_dtype(
      std::uniform_real_distribution<double>(lo, hi)(rng), DType::kBFloat16));
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}
double bf16_value(uint16_t h) { return reference::load_element(&h, DType::kBFloat16, 0); }

// bfloat16 views of a GuardedBuffer's floats (two per float, little endian).
uint16_t* halves(GuardedBuffer& b) { return reinterpret_cast<uint16_t*>(b.data()); }
uint32_t* pairs(GuardedBuffer& b) { return reinterpret_cast<uint32_t*>(b.data()); }

// Every remainder block of a register tile of `block_rows` rows, and past the 48-row max group.
std::vector<int64_t> row_counts(int64_t block_rows) {
  std::vector<int64_t> rows;
  for (int64_t r = 1; r <= block_rows + 1; ++r) rows.push_back(r);
  rows.push_back(2 * block_rows + 1);
  rows.push_back(49);
  return rows;
}

// Column counts at every vector edge of the first panel, across the panel of `panel_cols`
// columns into the next, and into a third.
std::vector<int64_t> column_counts(int64_t lanes, int64_t panel_cols) {
  std::vector<int64_t> cols = edge_lengths(lanes);
  for (int64_t c : {panel_cols - 1, panel_cols, panel_cols + 1, panel_cols + lanes + 1,
                    2 * panel_cols + 2 * lanes + 3}) {
    cols.push_back(c);
  }
  std::sort(cols.begin(), cols.end());
  cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
  return cols;
}

void run_qk(const simd::NativeOps& dot, int64_t rows, int64_t cols, int64_t d, bool fused_max,
            std::mt19937& rng) {
  std::ostringstream where;
  where << "native qk: rows " << rows << ", cols " << cols << ", d " << d
        << (fused_max ? ", fused max" : "");
  SCOPED_TRACE(where.str());
  const int64_t d2 = round_up(d, 2), touched = round_up(cols, dot.lanes);
  const int64_t ldq = d2 + 2, ldk = touched;  // ldq in bfloat16 elements, ldk in pairs
  GuardedBuffer q(rows, ldq / 2), k(d2 / 2, ldk), s(rows, touched), row_max(1, rows);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t x = 0; x < d2; ++x) halves(q)[r * ldq + x] = x < d ? random_bf16(rng, -1, 1) : 0;
  }
  // K's columns [cols, touched) keep their canaries (NaN pairs): scores there may be written, as
  // NaN, but must stay out of the max.
  for (int64_t x = 0; x < d2; ++x) {
    for (int64_t c = 0; c < cols; ++c) {
      halves(k)[2 * ((x / 2) * ldk + c) + x % 2] = x < d ? random_bf16(rng, -1, 1) : 0;
    }
  }
  // |score| <= d * scale < d: a start of d is above every score.
  const std::vector<float> start = start_row_max(row_max, rows, static_cast<float>(d));
  const float scale = 0.37f;
  Reference ref(rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      double want = 0, abs_sum = 0;
      for (int64_t x = 0; x < d; ++x) {
        const double t = bf16_value(halves(q)[r * ldq + x]) *
                         bf16_value(halves(k)[2 * ((x / 2) * ldk + c) + x % 2]);
        want += t;
        abs_sum += std::abs(t);
      }
      ref.want[r * cols + c] = want * scale;
      ref.tol[r * cols + c] = dot_tolerance(d, abs_sum * scale);
    }
  }
  q.seal();
  k.seal();
  dot.qk(halves(q), ldq, rows, pairs(k), ldk, cols, d2, scale, s.data(), touched,
         fused_max ? row_max.data() : nullptr);
  expect_near(s, ref, "S");
  expect_row_max(s, cols, row_max, start, fused_max);
  EXPECT_EQ(s.untouched_outside(rows, touched), "") << "S written past round_up(cols, 16)";
  EXPECT_EQ(q.unchanged(), "") << "Q written";
  EXPECT_EQ(k.unchanged(), "") << "K written";
}

void run_pv(const simd::NativeOps& dot, int64_t rows, int64_t n, int64_t dv, bool with_alpha,
            std::mt19937& rng) {
  std::ostringstream where;
  where << "native pv: rows " << rows << ", n " << n << ", dv " << dv << " (dv_pad "
        << simd::padded(dv) << ")" << (with_alpha ? ", alpha" : "");
  SCOPED_TRACE(where.str());
  const int64_t n2 = round_up(n, 2), dv_pad = simd::padded(dv);
  const int64_t ldp = n2 + 2;  // bfloat16 elements
  GuardedBuffer p(rows, ldp / 2), v(std::max<int64_t>(n2 / 2, 1), dv_pad), o(rows, dv_pad);
  GuardedBuffer alpha(1, rows);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    // The pad key of an odd n has P = 0, as the kernel layer writes it.
    for (int64_t j = 0; j < n2; ++j) halves(p)[r * ldp + j] = j < n ? random_bf16(rng, 0, 1) : 0;
    for (int64_t c = 0; c < dv_pad; ++c) o.at(r, c) = u(rng);
    alpha.at(0, r) = u(rng);
  }
  for (int64_t j = 0; j < n2; ++j) {
    for (int64_t c = 0; c < dv_pad; ++c) {
      halves(v)[2 * ((j / 2) * dv_pad + c) + j % 2] = j < n && c < dv ? random_bf16(rng, -1, 1) : 0;
    }
  }
  Reference ref(rows, dv_pad);
  for (int64_t r = 0; r < rows; ++r) {
    const double a = with_alpha ? alpha.at(0, r) : 1.0;
    for (int64_t c = 0; c < dv_pad; ++c) {
      double acc = a * o.at(r, c), abs_sum = std::abs(acc);
      for (int64_t j = 0; j < n; ++j) {
        const double t = bf16_value(halves(p)[r * ldp + j]) *
                         bf16_value(halves(v)[2 * ((j / 2) * dv_pad + c) + j % 2]);
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
  dot.pv(halves(p), ldp, rows, n2, pairs(v), dv_pad, dv_pad, with_alpha ? alpha.data() : nullptr,
         o.data(), dv_pad);
  expect_near(o, ref, "O");
  EXPECT_EQ(o.untouched_outside(rows, dv_pad), "") << "O written past dv_pad";
  EXPECT_EQ(p.unchanged(), "") << "P written";
  EXPECT_EQ(v.unchanged(), "") << "V written";
  EXPECT_EQ(alpha.unchanged(), "") << "alpha written";
}

#define SKIP_WITHOUT_NATIVE(dot)                                                   \
  if (!(dot)) {                                                                    \
    FLASHCTE_SKIP_UNLESS_REQUIRED(FastPath::kNativeKernels,                        \
                                  "the native bf16 kernels are not offered here"); \
  }

TEST(SimdBf16DotQk, EveryHeadDimAndColumnEdge) {
  const simd::NativeOps* dot = native();
  SKIP_WITHOUT_NATIVE(dot);
  std::mt19937 rng(11);
  std::vector<int64_t> dims;
  for (int64_t d = 1; d <= 2 * dot->lanes + 1; ++d) dims.push_back(d);
  for (int64_t d : {127, 128, 129, 257}) dims.push_back(d);  // across the 64-pair tiling
  for (int64_t d : dims) {
    for (int64_t cols : column_counts(dot->lanes, dot->qk_cols)) {
      for (int64_t rows : {int64_t{1}, dot->qk_rows, dot->qk_rows + 1}) {
        run_qk(*dot, rows, cols, d, true, rng);
      }
    }
  }
}

TEST(SimdBf16DotQk, EveryRowCountAndMaxMode) {
  const simd::NativeOps* dot = native();
  SKIP_WITHOUT_NATIVE(dot);
  std::mt19937 rng(12);
  for (int64_t rows : row_counts(dot->qk_rows)) {
    for (int64_t cols : column_counts(dot->lanes, dot->qk_cols)) {
      for (int64_t d : {int64_t{1}, int64_t{17}, int64_t{129}}) {
        for (bool fused : {true, false}) run_qk(*dot, rows, cols, d, fused, rng);
      }
    }
  }
}

TEST(SimdBf16DotPv, EveryValueDimAndKeyEdge) {
  const simd::NativeOps* dot = native();
  SKIP_WITHOUT_NATIVE(dot);
  std::mt19937 rng(13);
  std::vector<int64_t> dims;
  for (int64_t dv = 1; dv <= 2 * dot->lanes + 1; ++dv) dims.push_back(dv);
  for (int64_t dv : {80, 112, 128, 576}) dims.push_back(dv);
  std::vector<int64_t> keys = edge_lengths(dot->lanes);
  keys.insert(keys.begin(), 0);
  for (int64_t dv : dims) {
    for (int64_t n : keys) {
      for (int64_t rows : {int64_t{1}, dot->pv_rows, dot->pv_rows + 1}) {
        run_pv(*dot, rows, n, dv, true, rng);
      }
    }
  }
}

TEST(SimdBf16DotPv, EveryRowCountAndAlphaMode) {
  const simd::NativeOps* dot = native();
  SKIP_WITHOUT_NATIVE(dot);
  std::mt19937 rng(14);
  for (int64_t rows : row_counts(dot->pv_rows)) {
    for (int64_t n : edge_lengths(dot->lanes)) {
      for (int64_t dv : {int64_t{1}, int64_t{17}, int64_t{33}}) {
        for (bool alpha : {true, false}) run_pv(*dot, rows, n, dv, alpha, rng);
      }
    }
  }
}

// The native exp-and-sum is Ops::exp_sum's bfloat16 pass on vcvtneps2bf16, writing P to a row of
// its own: the same P bits and the same sum bit for bit at every edge length (masked tail),
// nothing written past n; -inf gives 0, NaN stays NaN.
TEST(SimdBf16DotExpSum, MatchesThePortablePassBitForBit) {
  const simd::NativeOps* dot = native();
  SKIP_WITHOUT_NATIVE(dot);
  const simd::Ops& ops = simd::ops();
  std::mt19937 rng(15);
  std::uniform_real_distribution<float> u(-100.0f, 0.5f);
  for (int64_t n : edge_lengths(dot->lanes)) {
    for (bool poison : {false, true}) {
      SCOPED_TRACE("n " + std::to_string(n) + (poison ? ", -inf and NaN" : ""));
      std::vector<float> s(static_cast<size_t>(n));
      for (float& x : s) x = u(rng);
      // The edges of exp's range, after the bias of -0.5: -87 (the cut to 0, where 2^n is
      // smallest) and its neighbours, and 0.
      const float edges[] = {
          -86.5f,    std::nextafter(-86.5f, -100.0f), std::nextafter(-86.5f, 0.0f), -86.84f, 0.5f,
          0.4999999f};
      for (size_t e = 0; e < std::size(edges) && static_cast<int64_t>(e) + 2 < n; ++e) {
        s[e + 1] = edges[e];
      }
      if (poison) {
        s[0] = -std::numeric_limits<float>::infinity();
        s[n - 1] = std::numeric_limits<float>::quiet_NaN();
      }
      std::vector<float> rounded = s;
      const float want_sum = ops.exp_sum(rounded.data(), n, -0.5f, true);
      std::vector<uint16_t> want(static_cast<size_t>(n));
      for (int64_t c = 0; c < n; ++c) {
        uint32_t bits;
        std::memcpy(&bits, &rounded[c], sizeof bits);
        want[c] = static_cast<uint16_t>(bits >> 16);
      }
      GuardedBuffer out(1, n / 2 + dot->lanes, 1);
      uint16_t* got = halves(out);
      const float got_sum = dot->exp_sum(s.data(), n, -0.5f, got);
      for (int64_t c = 0; c < n; ++c) {
        // A NaN may come back with another payload (vcvtneps2bf16 quiets it its own way).
        const auto is_nan = [](uint16_t h) { return (h & 0x7F80u) == 0x7F80u && (h & 0x7Fu); };
        if (is_nan(want[c])) {
          EXPECT_TRUE(is_nan(got[c])) << "column " << c;
        } else {
          EXPECT_EQ(got[c], want[c]) << "column " << c;
        }
      }
      if (poison) {
        EXPECT_TRUE(std::isnan(got_sum));
        if (n > 1) {
          EXPECT_EQ(got[0], 0) << "exp(-inf)";
        }
      } else {
        EXPECT_EQ(got_sum, want_sum);
      }
      if (n % 2) {
        EXPECT_EQ(got[n], static_cast<uint16_t>(kCanaryBits >> 16)) << "element n";
      }
      EXPECT_EQ(out.untouched_outside(1, (n + 1) / 2), "") << "P2 written past n";
    }
  }
}

// The policy: native under kNative, never under kWiden, and never with a table narrower than
// AVX-512 (the float32 kernels of AVX2 and below widen bfloat16 whatever the CPU has).
TEST(SimdBf16Dot, PolicyAndTargets) {
  const simd::NativeOps* dot = native();
  SKIP_WITHOUT_NATIVE(dot);
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kWiden);
  EXPECT_EQ(simd::native_ops_for(simd::ops()), nullptr);
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kNative);
  for_each_target([&](const simd::Ops& ops) {
    EXPECT_EQ(simd::native_ops_for(ops) != nullptr, ops.lanes == 16) << ops.target;
  });
  simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto);
}

}  // namespace
}  // namespace flashcte::test
