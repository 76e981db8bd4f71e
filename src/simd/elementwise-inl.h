// Element-wise passes over one score row (the score modifiers, in Options order: softcap, ALiBi,
// key bias) and the classification of packed values (non-finite, subnormal). Streaming: one load
// and one store per element, memory- or latency-bound, run only when the mode asks for them. Width
// contract W4 (ops.h): whole vectors while n allows, then one lane at a time.

#if defined(FLASHCTE_SRC_SIMD_ELEMENTWISE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_ELEMENTWISE_INL_H_
#undef FLASHCTE_SRC_SIMD_ELEMENTWISE_INL_H_
#else
#define FLASHCTE_SRC_SIMD_ELEMENTWISE_INL_H_
#endif

#include <cmath>
#include <cstdint>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "src/simd/shared-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

template <class D>
HWY_INLINE void SoftcapStep(D d, float* p, float cap) {
  const auto v = hn::LoadU(d, p);
  hn::StoreU(hn::Mul(hn::Set(d, cap), hn::Tanh(d, hn::Div(v, hn::Set(d, cap)))), d, p);
}

void Softcap(float* s, int64_t n, float cap) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t c = 0;
  for (; c + N <= n; c += N) SoftcapStep(df, s + c, cap);
  const hn::CappedTag<float, 1> d1;
  for (; c < n; ++c) SoftcapStep(d1, s + c, cap);
}

void Alibi(float* s, int64_t n, float slope, float dist0) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto neg_slope = hn::Set(df, -slope);
  auto dist = hn::Add(hn::Iota(df, 0.0f), hn::Set(df, dist0));
  const auto step = hn::Set(df, static_cast<float>(N));
  int64_t c = 0;
  for (; c + N <= n; c += N, dist = hn::Add(dist, step)) {
    hn::StoreU(hn::MulAdd(neg_slope, hn::Abs(dist), hn::LoadU(df, s + c)), df, s + c);
  }
  for (; c < n; ++c) {
    const float x = dist0 + static_cast<float>(c);
    s[c] += -slope * (x < 0 ? -x : x);
  }
}

void AddRow(float* s, const float* bias, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t c = 0;
  for (; c + N <= n; c += N) {
    hn::StoreU(hn::Add(hn::LoadU(df, s + c), hn::LoadU(df, bias + c)), df, s + c);
  }
  for (; c < n; ++c) s[c] += bias[c];
}

void MulRow(float* s, const float* scale, int64_t n) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t c = 0;
  for (; c + N <= n; c += N) {
    hn::StoreU(hn::Mul(hn::LoadU(df, s + c), hn::LoadU(df, scale + c)), df, s + c);
  }
  for (; c < n; ++c) s[c] *= scale[c];
}

unsigned Classify(const float* x, int64_t n) {
  // A float is NaN or Inf exactly when its exponent bits are all ones, and subnormal when they
  // are all zeros and the rest of its magnitude is not.
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  const auto exp_mask = hn::Set(du, 0x7F800000u), magnitude = hn::Set(du, 0x7FFFFFFFu);
  auto nonfinite = hn::Zero(du), subnormal = hn::Zero(du);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto bits = hn::BitCast(du, hn::LoadU(df, x + i));
    const auto e = hn::And(bits, exp_mask);
    nonfinite = hn::Or(nonfinite, hn::VecFromMask(du, hn::Eq(e, exp_mask)));
    const auto tiny =
        hn::And(hn::Eq(e, hn::Zero(du)), hn::Ne(hn::And(bits, magnitude), hn::Zero(du)));
    subnormal = hn::Or(subnormal, hn::VecFromMask(du, tiny));
  }
  unsigned found = (hn::AllTrue(du, hn::Eq(nonfinite, hn::Zero(du))) ? 0u : kNonFinite) |
                   (hn::AllTrue(du, hn::Eq(subnormal, hn::Zero(du))) ? 0u : kSubnormal);
  for (; i < n; ++i) {
    if (!std::isfinite(x[i])) found |= kNonFinite;
    if (std::fpclassify(x[i]) == FP_SUBNORMAL) found |= kSubnormal;
  }
  return found;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_ELEMENTWISE_INL_H_
