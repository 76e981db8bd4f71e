// Conversions for the packers, once per element of a K/V tile or a Q block: bfloat16 / float16
// runs to float32 (2 or 4 bytes in, 4 out per element), and an 8-bit cache's codes (their
// values, unscaled: the packer applies the scale), and float32 that holds bfloat16 values to
// the native bf16 kernels' layouts (native_ops.h): narrowed rows, and pairs of rows interleaved.
// And the way back for the output rows, once per element of the output: float32 rounded to the
// output's dtype.
// Width contract W4 (ops.h): whole vectors while n allows, then one lane at a time.

#if defined(FLASHCTE_SRC_SIMD_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_CONVERT_INL_H_
#undef FLASHCTE_SRC_SIMD_CONVERT_INL_H_
#else
#define FLASHCTE_SRC_SIMD_CONVERT_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "hwy/highway.h"
#include "src/core/half.h"
#include "src/core/kv8.h"
#include "src/simd/shared-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

template <typename T>
HWY_INLINE void PromoteRow(const T* HWY_RESTRICT src, int64_t n, float* HWY_RESTRICT dst) {
  const DF df;
  const hn::Rebind<T, DF> dh;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, src + i)), df, dst + i);
  const hn::CappedTag<float, 1> d1;
  const hn::Rebind<T, decltype(d1)> dh1;
  for (; i < n; ++i) hn::StoreU(hn::PromoteTo(d1, hn::LoadU(dh1, src + i)), d1, dst + i);
}

// The 8-bit cache formats' codes as float32 values (unscaled): whole vectors, then one code at
// a time (kv8::decode, exact as the vector path).
template <typename T>
HWY_INLINE void WidenCodes(const T* HWY_RESTRICT src, DType dtype, int64_t n,
                           float* HWY_RESTRICT dst) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadAsFloat(df, src + i), df, dst + i);
  const auto* bytes = reinterpret_cast<const uint8_t*>(src);
  for (; i < n; ++i) dst[i] = kv8::decode(dtype, bytes[i]);
}

void ToFloat(const void* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kBFloat16:
      PromoteRow(static_cast<const hwy::bfloat16_t*>(src), n, dst);
      break;
    case DType::kFloat16:
      PromoteRow(static_cast<const hwy::float16_t*>(src), n, dst);
      break;
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case DType::kInt8:
      WidenCodes(static_cast<const int8_t*>(src), dtype, n, dst);
      break;
    case DType::kFloat8E4M3:
      WidenCodes(static_cast<const Fp8E4M3*>(src), dtype, n, dst);
      break;
    case DType::kFloat8E5M2:
      WidenCodes(static_cast<const Fp8E5M2*>(src), dtype, n, dst);
      break;
    case DType::kInt32:
    case DType::kInt64:
      HWY_ABORT("to_float: %s is not an attention or cache dtype", dtype_name(dtype));
  }
}

// Stores the high halves of v's lanes as uint16_t: v's lanes hold bfloat16 values (low halves
// zero), so this is their exact bfloat16 encoding, NaN payloads included.
template <class D>
HWY_INLINE void StoreBf16Halves(D /* d */, hn::Vec<D> v, uint16_t* HWY_RESTRICT dst) {
  const hn::Rebind<uint16_t, D> d16;
  const auto high = hn::ShiftRight<16>(hn::BitCast(hn::RebindToUnsigned<D>(), v));
  // bits >> 16 is below 2^16, so the saturating demotion keeps it as it is.
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(hn::RebindToSigned<D>(), high)), d16, dst);
}

// The high halves of float32 values that are bfloat16 already (packed from bfloat16 inputs, or
// P rounded by exp_sum): exact.
void NarrowBf16(const float* src, int64_t n, uint16_t* dst) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) StoreBf16Halves(df, hn::LoadU(df, src + i), dst + i);
  const hn::CappedTag<float, 1> d1;
  for (; i < n; ++i) StoreBf16Halves(d1, hn::LoadU(d1, src + i), dst + i);
}

// dst[i] = src[i] rounded to bfloat16, to nearest even, a NaN quieted: half::float_to_bf16's
// bits.
template <class D>
HWY_INLINE void RoundBf16Step(D d, const float* src, uint16_t* dst) {
  const hn::RebindToUnsigned<D> du;
  const auto v = hn::LoadU(d, src);
  const auto quieted = hn::BitCast(d, hn::Or(hn::BitCast(du, v), hn::Set(du, 0x00400000u)));
  StoreBf16Halves(d, hn::IfThenElse(hn::IsNaN(v), quieted, RoundToBf16(d, v)), dst);
}

HWY_INLINE void RoundBf16(const float* src, int64_t n, uint16_t* dst) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) RoundBf16Step(df, src + i, dst + i);
  const hn::CappedTag<float, 1> d1;
  for (; i < n; ++i) RoundBf16Step(d1, src + i, dst + i);
}

