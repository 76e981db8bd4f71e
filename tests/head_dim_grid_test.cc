// Every head dim class on every SIMD target (issue 10). The micro-kernels step over the padded
// head dim d (MM1) and value dim dv (MM2) in panels of one or two vectors, whose width differs per
// target (4 floats on SSE4/SSSE3, 8 on AVX2, 16 on AVX-512, 1 on SCALAR); a dim that is not a
// multiple of a target's panel takes a tail path that only that target has. So every d and dv
// in 1..160 (all residues modulo 32 several times over, the dims of real models) and every 16th one
// up to 576 (the large-d and MLA heads) runs here, in every dtype, through every masking path, on
// every target this CPU can run (hwy::SetSupportedTargetsForTest: the kernel's dispatch follows
// it), against the float64 reference with the suite's tolerances (test_util.cc). bfloat16 cases
// on an AVX-512 target of a CPU with AVX512_BF16 run both bf16 matmul paths, native and widened.
//
// The design is a covering array, built deterministically below:
//   HeadDimGridSmall  d in 1..160. For path p, dv = D[(i + kSmallOffset[p]) mod 160] for d = D[i]
//                     (a bijection per path, never d == dv), dtype = (i + p) mod 3. So every d and
//                     every dv meets every path (7 cases each) and every dtype, and every
//                     (path, dtype) pair has cases with d < dv and with d > dv. 1120 cases.
//   HeadDimGridLarge  each d in 176, 192, ..., 576 once per path with a partner dv drawn from all
//                     dims (small or large), and each such dim once per path as dv with a small
//                     partner d; dtypes rotate so every large dim meets every dtype both ways.
//                     364 cases.
// HeadDimGridDesign.Covers checks these properties, so editing the tables cannot silently drop a
// class. Test names carry the parameters (d37_dv53_bfloat16_prefix); a failure message adds the
// target and the full case (shape, options, tiles, seed).
//
// The float64 reference runs once per case and serves every target (the inputs are the same:
// build_tensors() is deterministic); it is nearly all of the cost (tests/CMakeLists.txt).
#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "src/simd/native_ops.h"
#include "src/simd/ops.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

enum class Path { kNonCausal, kCausal, kPrefix, kWindow, kSink, kCpContiguous, kCpStrided };
constexpr int kNumPaths = 7;
constexpr std::array<Path, kNumPaths> kPaths = {
    Path::kNonCausal, Path::kCausal,       Path::kPrefix,   Path::kWindow,
    Path::kSink,      Path::kCpContiguous, Path::kCpStrided};
constexpr std::array<DType, 3> kDtypes = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

const char* path_name(Path p) {
  switch (p) {
    case Path::kNonCausal:
      return "noncausal";
    case Path::kCausal:
      return "causal";
    case Path::kPrefix:
      return "prefix";
    case Path::kWindow:
      return "window";
    case Path::kSink:
      return "sink";
    case Path::kCpContiguous:
      return "cp_contiguous";
    case Path::kCpStrided:
      return "cp_strided";
  }
  return "?";
}

// The small dims: every value 1..160. The large ones: every 16th after that, up to 576.
std::vector<int64_t> small_dims() {
  std::vector<int64_t> dims;
  for (int64_t d = 1; d <= 160; ++d) dims.push_back(d);
  return dims;
}
std::vector<int64_t> large_dims() {
  std::vector<int64_t> dims;
  for (int64_t d = 176; d <= 576; d += 16) dims.push_back(d);
  return dims;
}

// dv's shift from d per path, in the small grid: a mix of near (3, -5: the same panel or the
// next) and far (50 .. 101: a small d with a wide dv and back), one of 16 (the same residue mod 16,
// the other one mod 32). Chosen so that every dv meets every dtype (checked in Covers; e.g. 17
// instead of 16 leaves dv 90..101 without one dtype each).
constexpr std::array<int64_t, kNumPaths> kSmallOffset = {3, -5, 16, -33, 50, -71, 101};

struct GridCase {
  int64_t d, dv;
  DType dtype;
  Path path;
  int serial;  // position in its grid: seeds the shape, the inputs and the tiling
};

