// `flashcte bench --decode`: decode_attention (include/flashcte/decode.h) timed on one shape, with
// the K/V bytes it must read and the machine's measured read bandwidth (bandwidth.h) beside it.
#ifndef FLASHCTE_TOOLS_BENCH_DECODE_H_
#define FLASHCTE_TOOLS_BENCH_DECODE_H_

#include <vector>

#include "tools/args.h"

namespace flashcte::tools {

// The flags --decode adds to `flashcte bench`, and the ones of plain bench it has no use for.
std::vector<FlagSpec> DecodeBenchFlagSpecs();
extern const char* const kNotForDecode[];
extern const int kNotForDecodeCount;

// Runs the decode bench with the parsed `bench` flags; returns the exit code.
int DecodeBench(const ParsedFlags& flags);

// `flashcte bench --decode --mixed P` (bench_mixed.cc): a P-token prefill chunk and a decode
// batch in one flash_attn_varlen_kvcache call against the two calls; returns the exit code.
int MixedBench(const ParsedFlags& flags);

// `flashcte bench --impl bandwidth`: the read bandwidth alone, on 1 and `threads` threads.
int BandwidthBench(int threads, int reps, bool json);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_BENCH_DECODE_H_