// dst[i] = src[i] rounded to float16 with half::float_to_f16's bits (nearest even, gradual
// underflow, overflow to infinity, a NaN quieted with the top of its payload): vcvtps2ph on the x86
// targets that have F16C. Highway's DemoteTo to float16 on the others truncates instead of
// rounding, so they keep the scalar rounding.
HWY_INLINE void RoundF16(const float* src, int64_t n, uint16_t* dst) {
  int64_t i = 0;
#if (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL) && \
    !defined(HWY_DISABLE_F16C)
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  auto* out = reinterpret_cast<hwy::float16_t*>(dst);
  for (; i + N <= n; i += N) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, src + i)), dh, out + i);
#endif
  for (; i < n; ++i) dst[i] = half::float_to_f16(src[i]);
}

void FromFloat(const float* src, DType dtype, int64_t n, void* dst) {
  switch (dtype) {
    case DType::kBFloat16:
      RoundBf16(src, n, static_cast<uint16_t*>(dst));
      break;
    case DType::kFloat16:
      RoundF16(src, n, static_cast<uint16_t*>(dst));
      break;
    case DType::kFloat32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      HWY_ABORT("from_float: %s is not an attention dtype", dtype_name(dtype));
  }
}

// dst[i] = (bf16(lo[i]), bf16(hi[i])) as one uint32_t, low half first; a null row reads as
// zeros. Exact for float32 that holds bfloat16 values, as NarrowBf16.
template <class D>
HWY_INLINE void InterleaveStep(D d, const float* lo, const float* hi, uint32_t* dst) {
  const hn::RebindToUnsigned<D> du;
  const auto lo_bits = lo ? hn::BitCast(du, hn::LoadU(d, lo)) : hn::Zero(du);
  const auto hi_bits = hi ? hn::BitCast(du, hn::LoadU(d, hi)) : hn::Zero(du);
  hn::StoreU(hn::Or(hn::ShiftRight<16>(lo_bits), hn::And(hi_bits, hn::Set(du, 0xFFFF0000u))), du,
             dst);
}

void InterleaveBf16(const float* lo, const float* hi, int64_t n, uint32_t* dst) {
  const DF df;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    InterleaveStep(df, lo ? lo + i : nullptr, hi ? hi + i : nullptr, dst + i);
  }
  const hn::CappedTag<float, 1> d1;
  for (; i < n; ++i) InterleaveStep(d1, lo ? lo + i : nullptr, hi ? hi + i : nullptr, dst + i);
}

// One step of PairBf16 (d: float lanes, for the uint32_t pairs): the pairs stored, and in
// `unusual` all-ones lanes where either value is non-finite or subnormal: with m its magnitude
// bits, m >= 0x7F80 (exponent all ones) or 0 < m < 0x80 (exponent zero, mantissa not).
template <class D, class VU>
HWY_INLINE void PairStep(D /* d */, const uint16_t* lo, const uint16_t* hi, uint32_t* dst,
                         VU& unusual) {
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<uint16_t, D> d16;
  const auto vlo = lo ? hn::PromoteTo(du, hn::LoadU(d16, lo)) : hn::Zero(du);
  const auto vhi = hi ? hn::PromoteTo(du, hn::LoadU(d16, hi)) : hn::Zero(du);
  hn::StoreU(hn::Or(vlo, hn::ShiftLeft<16>(vhi)), du, dst);
  const auto magnitude = hn::Set(du, 0x7FFFu), one = hn::Set(du, 1u);
  const auto flag = [&](const auto& v) HWY_ATTR {
    const auto m = hn::And(v, magnitude);
    // m - 1 wraps to 0xFFFFFFFF for m = 0, so one unsigned compare finds 0 < m < 0x80.
    const auto odd =
        hn::Or(hn::Gt(m, hn::Set(du, 0x7F7Fu)), hn::Lt(hn::Sub(m, one), hn::Set(du, 0x7Fu)));
    unusual = hn::Or(unusual, hn::VecFromMask(du, odd));
  };
  flag(vlo);
  flag(vhi);
}

// dst[i] = lo[i] | hi[i] << 16 for i < n: two rows of bfloat16 bits as the native kernels' pairs
// (native_ops.h), a null row read as zeros; returns whether any value read is non-finite or
// subnormal.
bool PairBf16(const uint16_t* lo, const uint16_t* hi, int64_t n, uint32_t* dst) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const int64_t N = static_cast<int64_t>(hn::Lanes(df));
  auto unusual = hn::Zero(du);
  int64_t i = 0;
  for (; i + N <= n; i += N) {
    PairStep(df, lo ? lo + i : nullptr, hi ? hi + i : nullptr, dst + i, unusual);
  }
  bool found = !hn::AllTrue(du, hn::Eq(unusual, hn::Zero(du)));
  const hn::CappedTag<float, 1> d1;
  const hn::RebindToUnsigned<decltype(d1)> du1;
  auto unusual1 = hn::Zero(du1);
  for (; i < n; ++i) PairStep(d1, lo ? lo + i : nullptr, hi ? hi + i : nullptr, dst + i, unusual1);
  return found || !hn::AllTrue(du1, hn::Eq(unusual1, hn::Zero(du1)));
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_CONVERT_INL_H_
