// What `flashcte demo --layer`'s run (demo_layer.cc) hands its check against the float64 layer
// oracle (demo_layer_check.cc): the shape the flags ask for and the layer's timed run.
#ifndef FLASHCTE_TOOLS_DEMO_LAYER_RUN_H_
#define FLASHCTE_TOOLS_DEMO_LAYER_RUN_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/layer.h"
#include "tools/demo_layer.h"
#include "tools/tensors.h"

namespace flashcte::tools::demo {

constexpr int64_t kHidden = 4096;

// What the flags ask for.
struct LayerDemoShape {
  int64_t tokens;  // prefill tokens
  int64_t steps;   // single-token decode steps after the prefill
  int64_t prefix;  // prefill tokens the oracle recomputes from scratch (at most `tokens`)
  int threads;
  DType dtype;
  int64_t element;  // bytes per dtype value
  int64_t max_len;  // KV cache slots: the prefill's, then one per decode step
};

// The layer, its inputs, and what the timed run leaves behind for the check.
struct LayerRun {
  LayerConfig config;
  LayerWeights weights;
  std::unique_ptr<AttentionLayer> layer;
  HostTensor x, out;               // (1, tokens, hidden): the prefill's input and output
  HostTensor x_step, out_step;     // (steps, 1, hidden): one decode input / output per step
  std::vector<int64_t> positions;  // the prefill's: 0..tokens-1
  TensorView prefill_positions;    // (1, tokens) over `positions`
  KvCache cache;                   // max_len slots, filled by the prefill and the decode steps
  double prefill_seconds = 0;
  std::vector<double> step_seconds;
};

// The first n tokens of a (1, tokens, ...) view (TensorView or MutableTensorView).
template <typename View>
View FirstTokens(View v, int64_t n) {
  v.shape[1] = n;
  return v;
}

// Turns a failed step's status into the message the user sees, "<step>: <library message>".
inline Status Explained(const std::string& step, Status status) {
  if (!status.ok) status.message = step + ": " + status.message;
  return status;
}

// Checks the run against the oracle ((a) and (b) of demo_layer.cc's header) and prints one line
// per check group, then PASS or FAIL; *pass says which. An error of the oracle comes back.
Status CheckAgainstOracle(const LayerDemoShape& shape, const LayerRun& run, bool* pass);

}  // namespace flashcte::tools::demo

#endif  // FLASHCTE_TOOLS_DEMO_LAYER_RUN_H_
