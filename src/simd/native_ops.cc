// The native bfloat16 matmuls (native_ops.h) on vdpbf16ps, and the policy that decides where they
// run.
//
// Register tiles: R rows x W zmm accumulators (16 W float32 lanes of S or O per row); per step
// of the contraction, which covers two of its indices, W loads of K2 or V2 pairs and one 32-bit
// broadcast of a Q2 or P2 pair per row feed R W vdpbf16ps of 64 FLOPs each. MM1 runs 4 x 4
// (bytes from L1 per FLOP: (4 x 64 + 4 x 4) / (16 x 64) = 0.27), MM2 8 x 2 (0.16).
// The loop order is the float32 kernels' (mm1-inl.h, mm2-inl.h): column panel outer, row blocks
// inner, so a panel of K2 or V2 stays in L1 while the rows stream past it.
//
// Every function that runs AVX-512 instructions carries FLASHCTE_AVX512_BF16, so no AVX-512 code
// reaches the rest of the build, and nothing here runs unless native_available() said the CPU has
// it.
#include "src/simd/native_ops.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "hwy/detect_targets.h"
#include "src/core/cpu.h"
#include "src/simd/decode_native_pv-inl.h"
#include "src/simd/exp_common.h"
#include "src/simd/ops.h"
#include "src/simd/row_blocks.h"

#if HWY_ARCH_X86
#include <immintrin.h>
#endif

