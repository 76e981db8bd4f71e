// `flashcte demo --layer` (demo_layer.cc), and what it shares with the kernel demo in
// cmd_demo.cc: the Llama-3-8B attention shape, the comparator's absolute term, batch views and
// the stopwatch.
#ifndef FLASHCTE_TOOLS_DEMO_LAYER_H_
#define FLASHCTE_TOOLS_DEMO_LAYER_H_

#include <chrono>
#include <cstdint>

#include "flashcte/flashcte.h"
#include "tools/args.h"
#include "tools/tensors.h"

namespace flashcte::tools::demo {

// Llama-3-8B's attention: 32 query heads sharing 8 KV heads, d = 128.
inline constexpr int64_t kHeads = 32;
inline constexpr int64_t kKvHeads = 8;
inline constexpr int64_t kHeadDim = 128;
// The Neuron suite's comparator is |a - b| <= atol + rtol * max|ref|; both demos keep its atol
// (the kernel demo its bfloat16 rtol too, the layer demo an rtol per dtype).
inline constexpr double kAtol = 1e-5;

// A view of `t`'s batches [b0, b0 + n) (dense row-major rank-3 tensors only).
inline TensorView Batches(const HostTensor& t, int64_t b0, int64_t n) {
  TensorView v = t.view();
  v.data = static_cast<const char*>(t.data()) + b0 * v.strides[0] * dtype_size(t.dtype());
  v.shape[0] = n;
  return v;
}

inline MutableTensorView MutableBatches(HostTensor& t, int64_t b0, int64_t n) {
  MutableTensorView v = t.mutable_view();
  v.data = static_cast<char*>(t.data()) + b0 * v.strides[0] * dtype_size(t.dtype());
  v.shape[0] = n;
  return v;
}

inline double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Runs `flashcte demo --layer` with the parsed `demo` flags (--tokens, --decode-steps,
// --check-prefix, --dtype, --threads); returns the exit code.
int LayerDemo(const ParsedFlags& flags);

}  // namespace flashcte::tools::demo

#endif  // FLASHCTE_TOOLS_DEMO_LAYER_H_
