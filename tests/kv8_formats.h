// The 8-bit cache formats and scale granularities of the 8-bit KV cache tests (kv8_prefill_test.cc,
// kv8_kvcache_test.cc, kv8_refusals_test.cc, kv8_long_test.cc, kv8_long_append_test.cc).
#ifndef FLASHCTE_TESTS_KV8_FORMATS_H_
#define FLASHCTE_TESTS_KV8_FORMATS_H_

#include "flashcte/flashcte.h"

namespace flashcte::test {

inline constexpr DType kFormats[] = {DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2};
enum Granularity { kPerTensor, kPerHead, kPerToken };

}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_KV8_FORMATS_H_
