// Testers of the row micro-kernels (row_max, exp_sum, softcap, alibi, add, mul, classify; the
// conversions are in row_convert_test.cc) on every SIMD target this CPU runs: every length where
// a vector loop has an edge (1, N-1, N, N+1, 2N-1, 2N, 2N+1, 3N+1), aligned and unaligned starts,
// canaries past the end (W4 of src/simd/ops.h: these touch exactly [0, n)), and a float64
// reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "src/reference/reference.h"
#include "src/simd/ops.h"
#include "tests/simd/row_cases.h"
#include "tests/simd/tester.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

void fill(GuardedBuffer& row, int64_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t c = 0; c < n; ++c) row.at(0, c) = u(rng);
}

TEST(SimdRowMax, ExactOverEveryEdge) {
  std::mt19937 rng(1);
  for_each_target([&](const simd::Ops& ops) {
    for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
      fill(row, n, -5.0f, 5.0f, rng);
      // The max at each position in turn, so every lane and the tail are seen to count.
      for (int64_t at = 0; at < n; ++at) {
        const float saved = row.at(0, at);
        row.at(0, at) = 7.0f;
        EXPECT_EQ(ops.row_max(row.data(), n), 7.0f) << "max at " << at;
        row.at(0, at) = saved;
      }
      for (int64_t c = 0; c < n; ++c) row.at(0, c) = -kInf;
      EXPECT_EQ(ops.row_max(row.data(), n), -kInf) << "all -inf";
    });
  });
}

// exp_sum against std::exp in double on every edge length (the accuracy over the whole input
// range is ExpSumMatchesStdExp's): float32 path within 2^-22 relative, bfloat16 path a bfloat16
// within half a bfloat16 ulp plus the degree-4 polynomial's 2.8e-6.
TEST(SimdExpSum, EveryEdgeBothRoundings) {
  std::mt19937 rng(2);
  const float bias = -0.75f;
  for_each_target([&](const simd::Ops& ops) {
    for (bool round_bf16 : {false, true}) {
      for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
        fill(row, n, -20.0f, 0.75f, rng);
        std::vector<float> in(row.data(), row.data() + n);
        const float sum = ops.exp_sum(row.data(), n, bias, round_bf16);
        double want_sum = 0;
        for (int64_t c = 0; c < n; ++c) {
          const double want = std::exp(static_cast<double>(in[c] + bias));
          want_sum += want;
          const double tol =
              round_bf16 ? want * (std::ldexp(1.0, -8) + 3e-6) : std::ldexp(want, -22);
          EXPECT_NEAR(row.at(0, c), want, tol) << "column " << c << (round_bf16 ? " bf16" : "");
        }
        // Each term as accurate as its exp (the bf16 path sums the unrounded degree-4 values:
        // 2.8e-6), plus float32 accumulation over n terms.
        const double term_rel = round_bf16 ? 3e-6 : std::ldexp(1.0, -22);
        EXPECT_NEAR(sum, want_sum, want_sum * (term_rel + std::ldexp(static_cast<double>(n), -24)));
      });
    }
  });
}

// The exp of the exp-and-sum pass against std::exp in double, lane by lane, on every target:
// x = s + bias over [-110, 0] (bias folded in as the kernel does), the underflow edge, -inf and
// NaN. float32 path: relative error within 2^-22 (2 to 4 ulp); bfloat16 path: the stored value is
// a bfloat16 within half a bfloat16 ulp (plus the polynomial's 2.8e-6) and the returned sum keeps
// float32 terms.
TEST(SimdExpSum, MatchesStdExpOverTheWholeRange) {
  std::vector<float> x;
  for (int i = 0; i <= 110000; ++i) x.push_back(-110.0f * static_cast<float>(i) / 110000.0f);
  for (float v : {0.0f, -0.0f, -1e-30f, -87.0f, std::nextafter(-87.0f, 0.0f),
                  std::nextafter(-87.0f, -kInf), -kInf}) {
    x.push_back(v);
  }
  const float bias = -0.75f;
  for_each_target([&](const simd::Ops& ops) {
    for (bool round_bf16 : {false, true}) {
      std::vector<float> in(x.size()), s(x.size());
      for (size_t i = 0; i < x.size(); ++i) s[i] = in[i] = x[i] - bias;
      const float sum = ops.exp_sum(s.data(), static_cast<int64_t>(s.size()), bias, round_bf16);
      double want_sum = 0.0;
      int bad = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const float xi = in[i] + bias;  // x as the kernel forms it
        const double want = xi < -87.0f ? 0.0 : std::exp(static_cast<double>(xi));
        want_sum += want;
        double tol = 2.0 * std::ldexp(want, -23);
        if (round_bf16) {
          uint32_t bits;
          std::memcpy(&bits, &s[i], sizeof bits);
          if ((bits & 0xFFFFu) != 0 && ++bad <= 5) ADD_FAILURE() << "not a bfloat16 at x = " << xi;
          tol = want * (std::ldexp(1.0, -8) + 3e-6);  // half ulp: 2^-8 relative at worst
        }
        if (!(std::abs(s[i] - want) <= tol) && ++bad <= 5) {
          ADD_FAILURE() << (round_bf16 ? "bf16" : "fp32") << ": exp(" << xi << ") = " << s[i]
                        << ", want " << want;
        }
      }
      // The lanes above carry the accuracy; this checks that the sum adds up what was computed.
      // 1e-4: float32 accumulation over 110k terms (the scalar target's single accumulator
      // measured 1.04e-5).
      EXPECT_NEAR(sum, want_sum, want_sum * 1e-4);
      // NaN stays NaN, and so does the sum.
      std::vector<float> nan_row = {-1.0f, std::numeric_limits<float>::quiet_NaN(), -2.0f};
      for (int64_t n : {int64_t{3}, int64_t{2}}) {
        EXPECT_TRUE(std::isnan(ops.exp_sum(nan_row.data(), n, 0.0f, round_bf16)));
        EXPECT_TRUE(std::isnan(nan_row[1]));
      }
    }
  });
}