namespace flashcte::simd {
namespace {

#if HWY_ARCH_X86

#define FLASHCTE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// The register tiles and the lambdas of their unrolled loops (`unrolled`) are always inlined: a
// lambda left out of line makes every step of the contraction a call.
#define FLASHCTE_LAMBDA_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline))
#define FLASHCTE_INLINE_BF16 FLASHCTE_LAMBDA_BF16 inline
// One register tile's call, kept out of line: with every tile size inlined into qk (what GCC 12
// does once the row-block loop is always inlined) MM1 ran 12% slower (qk_bf16_native/64 and
// /128, bench/micro_kernels, 4 interleaved runs each, Intel Xeon with AVX512_BF16, AVX3).
#define FLASHCTE_PANEL_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), noinline))

constexpr int64_t kLanes = 16;  // float32 lanes of a zmm register
// W1 of ops.h for this file's vectors: the padding unit holds whole zmm vectors of float32.
static_assert(kPadFloats % kLanes == 0, "W1: the padding unit must hold whole zmm vectors");

// The register tiles, rows x zmm columns. Both used to be 8 x 2 (6 to 14 rows measured the same
// within 3% at 2 columns, bench/micro_kernels). With the accumulators in registers (`unrolled`),
// MM1 on 4 x 4 ran 2.3-3.8% faster than 8 x 2 over the whole kernel, 4 x 6 the same as 4 x 4, 5 x 4
// and 2 x 8 2% slower (in one process, calls alternating, 14-20 pairs; bf16 MHA S=4096 d=128, 2
// threads, AMD EPYC Zen 4); 4 x 4 also won causal (+3.2%), GQA 32:8 S=2048 (+3.7%), d=64 (+2.7%)
// and d=256 (+2.6%). MM2 on 6 x 4, 8 x 3 and 4 x 4 measured within 0.4% of 8 x 2, which stays.
constexpr int64_t kQkRows = 4, kQkVectors = 4, kQkCols = kQkVectors * kLanes;
constexpr int64_t kPvRows = 8, kPvVectors = 2, kPvCols = kPvVectors * kLanes;
// Rows of S whose max vectors one group keeps on the stack (as mm1-inl.h).
constexpr int64_t kMaxGroupRows = 48;
// Pairs of the contraction per K2 panel pass: 64 pairs x 64 columns x 4 bytes = 16 KiB stays in
// L1 whatever the head dim (the d-tiling of mm1-inl.h, 128 head-dim entries).
constexpr int64_t kPairTile = 64;

// _mm512_max_ps through its zero-masked form: GCC 12's unmasked one passes an undefined vector
// as the merge source, which -Wmaybe-uninitialized reports (fixed in GCC 13). With every lane
// selected it computes the same.
constexpr __mmask16 kAll = 0xFFFF;
FLASHCTE_AVX512_BF16 inline __m512 max_ps(__m512 a, __m512 b) {
  return _mm512_maskz_max_ps(kAll, a, b);
}

// body(std::integral_constant<int64_t, i>()) for i = 0, ..., N - 1, unrolled at compile time.
// The register tiles index their accumulator arrays only this way. Over runtime loops GCC 12 kept
// `__m512 acc[8][2]` on the stack around the contraction (16 stores and 16 loads on each side of
// it per panel); with constant indices it stays in registers.
template <class Body, int64_t... I>
FLASHCTE_INLINE_BF16 void unrolled(const Body& body, std::integer_sequence<int64_t, I...>) {
  (body(std::integral_constant<int64_t, I>()), ...);
}
template <int64_t N, class Body>
FLASHCTE_INLINE_BF16 void unrolled(const Body& body) {
  unrolled(body, std::make_integer_sequence<int64_t, N>());
}

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return pair;
}

// body(std::integral_constant<int64_t, W>()) with W = min(vectors, kW), vectors >= 1: the panel
// width for the columns that are left (W2/W3: never past the last vector that holds one).
template <int64_t kW, class Body>
inline void with_panel_width(int64_t vectors, const Body& body) {
  if constexpr (kW > 1) {
    if (vectors < kW) return with_panel_width<kW - 1>(vectors, body);
  }
  body(std::integral_constant<int64_t, kW>());
}

// MM1 panel of kCols zmm columns for R rows over pairs [0, pairs): acc (+)= Q2 . K2; on the last
// pair tile the scores are scaled, stored and (max_vecs non-null) folded into the max vectors.
template <int64_t R, int64_t kCols>
FLASHCTE_INLINE_BF16 void qk_panel(const uint16_t* q, int64_t ldq, const uint32_t* k, int64_t ldk,
                                   int64_t pairs, bool accumulate, bool last, float scale, float* s,
                                   int64_t lds, int64_t valid, float* max_vecs) {
  __m512 acc[R][kCols];
  unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
    unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
      acc[r][c] = accumulate ? _mm512_loadu_ps(s + r * lds + c * kLanes) : _mm512_setzero_ps();
    });
  });
  for (int64_t x = 0; x < pairs; ++x) {
    __m512i b[kCols];
    unrolled<kCols>(
        [&](auto c) FLASHCTE_LAMBDA_BF16 { b[c] = _mm512_loadu_si512(k + x * ldk + c * kLanes); });
    unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(load_pair(q + r * ldq + 2 * x)));
      unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
      });
    });
  }
  if (!last) {
    unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
      unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
        _mm512_storeu_ps(s + r * lds + c * kLanes, acc[r][c]);
      });
    });
    return;
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 valid_lanes[kCols];
  unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
    const int64_t lanes = std::clamp<int64_t>(valid - c * kLanes, 0, kLanes);
    valid_lanes[c] = static_cast<__mmask16>((uint32_t{1} << lanes) - 1u);
  });
  unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
    __m512 m = neg_inf;
    unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
      const __m512 v = _mm512_mul_ps(acc[r][c], vscale);
      _mm512_storeu_ps(s + r * lds + c * kLanes, v);
      // Argument order as Highway's Max (mm1-inl.h), so NaN scores meet the max as they do there.
      m = max_ps(m, _mm512_mask_blend_ps(valid_lanes[c], neg_inf, v));
    });
    if (max_vecs) {
      float* mv = max_vecs + r * kLanes;
      _mm512_storeu_ps(mv, max_ps(_mm512_loadu_ps(mv), m));
    }
  });
}

FLASHCTE_AVX512_BF16 void qk(const uint16_t* q, int64_t ldq, int64_t rows, const uint32_t* k,
                             int64_t ldk, int64_t cols, int64_t d2, float scale, float* s,
                             int64_t lds, float* row_max) {
  alignas(64) float max_vecs[kMaxGroupRows * kLanes];
  const int64_t pairs = d2 / 2;
  for (int64_t g = 0; g < rows; g += kMaxGroupRows) {
    const int64_t group_rows = std::min(kMaxGroupRows, rows - g);
    float* mv = row_max ? max_vecs : nullptr;
    if (mv) std::fill(mv, mv + group_rows * kLanes, -std::numeric_limits<float>::infinity());
    for (int64_t x0 = 0; x0 < pairs; x0 += kPairTile) {
      const int64_t xn = std::min(kPairTile, pairs - x0);
      const bool accumulate = x0 > 0, last = x0 + xn == pairs;
      for (int64_t c = 0; c < cols; c += kQkCols) {
        const int64_t vectors = (cols - c + kLanes - 1) / kLanes;
        with_panel_width<kQkVectors>(vectors, [&](auto width) FLASHCTE_AVX512_BF16 {
          ForEachRowBlock<kQkRows>(group_rows, [&](auto block, int64_t r) FLASHCTE_PANEL_BF16 {
            qk_panel<decltype(block)::value, decltype(width)::value>(
                q + (g + r) * ldq + 2 * x0, ldq, k + x0 * ldk + c, ldk, xn, accumulate, last, scale,
                s + (g + r) * lds + c, lds, cols - c, mv ? mv + r * kLanes : nullptr);
          });
        });
      }
    }
    if (mv) {
      for (int64_t r = 0; r < group_rows; ++r) {
        const float* lanes = mv + r * kLanes;
        for (int64_t l = 0; l < kLanes; ++l) row_max[g + r] = std::max(row_max[g + r], lanes[l]);
      }
    }
  }
}

