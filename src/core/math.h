// Integer helpers shared by every layer (tile counts, padding, split lengths).
#ifndef FLASHCTE_SRC_CORE_MATH_H_
#define FLASHCTE_SRC_CORE_MATH_H_

#include <cstdint>

namespace flashcte::internal {

// ceil(a / b) for a >= 0, b > 0.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// a rounded up to a multiple of m, for a >= 0, m > 0.
constexpr int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_CORE_MATH_H_
