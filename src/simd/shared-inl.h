// Per-target definitions shared by the kernel families (included once per Highway target by
// ops.cc): the float vector type, the register block height (the row-block loop itself is
// row_blocks.h), the width contracts of ops.h that depend on this target's lane count, and the
// loads that widen a cache row of any K/V dtype (8-bit formats included) to float32 in registers.

// Per-target include guard (Highway's idiom: toggled for every target foreach_target compiles).
#if defined(FLASHCTE_SRC_SIMD_SHARED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef FLASHCTE_SRC_SIMD_SHARED_INL_H_
#undef FLASHCTE_SRC_SIMD_SHARED_INL_H_
#else
#define FLASHCTE_SRC_SIMD_SHARED_INL_H_
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "hwy/highway.h"
#include "src/simd/ops.h"
#include "src/simd/row_blocks.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The kernels' float vector: the target's full vector, capped at kMaxVectorBytes (ops.h) for
// SVE's longest ones. On every x86 target and NEON this is ScalableTag<float> itself.
using DF = hn::CappedTag<float, static_cast<size_t>(kMaxVectorBytes) / sizeof(float)>;

// The most floats a vector of this target holds. For fixed-width targets (x86, NEON) this is the
// lane count N itself; scalable targets may run narrower.
inline constexpr int64_t kMaxLanes = static_cast<int64_t>(hn::MaxLanes(DF()));

// W1 (ops.h) for this target: whole vectors tile the padding, and the padding holds one.
static_assert(kPadFloats % kMaxLanes == 0,
              "W1: the column padding unit must be a multiple of this target's vector");
static_assert(kPadFloats >= kMaxLanes, "W2: qk's overrun past cols must fit in the padding");

// Rows per register block of MM1 and MM2. 6 fills AVX2's 16 registers (the classic 6x16 SGEMM
// shape: 12 accumulators, 2 streamed vectors, 1 broadcast); wider targets keep the same shape so
// that every target computes the same sums in the same order per lane. AVX3's 32 registers hold
// wider MM1 tiles, which did not pay: on the 2-core AMD EPYC Zen 4, fp32 MHA S=4096 d=128, 2
// threads, separate builds in interleaved process pairs against 6 x 2 vectors, 4 x 4 measured
// 0.997 (8 pairs), 6 x 4 1.004 (14 pairs); 8 x 3 0.80 (its 8 rows exceed the unroll pragmas and
// the accumulators go to the stack). The native bfloat16 MM1 does gain from 4 x 4 (native_ops.cc).
inline constexpr int64_t kRows = 6;

// x rounded to bfloat16, to nearest even, as a float32 with the low half zero; finite x only (a
// NaN may round to infinity). The exp-and-sum's P (softmax-inl.h) and the output rows
// (convert-inl.h, which handles NaN itself) share it.
template <class D, class V>
HWY_INLINE V RoundToBf16(D d, V x) {
  const hn::RebindToUnsigned<D> du;
  const auto bits = hn::BitCast(du, x);
  const auto lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::Add(bits, hn::Add(hn::Set(du, 0x7FFFu), lsb));
  return hn::BitCast(d, hn::And(rounded, hn::Set(du, 0xFFFF0000u)));
}

// The fp8 cache formats as element types (one byte each, src/core/kv8.h): the kernels read their
// codes; the scale is applied outside (DecodeProblem::k_scale, v_scale).
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

// A type as a value, for generic lambdas: typename decltype(tag)::type.
template <class T>
struct TypeTag {
  using type = T;
};

// f(TypeTag<T>()) with T the element type of a K/V cache of `dtype`: the decode kernels' one
// dispatch from dtype to the code compiled for it. `kernel` names the caller in the abort for a
// dtype no cache holds (the dispatch layer validates first).
template <class F>
HWY_INLINE void WithCacheType(DType dtype, const char* kernel, const F& f) {
  switch (dtype) {
    case DType::kBFloat16:
      return f(TypeTag<hwy::bfloat16_t>());
    case DType::kFloat16:
      return f(TypeTag<hwy::float16_t>());
    case DType::kFloat32:
      return f(TypeTag<float>());
    case DType::kInt8:
      return f(TypeTag<int8_t>());
    case DType::kFloat8E4M3:
      return f(TypeTag<Fp8E4M3>());
    case DType::kFloat8E5M2:
      return f(TypeTag<Fp8E5M2>());
    case DType::kInt32:
    case DType::kInt64:
      break;
  }
  HWY_ABORT("%s: %s is not a cache dtype", kernel, dtype_name(dtype));
}