std::string case_name(const GridCase& g) {
  return "d" + std::to_string(g.d) + "_dv" + std::to_string(g.dv) + "_" + dtype_name(g.dtype) +
         "_" + path_name(g.path);
}

// What GoogleTest prints for GetParam() (the default would dump the struct's bytes).
void PrintTo(const GridCase& g, std::ostream* os) { *os << case_name(g); }

std::vector<GridCase> small_grid() {
  const std::vector<int64_t> dims = small_dims();
  const int64_t n = static_cast<int64_t>(dims.size());
  std::vector<GridCase> grid;
  for (int64_t i = 0; i < n; ++i) {
    for (int p = 0; p < kNumPaths; ++p) {
      const int64_t j = ((i + kSmallOffset[p]) % n + n) % n;
      grid.push_back(
          {dims[i], dims[j], kDtypes[(i + p) % 3], kPaths[p], static_cast<int>(grid.size())});
    }
  }
  return grid;
}

std::vector<GridCase> large_grid() {
  const std::vector<int64_t> small = small_dims(), large = large_dims();
  std::vector<int64_t> all = small;
  all.insert(all.end(), large.begin(), large.end());
  const int64_t n_all = static_cast<int64_t>(all.size());
  const int64_t n_small = static_cast<int64_t>(small.size());
  std::vector<GridCase> grid;
  for (int64_t i = 0; i < static_cast<int64_t>(large.size()); ++i) {
    for (int p = 0; p < kNumPaths; ++p) {
      // d large, dv any other dim (multipliers coprime to the sizes spread the partners).
      int64_t a = (i * 29 + p * 41 + 7) % n_all;
      if (all[a] == large[i]) a = (a + 1) % n_all;
      grid.push_back(
          {large[i], all[a], kDtypes[(i + p) % 3], kPaths[p], static_cast<int>(grid.size())});
      // d small, dv large.
      const int64_t b = (i * 23 + p * 37 + 5) % n_small;
      grid.push_back(
          {small[b], large[i], kDtypes[(i + p + 1) % 3], kPaths[p], static_cast<int>(grid.size())});
    }
  }
  return grid;
}

// The case a grid point stands for. Shapes are small and never multiples of 8: Sq in 23..53 and
// Skv in 41..101 (17..37 and 30..71 with a dim above 160; CP: about 2 Sq), so every target meets
// ragged row blocks and column tails; every other case uses the small odd tiles (5 x 24, 48-key
// sections) for multi-tile sections. bs = 2, with one K/V head for both (MQA) on three paths.
Case make_case(const GridCase& g) {
  Case c;
  c.dtype = g.dtype;
  c.bs = 2;
  c.bs_kv = 2;
  c.d = g.d;
  c.dv = g.dv;
  const int s = g.serial;
  // The float64 reference (twice for bfloat16 / float16: exact and same-precision) is nearly all
  // of the cost, in proportion to Sq * Skv * (d + dv); cases with a dim above 160 take shorter
  // sequences, which still span several odd tiles.
  if (std::max(g.d, g.dv) <= 160) {
    c.sq = 23 + (s * 7) % 30;    // 23 .. 52
    c.skv = 41 + (s * 13) % 60;  // 41 .. 100
  } else {
    c.sq = 17 + (s * 7) % 20;    // 17 .. 36
    c.skv = 30 + (s * 13) % 41;  // 30 .. 70
  }
  if (c.sq % 8 == 0) ++c.sq;
  if (c.skv % 8 == 0) ++c.skv;
  // Normal inputs and 1/sqrt(d): logits of order 1 at every d, so the softmax spreads over many
  // keys and a wrong column of V or a dropped P entry shows in the output.
  c.dist = Dist::kNormal;
  c.options.scale = static_cast<float>(1 / std::sqrt(static_cast<double>(g.d)));
  c.options.causal_mask = true;
  c.lse = true;
  if (s % 2 == 1) c.options.tiles = odd_tiles();
  c.seed = static_cast<uint64_t>(s) * 7919 + static_cast<uint64_t>(g.d) * 131 +
           static_cast<uint64_t>(g.dv);
  switch (g.path) {
    case Path::kNonCausal:
      c.options.causal_mask = false;
      c.bs_kv = 1;  // MQA: both query heads read one K/V head
      break;
    case Path::kCausal:
      break;
    case Path::kPrefix:
      c.has_prior = true;
      c.s_prior = 19 + s % 23;
      c.options.prior_used_len = {c.s_prior - 1 - s % 5};
      c.bs_kv = 1;
      break;
    case Path::kWindow:
      c.options.sliding_window = 9 + s % 31;
      c.stats = StatsLayout::kRowMajor;
      break;
    case Path::kSink:
      // Of the order of a row's largest logit (~2 to 3 here), so neither side dominates.
      c.sink = true;
      c.sink_lo = -1;
      c.sink_hi = 3;
      c.stats = StatsLayout::kRowMajor;
      break;
    case Path::kCpContiguous:
      // Rank 1 of 2: local rows at global positions [Sq, 2 Sq); the 3 keys past the last one are
      // causally masked for every row.
      c.options.global_cp_deg = 2;
      c.options.cp_offset = c.sq;
      c.skv = 2 * c.sq + 3;
      break;
    case Path::kCpStrided:
      // Rank 1 of 2, strided: local row i is global row 1 + 2 i.
      c.options.global_cp_deg = 2;
      c.options.cp_offset = 1;
      c.options.cp_strided_q_slicing = true;
      c.skv = 2 * c.sq + 1;
      c.bs_kv = 1;
      break;
  }
  return c;
}

