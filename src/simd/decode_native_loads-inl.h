// How the native decode kernels (decode_native-inl.h) read a cache row, by the cache's kind:
// bfloat16 as it is, fp8 (float8_e4m3fn, float8_e5m2) converted exactly to bfloat16 through a
// 128-entry table in registers, int8 sign-extended to int16 for the integer (VNNI) kernels; and
// the target attribute and constants every native decode kernel shares.
#ifndef FLASHCTE_SRC_SIMD_DECODE_NATIVE_LOADS_INL_H_
#define FLASHCTE_SRC_SIMD_DECODE_NATIVE_LOADS_INL_H_

#include <array>
#include <cstdint>
#include <cstring>

#include "flashcte/flashcte.h"
#include "hwy/base.h"
#include "hwy/detect_targets.h"
#include "src/core/kv8.h"

#if HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#include <immintrin.h>

namespace flashcte::simd::decode_native {

// AVX512_VNNI for the int8 kernels: every CPU with AVX512_BF16 has it (Cooper Lake, Sapphire
// Rapids, Zen 4 and 5), and native_ops.cc's check asks for both.
#define FLASHCTE_DECODE_NATIVE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))

constexpr int64_t kLanes = 16;
// GCC 12 warns that the unmasked _mm512_shuffle_* read an undefined vector (fixed in GCC 13); the
// zero-masked forms with every lane selected compute the same.
constexpr __mmask16 kAll = 0xFFFF;

// How the kernels load the 32 elements [x, x + 32) of a cache row (those outside the mask m as
// 0), exactly: as bfloat16 bits (a bfloat16 row as it is, an fp8 one converted), or with kInt as
// int16 (int8 codes sign-extended) for the integer kernels.
struct Bf16Load {
  static constexpr int64_t kBytes = 2;
  static constexpr bool kInt = false;
  FLASHCTE_DECODE_NATIVE __m512i operator()(const unsigned char* row, int64_t x,
                                            __mmask32 m) const {
    return _mm512_maskz_loadu_epi16(m, row + 2 * x);
  }
};

struct Int8Load {
  static constexpr int64_t kBytes = 1;
  static constexpr bool kInt = true;
  FLASHCTE_DECODE_NATIVE __m512i operator()(const unsigned char* row, int64_t x,
                                            __mmask32 m) const {
    return _mm512_maskz_cvtepi8_epi16(~__mmask32{0}, _mm256_maskz_loadu_epi8(m, row + x));
  }
};

// The bfloat16 bits of an fp8 format's 128 magnitudes (NaN 0x7FC0, e5m2's infinity 0x7F80).
template <DType kFormat>
const uint16_t* fp8_bf16_table() {
  alignas(64) static const auto table = [] {
    std::array<uint16_t, 128> t{};
    for (int code = 0; code < 128; ++code) {
      uint32_t bits = 0;
      const float value = kv8::decode(kFormat, static_cast<uint8_t>(code));
      std::memcpy(&bits, &value, sizeof bits);
      t[static_cast<size_t>(code)] = static_cast<uint16_t>(bits >> 16);  // exact: see the top
    }
    return t;
  }();
  return table.data();
}

// fp8: the magnitude's (7 bits) bfloat16 bits from the table (two vpermi2w of 64 entries, bit 6
// choosing), the code's sign bit OR-ed in: 7 operations per 32 codes.
struct Fp8Load {
  static constexpr int64_t kBytes = 1;
  static constexpr bool kInt = false;
  __m512i t0, t1, t2, t3;  // table entries 0-31, 32-63, 64-95, 96-127
  FLASHCTE_DECODE_NATIVE explicit Fp8Load(const uint16_t* table)
      : t0(_mm512_loadu_si512(table)),
        t1(_mm512_loadu_si512(table + 32)),
        t2(_mm512_loadu_si512(table + 64)),
        t3(_mm512_loadu_si512(table + 96)) {}
  FLASHCTE_DECODE_NATIVE __m512i operator()(const unsigned char* row, int64_t x,
                                            __mmask32 m) const {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, row + x));
    const __m512i low = _mm512_permutex2var_epi16(t0, w, t1);  // index bits 0-5
    const __m512i high = _mm512_permutex2var_epi16(t2, w, t3);
    const __mmask32 upper = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40));
    // magnitude | (code << 8 & 0x8000): ternary-logic A | (B & C).
    return _mm512_ternarylogic_epi32(_mm512_mask_blend_epi16(upper, low, high),
                                     _mm512_slli_epi16(w, 8),
                                     _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
  }
};

// Calls body(load) with the load of a cache dtype (bfloat16 or an 8-bit format).
template <class Body>
FLASHCTE_DECODE_NATIVE inline void with_load(DType dtype, const Body& body) {
  switch (dtype) {
    case DType::kBFloat16:
      body(Bf16Load());
      break;
    case DType::kInt8:
      body(Int8Load());
      break;
    case DType::kFloat8E4M3:
      body(Fp8Load(fp8_bf16_table<DType::kFloat8E4M3>()));
      break;
    case DType::kFloat8E5M2:
      body(Fp8Load(fp8_bf16_table<DType::kFloat8E5M2>()));
      break;
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kInt32:
    case DType::kInt64:
      HWY_ABORT("decode_native: %s rows are not bfloat16-exact", dtype_name(dtype));
  }
}

}  // namespace flashcte::simd::decode_native

#endif  // HWY_ARCH_X86 && (HWY_COMPILER_GCC || HWY_COMPILER_CLANG)
#endif  // FLASHCTE_SRC_SIMD_DECODE_NATIVE_LOADS_INL_H_