TEST(SimdSoftcap, MatchesTanh) {
  std::mt19937 rng(3);
  for_each_target([&](const simd::Ops& ops) {
    for (float cap : {0.5f, 30.0f}) {
      for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
        fill(row, n, -4.0f * cap, 4.0f * cap, rng);
        std::vector<float> in(row.data(), row.data() + n);
        ops.softcap(row.data(), n, cap);
        for (int64_t c = 0; c < n; ++c) {
          const double want = cap * std::tanh(static_cast<double>(in[c]) / cap);
          // Highway's Tanh is within a few float32 ulp; the division and product add one each.
          EXPECT_NEAR(row.at(0, c), want, 8 * std::ldexp(static_cast<double>(cap), -24) + 1e-30)
              << "cap " << cap << ", column " << c;
        }
      });
    }
  });
}

TEST(SimdAlibi, LinearInTheDistance) {
  std::mt19937 rng(4);
  for_each_target([&](const simd::Ops& ops) {
    for (float dist0 : {-37.0f, 0.0f, 5.0f}) {
      for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
        fill(row, n, -1.0f, 1.0f, rng);
        std::vector<float> in(row.data(), row.data() + n);
        const float slope = 0.3f;
        ops.alibi(row.data(), n, slope, dist0);
        for (int64_t c = 0; c < n; ++c) {
          const double want = in[c] - slope * std::abs(static_cast<double>(dist0) + c);
          // One FMA of exact operands (integer distances): one rounding of |want| + |in|.
          EXPECT_NEAR(row.at(0, c), want, std::ldexp(std::abs(want) + 1.0, -23))
              << "dist0 " << dist0 << ", column " << c;
        }
      });
    }
  });
}

TEST(SimdAdd, ExactFloatSum) {
  std::mt19937 rng(5);
  for_each_target([&](const simd::Ops& ops) {
    for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
      fill(row, n, -1.0f, 1.0f, rng);
      GuardedBuffer bias(1, n + 2 * ops.lanes, 3);
      fill(bias, n, -1.0f, 1.0f, rng);
      std::vector<float> in(row.data(), row.data() + n);
      bias.seal();
      ops.add(row.data(), bias.data(), n);
      for (int64_t c = 0; c < n; ++c) EXPECT_EQ(row.at(0, c), in[c] + bias.at(0, c)) << c;
      EXPECT_EQ(bias.unchanged(), "") << "bias written";
    });
  });
}

TEST(SimdMul, ExactFloatProduct) {
  std::mt19937 rng(6);
  for_each_target([&](const simd::Ops& ops) {
    for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
      fill(row, n, -1.0f, 1.0f, rng);
      GuardedBuffer scale(1, n + 2 * ops.lanes, 3);
      fill(scale, n, 0.0f, 4.0f, rng);
      std::vector<float> in(row.data(), row.data() + n);
      scale.seal();
      ops.mul(row.data(), scale.data(), n);
      for (int64_t c = 0; c < n; ++c) EXPECT_EQ(row.at(0, c), in[c] * scale.at(0, c)) << c;
      EXPECT_EQ(scale.unchanged(), "") << "scale written";
    });
  });
}

// The canaries past n are NaN, so a classify that read past n would report kNonFinite.
TEST(SimdClassify, SeesEveryPositionAndNothingPastN) {
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kTiny = std::numeric_limits<float>::denorm_min();
  const float kSmallest = std::numeric_limits<float>::min();  // normal
  for_each_target([&](const simd::Ops& ops) {
    for_each_row(ops, [&](GuardedBuffer& row, int64_t n) {
      for (int64_t c = 0; c < n; ++c) row.at(0, c) = c % 3 ? static_cast<float>(c) - 3.5f : 0.0f;
      if (n > 1) row.at(0, n - 1) = -kSmallest;  // normal, however small
      EXPECT_EQ(ops.classify(row.data(), n), 0u) << "normal and zero (canary NaN past n)";
      for (int64_t at = 0; at < n; ++at) {
        const float saved = row.at(0, at);
        for (float bad : {kNaN, kInf, -kInf}) {
          row.at(0, at) = bad;
          EXPECT_EQ(ops.classify(row.data(), n), simd::kNonFinite) << bad << " at " << at;
        }
        for (float tiny : {kTiny, -kTiny, std::nextafter(kSmallest, 0.0f)}) {
          row.at(0, at) = tiny;
          EXPECT_EQ(ops.classify(row.data(), n), simd::kSubnormal) << tiny << " at " << at;
        }
        row.at(0, at) = kNaN;
        if (n > 1) row.at(0, (at + 1) % n) = kTiny;
        EXPECT_EQ(ops.classify(row.data(), n),
                  n > 1 ? simd::kNonFinite | simd::kSubnormal : simd::kNonFinite);
        if (n > 1) row.at(0, (at + 1) % n) = (at + 1) % n == n - 1 ? -kSmallest : 1.0f;
        row.at(0, at) = saved;
      }
    });
  });
}

}  // namespace
}  // namespace flashcte::test