// Restores Highway's own target choice however the test exits (ASSERTs return early).
class TargetOverride {
 public:
  explicit TargetOverride(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~TargetOverride() { hwy::SetSupportedTargetsForTest(0); }
  TargetOverride(const TargetOverride&) = delete;
  TargetOverride& operator=(const TargetOverride&) = delete;
};

// Likewise for the bfloat16 matmul policy (src/simd/native_ops.h).
class Bf16PolicyOverride {
 public:
  explicit Bf16PolicyOverride(simd::Bf16Dot policy) { simd::set_bf16_dot_policy_for_test(policy); }
  ~Bf16PolicyOverride() { simd::set_bf16_dot_policy_for_test(simd::Bf16Dot::kAuto); }
  Bf16PolicyOverride(const Bf16PolicyOverride&) = delete;
  Bf16PolicyOverride& operator=(const Bf16PolicyOverride&) = delete;
};

// The kernels a case runs on the current target: one, except bfloat16 on an AVX-512 target of a
// CPU with AVX512_BF16, which has two (native vdpbf16ps MM1/MM2 with their own bf16-pair layouts,
// and widening to float32); the automatic policy takes one of them per vendor, so both run here.
std::vector<simd::Bf16Dot> bf16_policies(DType dtype) {
  if (dtype != DType::kBFloat16) return {simd::Bf16Dot::kAuto};
  const Bf16PolicyOverride native(simd::Bf16Dot::kNative);
  if (simd::native_ops_for(simd::ops()) == nullptr) return {simd::Bf16Dot::kAuto};
  return {simd::Bf16Dot::kNative, simd::Bf16Dot::kWiden};
}

const char* policy_name(simd::Bf16Dot policy) {
  switch (policy) {
    case simd::Bf16Dot::kNative:
      return " (bf16 native)";
    case simd::Bf16Dot::kWiden:
      return " (bf16 widened)";
    case simd::Bf16Dot::kAuto:
      return "";
  }
  return "";
}

class HeadDimGridTest : public ::testing::TestWithParam<GridCase> {};

TEST_P(HeadDimGridTest, MatchesReferenceOnEveryTarget) {
  const Case c = make_case(GetParam());
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  Outcome first;  // the reference outputs, computed with the first run
  bool have_reference = false;
  for (int64_t target : targets) {
    const TargetOverride override_target(target);
    const char* name = hwy::TargetName(target);
    // The kernel really dispatched to this target (not to the best one regardless).
    ASSERT_EQ(simd_target(), name);
    for (simd::Bf16Dot policy : bf16_policies(c.dtype)) {
      const Bf16PolicyOverride override_policy(policy);
      Outcome o = run_case(c, /*skip_reference=*/have_reference);
      ASSERT_TRUE(o.status.ok) << name << policy_name(policy) << ": " << o.status.message << "\n"
                               << c.describe();
      if (!have_reference) {
        first = o;
        have_reference = true;
      } else {
        o.exact = first.exact;
        o.plain = first.plain;
      }
      EXPECT_TRUE(compare(c, o)) << "target " << name << policy_name(policy);
    }
  }
}

auto param_name = [](const ::testing::TestParamInfo<GridCase>& info) {
  return case_name(info.param);
};

INSTANTIATE_TEST_SUITE_P(HeadDimGridSmall, HeadDimGridTest, ::testing::ValuesIn(small_grid()),
                         param_name);
INSTANTIATE_TEST_SUITE_P(HeadDimGridLarge, HeadDimGridTest, ::testing::ValuesIn(large_grid()),
                         param_name);

// The covering properties the header promises. Fails if an edit of the tables or of the index
// arithmetic leaves a (dim, path) or (dim, dtype) pair out.
TEST(HeadDimGridDesign, Covers) {
  const std::vector<GridCase> small = small_grid(), large = large_grid();
  // (dim, role, what): role 0 / 1 = the dim as d / as dv with path `what`, role 2 / 3 = as d / as
  // dv with dtype `what`.
  using Key = std::tuple<int64_t, int, int>;
  auto path_index = [](Path p) { return static_cast<int>(p); };
  auto dtype_index = [](DType dt) {
    for (int i = 0; i < 3; ++i) {
      if (kDtypes[i] == dt) return i;
    }
    return -1;
  };
  auto check = [&](const std::vector<GridCase>& grid, const std::vector<int64_t>& dims,
                   const char* what) {
    std::set<Key> seen;
    for (const GridCase& g : grid) {
      for (int side = 0; side < 2; ++side) {
        const int64_t dim = side == 0 ? g.d : g.dv;
        seen.insert({dim, side, path_index(g.path)});
        seen.insert({dim, side + 2, dtype_index(g.dtype)});
      }
    }
    for (int64_t dim : dims) {
      for (int side = 0; side < 2; ++side) {
        const char* role = side == 0 ? "d" : "dv";
        for (int p = 0; p < kNumPaths; ++p) {
          EXPECT_TRUE(seen.count({dim, side, p}))
              << what << ": " << role << " = " << dim << " never meets " << path_name(kPaths[p]);
        }
        for (int k = 0; k < 3; ++k) {
          EXPECT_TRUE(seen.count({dim, side + 2, k}))
              << what << ": " << role << " = " << dim << " never meets " << dtype_name(kDtypes[k]);
        }
      }
    }
  };
  check(small, small_dims(), "small grid");
  check(large, large_dims(), "large grid");

  // Both orders of d and dv in every (path, dtype) pair of the small grid; never d == dv.
  std::set<std::tuple<int, int, bool>> order;
  for (const GridCase& g : small) {
    EXPECT_NE(g.d, g.dv) << case_name(g);
    order.insert({path_index(g.path), dtype_index(g.dtype), g.d < g.dv});
  }
  EXPECT_EQ(order.size(), size_t{kNumPaths * 3 * 2});

  // The small grid stays small, so that HeadDimGridSmall alone (ctest -LE head_dim_grid_large,
  // the sanitizer stage's trim) still has every d and dv in 1..160 with every path and dtype; every
  // large case has a dim above 160 (and takes the shorter sequences).
  for (const GridCase& g : small) EXPECT_TRUE(g.d <= 160 && g.dv <= 160) << case_name(g);
  for (const GridCase& g : large) EXPECT_TRUE(g.d > 160 || g.dv > 160) << case_name(g);
  EXPECT_EQ(small.size(), size_t{160 * kNumPaths});
  EXPECT_EQ(large.size(), size_t{26 * kNumPaths * 2});
}

}  // namespace
}  // namespace flashcte::test