// The lanes of d at p, through load(d, p) (every load of a cache row goes through here).
template <class T, class Load>
HWY_INLINE hn::Vec<DF> LoadAsFloatWith(DF df, const T* HWY_RESTRICT p, const Load& load) {
  if constexpr (std::is_same_v<T, float>) {
    return load(df, p);
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const hn::RebindToSigned<DF> di;
    const hn::Rebind<int8_t, DF> d8;
    return hn::ConvertTo(df, hn::PromoteTo(di, load(d8, p)));
  } else if constexpr (std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>) {
    // Through binary16, exactly: e5m2 is binary16's upper byte; e4m3fn's 7 magnitude bits placed
    // at binary16's bits 7..13 (exponent bias 15 against 7) are its value times 2^-8, subnormals
    // included. Its one NaN pattern (magnitude 0x7F) lands on binary16 0x3F80, a number: 0x4000
    // more makes it 0x7F80, a quiet NaN, decided in the 16-bit lanes (half the work of a
    // float32 select; Zen 4, prefill over an e4m3 prior: see docs/benchmarks, 8-bit KV caches).
    const hn::Rebind<uint8_t, DF> d8;
    const hn::Rebind<uint16_t, DF> d16;
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto bytes = hn::PromoteTo(d16, load(d8, reinterpret_cast<const uint8_t*>(p)));
    if constexpr (std::is_same_v<T, Fp8E5M2>) {
      return hn::PromoteTo(df, hn::BitCast(dh, hn::ShiftLeft<8>(bytes)));
    } else {
      const auto magnitude = hn::And(bytes, hn::Set(d16, 0x7F));
      const auto nan_fix = hn::And(hn::VecFromMask(d16, hn::Eq(magnitude, hn::Set(d16, 0x7F))),
                                   hn::Set(d16, 0x4000));
      const auto half = hn::Or(hn::ShiftLeft<8>(hn::And(bytes, hn::Set(d16, 0x80))),
                               hn::Add(hn::ShiftLeft<7>(magnitude), nan_fix));
      return hn::Mul(hn::PromoteTo(df, hn::BitCast(dh, half)), hn::Set(df, 256.0f));
    }
  } else {
    const hn::Rebind<T, DF> dh;
    return hn::PromoteTo(df, load(dh, p));
  }
}

// N values of a cache row from p, as float32 (8-bit formats: their codes' values, unscaled).
template <class T>
HWY_INLINE hn::Vec<DF> LoadAsFloat(DF df, const T* HWY_RESTRICT p) {
  return LoadAsFloatWith(df, p, [](auto d, const auto* q) HWY_ATTR { return hn::LoadU(d, q); });
}

// bfloat16 rows on the targets that widen them (no bf16 dot product): 2N values read as N 32-bit
// lanes, lane i holding value 2i in its low half and 2i + 1 in its high half (little-endian), widen
// to two float32 vectors with one shift and one mask, the even-indexed values and the odd-indexed:
// one load and two integer ops, where LoadAsFloat takes two widening loads and two shifts for the
// same 2N values. The decode kernels split their Q rows the same way once per block of rows and
// their output rows once per tile (hn::LoadInterleaved2 / StoreInterleaved2). Fixed-width targets
// with N >= 2 only (the scalar target's one lane gains nothing; SVE's lanes are known at run time).
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "bf16 pairs: value 2i is the low half");

template <class T>
inline constexpr bool kBf16Pairs =
    !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && std::is_same_v<T, hwy::bfloat16_t>;

HWY_INLINE void LoadBf16Pairs(DF df, const hwy::bfloat16_t* HWY_RESTRICT p, hn::Vec<DF>& even,
                              hn::Vec<DF>& odd) {
  const hn::RebindToUnsigned<DF> du;
  const auto pairs = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
  even = hn::BitCast(df, hn::ShiftLeft<16>(pairs));
  odd = hn::BitCast(df, hn::And(pairs, hn::Set(du, 0xFFFF0000u)));
}

// The `count` (< N) values at p, zero-extended to N, as float32: the tail of a row that may end
// a mapping. Where the target's masked loads never touch the lanes they leave out (AVX-512, SVE),
// one masked load of the lanes' bits; elsewhere through a zeroed copy.
template <class T>
HWY_INLINE hn::Vec<DF> LoadTailAsFloat(DF df, const T* HWY_RESTRICT p, int64_t count) {
#if !HWY_MEM_OPS_MIGHT_FAULT
  return LoadAsFloatWith(df, p, [count](auto d, const auto* q) HWY_ATTR {
    const hn::RebindToUnsigned<decltype(d)> du;
    using U = hn::TFromD<decltype(du)>;
    return hn::BitCast(d, hn::MaskedLoad(hn::FirstN(du, static_cast<size_t>(count)), du,
                                         reinterpret_cast<const U*>(q)));
  });
#else
  HWY_ALIGN T buf[kMaxLanes];
  std::memset(static_cast<void*>(buf), 0, sizeof buf);
  std::memcpy(static_cast<void*>(buf), p, static_cast<size_t>(count) * sizeof(T));
  return LoadAsFloat(df, buf);
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#endif  // FLASHCTE_SRC_SIMD_SHARED_INL_H_