// MM2 panel of kCols zmm columns for R rows: O = alpha O + P2 . V2 over pairs [0, pairs).
template <int64_t R, int64_t kCols>
FLASHCTE_INLINE_BF16 void pv_panel(const uint16_t* p, int64_t ldp, int64_t pairs, const uint32_t* v,
                                   int64_t ldv, const float* alpha, float* o, int64_t ldo) {
  __m512 acc[R][kCols];
  unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
    const __m512 al = _mm512_set1_ps(alpha ? alpha[r] : 1.0f);
    unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
      acc[r][c] = _mm512_loadu_ps(o + r * ldo + c * kLanes);
      if (alpha) acc[r][c] = _mm512_mul_ps(acc[r][c], al);
    });
  });
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i b[kCols];
    unrolled<kCols>(
        [&](auto c) FLASHCTE_LAMBDA_BF16 { b[c] = _mm512_loadu_si512(v + j * ldv + c * kLanes); });
    unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(load_pair(p + r * ldp + 2 * j)));
      unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
      });
    });
  }
  unrolled<R>([&](auto r) FLASHCTE_LAMBDA_BF16 {
    unrolled<kCols>([&](auto c) FLASHCTE_LAMBDA_BF16 {
      _mm512_storeu_ps(o + r * ldo + c * kLanes, acc[r][c]);
    });
  });
}

FLASHCTE_AVX512_BF16 void pv(const uint16_t* p, int64_t ldp, int64_t rows, int64_t n2,
                             const uint32_t* v, int64_t ldv, int64_t dv_pad, const float* alpha,
                             float* o, int64_t ldo) {
  const int64_t pairs = n2 / 2;
  for (int64_t c = 0; c < dv_pad; c += kPvCols) {
    with_panel_width<kPvVectors>((dv_pad - c) / kLanes, [&](auto width) FLASHCTE_AVX512_BF16 {
      ForEachRowBlock<kPvRows>(rows, [&](auto block, int64_t r) FLASHCTE_PANEL_BF16 {
        pv_panel<decltype(block)::value, decltype(width)::value>(
            p + r * ldp, ldp, pairs, v + c, ldv, alpha ? alpha + r : nullptr, o + r * ldo + c, ldo);
      });
    });
  }
}

// exp(x) for x = s + bias <= 0: softmax-inl.h's ExpNonPositive at degree 4, bit for bit (same
// constants, the same rounded operations where it matters), in 5 fewer instructions per vector
// (Zen 4 EPYC: the exp-and-sum was 9% of a bf16 run). 2^n by vscalefps rather than the shift
// into the exponent field: for x >= kLowest, n >= -126 and p 2^n is normal (p > 1 at n = -126),
// where both are exact. Below kLowest vscalefps is still defined (a subnormal, 0, or NaN from
// -inf), and those lanes are zeroed as ExpNonPositive's, so neither its clamp to kLowest nor its
// NaN blend is needed: a NaN x (quiet: it is the sum s + bias) passes through the FMAs and
// vscalefps as their NaN source and comes out as x, as the blend gives.
FLASHCTE_AVX512_BF16 inline __m512 exp_non_positive(__m512 x) {
  namespace k = exp_constants;
  const __m512 shifter = _mm512_set1_ps(k::kShifter);
  const __m512 f = _mm512_fmadd_ps(x, _mm512_set1_ps(k::kLog2e), shifter);
  const __m512 n = _mm512_sub_ps(f, shifter);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(k::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(k::kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(k::kDegree4[0]), r, _mm512_set1_ps(k::kDegree4[1]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k::kDegree4[2]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k::kDegree4[3]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(k::kLowest), _CMP_LT_OQ);
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~below), p, n);
}

