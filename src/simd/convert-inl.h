// Conversion of a contiguous bfloat16 / float16 run to float32, for the packers (once per
// element of a K/V tile or a Q block). 2 or 4 bytes in, 4 bytes out per element.
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

void ToFloat(const void* src, DType dtype, int64_t n, float* dst) {
  switch (dtype) {
    case DType::kBFloat16:
      PromoteRow(static_cast<const hwy::bfloat16_t*>(src), n, dst);
      break;
    case DType::kFloat16:
      PromoteRow(static_cast<const hwy::float16_t*>(src), n, dst);
      break;
    default:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_CONVERT_INL_H_
