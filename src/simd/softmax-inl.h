// The softmax pieces of one score row: its max (for tiles whose max is not fused into MM1) and
// the fused exp-and-sum, the Neuron activation_reduce: one pass that adds the bias (the negated
// running max), exponentiates and sums, optionally rounding the stored probabilities to bfloat16.
//
// Streaming, no register tile: per score one load, one store and ~20 vector ops (the exp
// polynomial, the clamp, the NaN blend), so 8 bytes per ~20N FLOPs of the exp; at d = 128 it is
// 1/64 of the matmul FLOPs per score but, measured on Zen 3 with AVX2, 6.5% of the cycles.
// Width contract W4 (ops.h): whole vectors while n allows, then one lane at a time.

#if defined(FLASHCTE_SRC_SIMD_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_SOFTMAX_INL_H_
#undef FLASHCTE_SRC_SIMD_SOFTMAX_INL_H_
#else
#define FLASHCTE_SRC_SIMD_SOFTMAX_INL_H_
#endif

#include <cstdint>
#include <limits>

#include "hwy/highway.h"
#include "src/simd/exp_common.h"
#include "src/simd/shared-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

float RowMax(const float* s, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  auto m = hn::Set(df, -std::numeric_limits<float>::infinity());
  int64_t c = 0;
  for (; c + N <= n; c += N) m = hn::Max(m, hn::LoadU(df, s + c));
  float result = hn::GetLane(hn::MaxOfLanes(df, m));
  for (; c < n; ++c) result = s[c] > result ? s[c] : result;
  return result;
}

// exp(x) for the exp-and-sum pass, where x = score - running max <= 0. Highway's Exp serves
// every input range and cost 0.75 ns per element here (Zen 3, one core: 13% of the matmul time
// per score at d = 128); this one serves x <= 88 only (unclamped above, as x <= 0 here) and
// costs 0.43-0.56 ns (best of 30 over 48 x 256 scores, hot caches, 3 runs). n = round(x / ln 2)
// comes from the 1.5 * 2^23 shifter, which also leaves n in the low mantissa bits so that 2^n is
// a shift; r = x - n ln 2 uses ln 2 in two parts (the high part has 15 significant bits, so
// n * kLn2Hi is exact for |n| < 2^9); exp(r) on |r| <= ln(2) / 2 is a polynomial of degree
// kDegree fitted for relative error (Lawson's reweighted least squares): 2.0e-9 at degree 6,
// below float32's half ulp; 2.8e-6 at degree 4, enough where P is rounded to bfloat16 (half an
// ulp: 2e-3 to 4e-3). Below -87 the result is 0: exp(-87) = 1.6e-38 is near float32's smallest
// normal (1.2e-38), and building 2^n in the exponent field needs a normal result. -inf gives 0
// and NaN stays NaN.
//
// On AVX-512, p 2^n is vscalefps, exact wherever the shift is (x >= -87: the result is normal),
// and defined below it (a subnormal, 0, or NaN from -inf) where the result is zeroed anyway; a NaN
// x passes through the FMAs and vscalefps as their NaN source and comes out as x. So the clamp
// and the NaN blend go, and the zeroing is vscalefps's mask: 20 vector instructions become 15,
// and the result is the same bit for bit. Zen 4 EPYC, fp32 MHA S=4096 d=128 non-causal:
// ExpSumImpl 5.7% -> 3.9% of the cycles (perf, 1 thread); interleaved process pairs 1.008 on 1
// thread (8 pairs), 1.003 on 2 (10 pairs), where the time saved mostly went to waiting.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
inline constexpr bool kScalef = true;
// p 2^n in the lanes of `keep`, 0 elsewhere (zero-masked: GCC 12's unmasked forms trip
// -Wmaybe-uninitialized).
template <size_t N>
HWY_INLINE hn::Vec128<float, N> ScalefOrZero(hn::Mask128<float, N> keep, hn::Vec128<float, N> p,
                                             hn::Vec128<float, N> n) {
  return hn::Vec128<float, N>{_mm_maskz_scalef_ps(keep.raw, p.raw, n.raw)};
}
HWY_INLINE hn::Vec256<float> ScalefOrZero(hn::Mask256<float> keep, hn::Vec256<float> p,
                                          hn::Vec256<float> n) {
  return hn::Vec256<float>{_mm256_maskz_scalef_ps(keep.raw, p.raw, n.raw)};
}
HWY_INLINE hn::Vec512<float> ScalefOrZero(hn::Mask512<float> keep, hn::Vec512<float> p,
                                          hn::Vec512<float> n) {
  return hn::Vec512<float>{_mm512_maskz_scalef_ps(keep.raw, p.raw, n.raw)};
}
#else
inline constexpr bool kScalef = false;
#endif