// One step of the native exp-and-sum on the lanes of `mask`: P stored as bfloat16 by
// vcvtneps2bf16 (round to nearest even, as RoundToBf16) in one instruction where the portable
// pass spends seven.
FLASHCTE_AVX512_BF16 inline __m512 exp_step(const float* s, __m512 bias, __mmask16 mask,
                                            uint16_t* p2) {
  const __m512 e = exp_non_positive(_mm512_add_ps(_mm512_maskz_loadu_ps(mask, s), bias));
  _mm256_mask_storeu_epi16(p2, mask, (__m256i)_mm512_cvtneps_pbh(e));
  return e;
}

// Ops::exp_sum's bfloat16 pass with the terms summed in its order (softmax-inl.h's ExpSumImpl:
// two accumulators, one more vector, sum_lanes, then the tail lane by lane), so that a section
// that widens and one that does not agree bit for bit on the sum.
FLASHCTE_AVX512_BF16 float exp_sum(const float* s, int64_t n, float bias, uint16_t* p2) {
  const __m512 vbias = _mm512_set1_ps(bias);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 * kLanes <= n; c += 2 * kLanes) {
    sum0 = _mm512_add_ps(sum0, exp_step(s + c, vbias, kAll, p2 + c));
    sum1 = _mm512_add_ps(sum1, exp_step(s + c + kLanes, vbias, kAll, p2 + c + kLanes));
  }
  for (; c + kLanes <= n; c += kLanes)
    sum0 = _mm512_add_ps(sum0, exp_step(s + c, vbias, kAll, p2 + c));
  alignas(64) float lanes[kLanes];
  _mm512_store_ps(lanes, _mm512_add_ps(sum0, sum1));
  float total = sum_lanes(lanes, kLanes);
  if (c < n) {
    const __mmask16 tail = static_cast<__mmask16>((uint32_t{1} << (n - c)) - 1u);
    _mm512_store_ps(lanes, exp_step(s + c, vbias, tail, p2 + c));
    for (int64_t l = 0; l < n - c; ++l) total += lanes[l];
  }
  return total;
}

// The native kernels need AVX-512 with VNNI (the int8 decode kernels, decode_native-inl.h; every
// CPU with BF16 has it) and BF16 (src/core/cpu.h).
bool native_available() {
  const internal::CpuFeatures& cpu = internal::cpu_features();
  return cpu.avx512_vnni && cpu.avx512_bf16;
}

// The automatic choice: native on AMD, widening elsewhere. Measured with back-to-back zmm
// instructions, one thread: AMD EPYC (Zen 4) vdpbf16ps 234 GFLOP/s against 117 for float32 FMA;
// an Intel Xeon with AVX512_BF16 (issue 11) 168 against 345 (two threads), where widening wins.
bool native_pays() { return internal::cpu_features().vendor == internal::CpuVendor::kAmd; }

constexpr NativeOps kNativeOps = [] {
  NativeOps t{};
  t.lanes = kLanes;
  t.qk_rows = kQkRows;
  t.qk_cols = kQkCols;
  t.pv_rows = kPvRows;
  t.pv_cols = kPvCols;
  t.qk = &qk;
  t.pv = &pv;
  t.exp_sum = &exp_sum;
  t.decode_qk = &decode_native::Qk;
  t.decode_pv = &decode_native::Pv;
  return t;
}();

#endif  // HWY_ARCH_X86

Bf16Dot policy_from_env() {
  const char* env = std::getenv("FLASHCTE_BF16_DOT");
  const std::string value = env ? env : "";
  if (value == "native") return Bf16Dot::kNative;
  if (value == "widen") return Bf16Dot::kWiden;
  return Bf16Dot::kAuto;
}

[[maybe_unused]] Bf16Dot& policy() {
  static Bf16Dot current = policy_from_env();
  return current;
}

}  // namespace

const NativeOps* native_ops_for(const Ops& ops) {
#if HWY_ARCH_X86
  static const bool available = native_available();
  static const bool pays = native_pays();
  if (!available || (ops.target_bits & (HWY_AVX3 | HWY_AVX3_DL)) == 0) return nullptr;
  switch (policy()) {
    case Bf16Dot::kNative:
      return &kNativeOps;
    case Bf16Dot::kWiden:
      return nullptr;
    case Bf16Dot::kAuto:
      return pays ? &kNativeOps : nullptr;
  }
#endif
  (void)ops;
  return nullptr;
}

void set_bf16_dot_policy_for_test(Bf16Dot p) { policy() = p; }

}  // namespace flashcte::simd
