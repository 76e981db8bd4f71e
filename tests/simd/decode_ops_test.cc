// Testers of the decode micro-kernels (decode_qk, decode_pv of src/simd/ops.h) on every SIMD
// target this CPU runs, for K / V rows of float32, bfloat16 and float16 read in place: head dims,
// value dims and key counts at every vector edge of the target (1, N-1, N, N+1, ...), row counts
// on both sides of the register tiles, tight and loose row strides, canary NaNs around every
// buffer and in the cache rows' padding (a value read past the contract turns a result into NaN),
// and a float64 reference (the cases: decode_cases.h). Rows ending at an unreadable page and the
// native kernels: decode_ops_limits_test.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"
#include "tests/cpu_requirements.h"
#include "tests/simd/decode_cases.h"
#include "tests/simd/tester.h"

namespace flashcte::test {
namespace {

TEST(SimdDecodeQk, EveryHeadDimKeyEdgeAndDtype) {
  std::mt19937 rng(11);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t d : dims(ops.lanes)) {
        for (int64_t n : edge_lengths(ops.lanes)) QkCase{dtype, 4, n, d, 0}.run(ops, rng);
      }
    }
  });
}

TEST(SimdDecodeQk, EveryRowCountAndStride) {
  std::mt19937 rng(12);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 32}) {
        for (int64_t ld_extra : {0, 1, 7}) {
          for (bool reversed : {false, true}) {
            QkCase{dtype, rows, 2 * ops.lanes + 3, ops.lanes + 5, ld_extra, false, reversed}.run(
                ops, rng);
          }
        }
      }
    }
  });
}

TEST(SimdDecodePv, EveryValueDimKeyEdgeAndDtype) {
  std::mt19937 rng(13);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t dv : dims(ops.lanes)) {
        for (int64_t n : edge_lengths(ops.lanes)) PvCase{dtype, 4, n, dv, 0, true}.run(ops, rng);
      }
      PvCase{dtype, 4, 0, 2 * ops.lanes + 1, 0, true}.run(ops, rng);  // no key: O = alpha O
    }
  });
}

// Every panel shape decode_pv-inl.h compiles: k whole vectors for k up to two panels, alone and
// with a column tail, at one row per KV head (where the tail joins the last panel) and at 2 and 4
// rows (where it is a panel of its own).
TEST(SimdDecodePv, EveryPanelWidthWithAndWithoutATail) {
  std::mt19937 rng(16);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t rows : {1, 2, 4}) {
        for (int64_t k = 0; k <= 16; ++k) {
          for (int64_t tail : {int64_t{0}, ops.lanes / 2 + 1}) {
            if (k * ops.lanes + tail == 0) continue;
            PvCase{dtype, rows, 2 * ops.lanes + 1, k * ops.lanes + tail, 0, rows != 2}.run(ops,
                                                                                           rng);
          }
        }
      }
    }
  });
}

TEST(SimdDecodePv, EveryRowCountStrideAndAlphaMode) {
  std::mt19937 rng(14);
  for_each_target([&](const simd::Ops& ops) {
    for (DType dtype : kDtypes) {
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 32}) {
        for (int64_t ld_extra : {0, 1, 7}) {
          for (bool with_alpha : {false, true}) {
            PvCase{dtype,    rows,       ops.lanes + 3, 9 * ops.lanes + 3,
                   ld_extra, with_alpha, false,         with_alpha}
                // reversed with alpha, in place without
                .run(ops, rng);
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace flashcte::test
