// What the exp-and-sum of softmax-inl.h (where the method is explained) shares with the native
// bfloat16 one of native_ops.cc, so that both compute the same P and the same sum bit for bit: the
// exp's constants, and the order in which a vector of partial sums is added up.
#ifndef FLASHCTE_SRC_SIMD_EXP_COMMON_H_
#define FLASHCTE_SRC_SIMD_EXP_COMMON_H_

#include <cstdint>

namespace flashcte::simd::exp_constants {

inline constexpr float kLowest = -87.0f;        // below: exp is 0
inline constexpr float kShifter = 12582912.0f;  // 1.5 * 2^23: rounds x / ln 2 to an integer
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693145751953125f;  // 15 significant bits
inline constexpr float kLn2Lo = 1.42860676533018705e-6f;

// exp(r) on |r| <= ln(2) / 2, highest degree first; the constant term 1 is implied.
inline constexpr float kDegree6[] = {0.0013843653723597527f, 0.00837415549904108f,
                                     0.04166800156235695f,   0.16666431725025177f,
                                     0.4999999403953552f,    1.0f};
inline constexpr float kDegree4[] = {0.041513849049806595f, 0.16787473857402802f,
                                     0.5000301599502563f, 0.9999668598175049f};

}  // namespace flashcte::simd::exp_constants

namespace flashcte::simd {

// The sum of n lanes (a power of two) by halving: lanes[i] += lanes[i + n / 2], and again. A
// fixed order of our own, where Highway's SumOfLanes is whatever the compiler's reduction does.
inline float sum_lanes(float* lanes, int64_t n) {
  for (int64_t half = n / 2; half >= 1; half /= 2) {
    for (int64_t i = 0; i < half; ++i) lanes[i] += lanes[i + half];
  }
  return lanes[0];
}

}  // namespace flashcte::simd

#endif  // FLASHCTE_SRC_SIMD_EXP_COMMON_H_
