// `flashcte bench --impl peak`: the arithmetic limit of the cores the program runs on, measured
// rather than taken from a data sheet, so that a benchmark can state what fraction of the
// machine's arithmetic an implementation reaches on any CPU.
//
// Two kinds of measurement:
//   fma_f32   back-to-back fp32 multiply-adds on independent accumulator chains, once per Highway
//             target this CPU can run (AVX3, AVX2, SSE4, ...). 2 FLOPs per lane per multiply-add.
//   bf16_dot  the native bf16 dot product, AVX512_BF16 vdpbf16ps on zmm registers, when the CPU
//             has it. 64 FLOPs per instruction: 32 bf16 products and 32 adds into 16 fp32 lanes.
// Each is timed on one thread and on `threads` threads (OpenMP), `reps` times, interleaved.
#ifndef FLASHCTE_TOOLS_PEAK_H_
#define FLASHCTE_TOOLS_PEAK_H_

#include <string>
#include <vector>

namespace flashcte::tools {

struct PeakResult {
  std::string kind;    // "fma_f32" or "bf16_dot"
  std::string target;  // the Highway target's name, or "AVX512_BF16"
  bool available = true;
  std::string note;  // why a kind is not available
  int vector_bits = 0;
  int chains = 0;                    // independent accumulators per thread
  double flops_per_instruction = 0;  // per vector instruction
  int threads = 0;                   // threads that actually ran
  std::vector<double> gflops;        // one per rep
  double median() const;
  double best() const;
};

// The counting convention of a kind, for the table and the JSON lines.
const char* PeakCounting(const std::string& kind);

// Measures every fp32 FMA target and the bf16 dot on 1 thread and on `threads` threads (once
// when threads == 1), `reps` rounds each. Not thread-safe: it switches Highway's chosen target
// for the process while it runs, and restores it before returning.
std::vector<PeakResult> MeasurePeak(int threads, int reps);

// The human table (json false) or one JSON object per measurement and line.
void PrintPeak(const std::vector<PeakResult>& results, int reps, bool json);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_PEAK_H_