template <int kDegree, class D>
HWY_INLINE hn::Vec<D> ExpNonPositive(D d, hn::Vec<D> x) {
  static_assert(kDegree == 4 || kDegree == 6, "fitted degrees");
  namespace k = exp_constants;
  const auto kLowest = hn::Set(d, k::kLowest);
  const auto kShifter = hn::Set(d, k::kShifter);
  const auto xc = kScalef ? x : hn::Max(x, kLowest);
  const auto f = hn::MulAdd(xc, hn::Set(d, k::kLog2e), kShifter);
  const auto n = hn::Sub(f, kShifter);
  auto r = hn::NegMulAdd(n, hn::Set(d, k::kLn2Hi), xc);
  r = hn::NegMulAdd(n, hn::Set(d, k::kLn2Lo), r);
  const float* coef = kDegree == 6 ? k::kDegree6 : k::kDegree4;
  auto p = hn::MulAdd(hn::Set(d, coef[0]), r, hn::Set(d, coef[1]));
  for (int i = 2; i < kDegree; ++i) p = hn::MulAdd(p, r, hn::Set(d, coef[i]));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  if constexpr (kScalef) {
    return ScalefOrZero(hn::Not(hn::Lt(x, kLowest)), p, n);
  } else {
    // 2^n: f's bits are those of 1.5 * 2^23 plus n, whose low 9 bits shifted into the exponent
    // field give n << 23 (the rest shifts out).
    const hn::RebindToSigned<D> di;
    const auto scaled =
        hn::BitCast(d, hn::Add(hn::BitCast(di, p), hn::ShiftLeft<23>(hn::BitCast(di, f))));
    const auto e = hn::IfThenZeroElse(hn::Lt(x, kLowest), scaled);
    return hn::IfThenElse(hn::IsNaN(x), x, e);
  }
}

template <bool kRoundBf16, class D>
HWY_INLINE hn::Vec<D> ExpStep(D d, float* p, hn::Vec<D> bias) {
  // Degree 4 where P is rounded to bfloat16 anyway (ExpNonPositive).
  constexpr int kDegree = kRoundBf16 ? 4 : 6;
  const auto e = ExpNonPositive<kDegree>(d, hn::Add(hn::LoadU(d, p), bias));
  hn::StoreU(kRoundBf16 ? RoundToBf16(d, e) : e, d, p);  // P is finite and >= 0
  return e;
}

// The lanes are summed in sum_lanes' order (exp_common.h), which the native bf16 exp-and-sum
// (native_ops.cc) shares.
template <bool kRoundBf16>
float ExpSumImpl(float* s, int64_t n, float bias) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto vbias = hn::Set(df, bias);
  auto sum0 = hn::Zero(df), sum1 = hn::Zero(df);
  int64_t c = 0;
  for (; c + 2 * N <= n; c += 2 * N) {
    sum0 = hn::Add(sum0, ExpStep<kRoundBf16>(df, s + c, vbias));
    sum1 = hn::Add(sum1, ExpStep<kRoundBf16>(df, s + c + N, vbias));
  }
  for (; c + N <= n; c += N) sum0 = hn::Add(sum0, ExpStep<kRoundBf16>(df, s + c, vbias));
  HWY_ALIGN float lanes[kMaxLanes];
  hn::Store(hn::Add(sum0, sum1), df, lanes);
  float total = sum_lanes(lanes, N);
  // The tail, one lane at a time with the same polynomial.
  const hn::CappedTag<float, 1> d1;
  const auto vbias1 = hn::Set(d1, bias);
  for (; c < n; ++c) total += hn::GetLane(ExpStep<kRoundBf16>(d1, s + c, vbias1));
  return total;
}

float ExpSum(float* s, int64_t n, float bias, bool round_bf16) {
  return round_bf16 ? ExpSumImpl<true>(s, n, bias) : ExpSumImpl<false>(s, n, bias);
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_SOFTMAX_INL_H_
