// Strategy dispatch: which attention implementation a caller picks for a prefill shape.
//
// Three deciders, each returning its choice and a one-line reason naming the rule that fired:
//   neuron_strategy  optimum-neuron's NeuronAttentionBase.get_flash_attention_strategy, the
//                    five-way choice between plain attention and the (large-d, sharded) kernels;
//   nxdi_strategy    NxD Inference's choice, the caller that drives `attention_cte` itself;
//   cpu_strategy     what flashcte itself would pick on this CPU: the materialized
//                    matmul-softmax-matmul (NONE) or the flash kernel, and on how many threads.
// The first two are transcriptions of shared/spec/SEMANTICS.md ("Strategy dispatch"), quirks
// included, so that a CPU user can ask "what would Neuron have run for this shape?". None of the
// three computes anything; all are cheap and thread-safe. They advise callers: attention_cte and
// the layer never consult them (they always run the flash kernel).
#ifndef FLASHCTE_STRATEGY_H_
#define FLASHCTE_STRATEGY_H_

#include <cstdint>
#include <optional>
#include <string>

#include "flashcte/flashcte.h"

namespace flashcte {

// optimum-neuron's FlashAttentionStrategy.
enum class NeuronStrategy : int {
  kNone,                   // compiler-native matmul / softmax / matmul
  kUnshardedKernel,        // attention kernel on one logical core
  kShardedKernel,          // attention kernel split over the LNC cores
  kLargeDUnshardedKernel,  // flash_fwd_large_d (head dim > 128, d-tiled), one core
  kLargeDShardedKernel,    // flash_fwd_large_d split over the LNC cores
};

// NxD Inference's strategies for the prefill kernel (SEMANTICS.md abbreviates the names; the
// Python enum members carry a _KERNEL suffix, which strategy_name() keeps).
enum class NxdiStrategy : int {
  kNone,
  kUnsharded,
  kSharded,
  kContextParallel,         // the CP kernel, contiguous query slices (cp_offset = rank * q)
  kStridedContextParallel,  // the CP kernel, strided query slices (cp_offset = rank)
};

// flashcte's own choice on the CPU.
enum class CpuStrategy : int {
  kNone,    // materialized: full score matrix, row softmax, second matmul
  kKernel,  // attention_cte's flash recurrence
};

// The Python enum member names: "NONE", "SHARDED_KERNEL", "LARGE_D_UNSHARDED_KERNEL",
// "CONTEXT_PARALLEL_KERNEL", ...; for CpuStrategy "NONE" and "KERNEL".
const char* strategy_name(NeuronStrategy strategy);
const char* strategy_name(NxdiStrategy strategy);
const char* strategy_name(CpuStrategy strategy);

struct NeuronStrategyInputs {
  int64_t head_dim = 128;        // d
  int64_t seqlen_q = 0;          // q_len
  int64_t logical_cores = 1;     // LNC (logical_nc_config), at least 1
  bool custom_qk_scale = false;  // the model sets its own qk_scale
  int64_t batch_heads = 1;       // batch * heads, for the divisibility-by-LNC demotion
};

struct NeuronDecision {
  NeuronStrategy strategy = NeuronStrategy::kNone;
  std::string reason;  // "rule N: ..." per SEMANTICS.md, then "; rule 5: ..." on a demotion
};

// optimum-neuron's decision. Errors (a logical core count below 1, which Python would meet as a
// division by zero; a negative length; a head dim or batch*heads below 0/1) leave *decision
// untouched.
Status neuron_strategy(const NeuronStrategyInputs& inputs, NeuronDecision* decision);

struct NxdiStrategyInputs {
  // NxD's tri-state neuron_config.attn_kernel_enabled: nullopt is the default (the kernel is
  // used where it pays), false disables it, true enables it explicitly (also for 512 <= q <
  // 4096 on one core).
  std::optional<bool> attn_kernel_enabled;
  int64_t cp_degree = 1;            // context-parallel degree
  bool strided_cp_enabled = false;  // the strided CP kernel is enabled
  int64_t sliding_window = 0;       // 0: no sliding window
  int64_t logical_cores = 1;        // LNC, at least 1
  int64_t seqlen_q = 0;             // q_len (per CP rank under context parallelism)
  int64_t head_dim = 128;           // d
  bool attention_mask = false;      // the prefill carries an attention mask
};

struct NxdiDecision {
  NxdiStrategy strategy = NxdiStrategy::kNone;
  std::string reason;
};

Status nxdi_strategy(const NxdiStrategyInputs& inputs, NxdiDecision* decision);

struct CpuStrategyInputs {
  int64_t batch = 1;       // query batch*heads (bs)
  int64_t kv_batch = 0;    // KV batch*heads (bs_kv); 0: same as batch
  int64_t seqlen_q = 0;    // Sq
  int64_t seqlen_kv = 0;   // Skv, including any used prefix
  int64_t head_dim = 128;  // d
  bool causal = true;
  DType dtype = DType::kFloat32;
  // Only q, k, v, scale and causal_mask are in play: no prefix, sink, sliding window,
  // context-parallel offsets, packing bounds or softmax statistics. The materialized path was
  // measured for plain attention only, so anything else goes to the kernel.
  bool plain = true;
  int threads = 0;  // requested threads; 0: OpenMP's default
};

struct CpuDecision {
  CpuStrategy strategy = CpuStrategy::kKernel;
  int threads = 1;  // threads the chosen path would use
  std::string reason;
};

// The choice flashcte makes on the CPU. The library has no NONE execution path yet; this is the
// decision it would take, from a measured crossover (src/dispatch/strategy.cc).
Status cpu_strategy(const CpuStrategyInputs& inputs, CpuDecision* decision);

}  // namespace flashcte

#endif  // FLASHCTE_STRATEGY_H_
