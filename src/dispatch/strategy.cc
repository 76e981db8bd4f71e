// Strategy dispatch (include/flashcte/strategy.h).
//
// neuron_strategy and nxdi_strategy transcribe shared/spec/SEMANTICS.md ("Strategy dispatch")
// rule by rule, in its order and with its numbers. They are deliberately not "improved": a CPU
// user asks them what Neuron would have run, so the quirks of the originals are part of the
// answer (each is pointed out where it happens). cpu_strategy is flashcte's own decision and
// rests on a measurement, cited at its constant.
#include "flashcte/strategy.h"

#include <omp.h>

#include <algorithm>
#include <string>

#include "flashcte/flashcte.h"

namespace flashcte {
namespace {}  // namespace

const char* strategy_name(NeuronStrategy strategy) {
  switch (strategy) {
    case NeuronStrategy::kNone:
      return "NONE";
    case NeuronStrategy::kUnshardedKernel:
      return "UNSHARDED_KERNEL";
    case NeuronStrategy::kShardedKernel:
      return "SHARDED_KERNEL";
    case NeuronStrategy::kLargeDUnshardedKernel:
      return "LARGE_D_UNSHARDED_KERNEL";
    case NeuronStrategy::kLargeDShardedKernel:
      return "LARGE_D_SHARDED_KERNEL";
  }
  return "unknown";
}

const char* strategy_name(NxdiStrategy strategy) {
  switch (strategy) {
    case NxdiStrategy::kNone:
      return "NONE";
    case NxdiStrategy::kUnsharded:
      return "UNSHARDED_KERNEL";
    case NxdiStrategy::kSharded:
      return "SHARDED_KERNEL";
    case NxdiStrategy::kContextParallel:
      return "CONTEXT_PARALLEL_KERNEL";
    case NxdiStrategy::kStridedContextParallel:
      return "STRIDED_CONTEXT_PARALLEL_KERNEL";
  }
  return "unknown";
}

const char* strategy_name(CpuStrategy strategy) {
  switch (strategy) {
    case CpuStrategy::kNone:
      return "NONE";
    case CpuStrategy::kKernel:
      return "KERNEL";
  }
  return "unknown";
}

// optimum-neuron, SEMANTICS.md rules 1-5. Quirks kept on purpose:
//  - rule 2 takes any d > 128 to the large-d kernel, though that kernel needs d % 128 == 0 and
//    d <= 512 (so d = 192 or 576 is sent to a kernel that cannot run it);
//  - rule 5 turns LARGE_D_SHARDED into LARGE_D_UNSHARDED without re-checking rule 2's one-core
//    condition q >= 4096 (q = 2048 ends up on the unsharded large-d kernel), while SHARDED is
//    re-checked against q >= 4096;
//  - rule 4 has no divisibility condition at all.
Status neuron_strategy(const NeuronStrategyInputs& in, NeuronDecision* decision) {
  if (decision == nullptr) return Status::Error("decision: must not be null");
  if (in.logical_cores < 1) {
    return Status::Error("logical_cores: must be at least 1, got " +
                         std::to_string(in.logical_cores));
  }
  if (in.head_dim < 1) {
    return Status::Error("head_dim: must be at least 1, got " + std::to_string(in.head_dim));
  }
  if (in.seqlen_q < 0)
    return Status::Error("seqlen_q: must be >= 0, got " + std::to_string(in.seqlen_q));
  if (in.batch_heads < 1) {
    return Status::Error("batch_heads: must be at least 1, got " + std::to_string(in.batch_heads));
  }
  const int64_t d = in.head_dim, q = in.seqlen_q, lnc = in.logical_cores;
  const std::string dq =
      "d=" + std::to_string(d) + ", q=" + std::to_string(q) + ", lnc=" + std::to_string(lnc);
  NeuronDecision r;
  if (in.custom_qk_scale) {
    r = {NeuronStrategy::kNone, "rule 1: a custom qk_scale is not supported by the kernels"};
    *decision = r;
    return Status::Ok();  // rule 5 only rewrites kernel strategies
  }
  if (d > 128) {
    if (lnc > 1) {
      if (q >= 2048 && q % 2048 == 0) {
        r = {NeuronStrategy::kLargeDShardedKernel,
             "rule 2: " + dq +
                 ": d > 128, lnc > 1, q >= 2048 and q % 2048 == 0 (d % 128 and "
                 "d <= 512 are not checked)"};
      } else {
        r = {NeuronStrategy::kNone,
             "rule 2: " + dq + ": d > 128, lnc > 1, but not (q >= 2048 and q % 2048 == 0)"};
      }
    } else {
      if (q >= 4096 && q % 2048 == 0) {
        r = {NeuronStrategy::kLargeDUnshardedKernel,
             "rule 2: " + dq +
                 ": d > 128, lnc == 1, q >= 4096 and q % 2048 == 0 (d % 128 and "
                 "d <= 512 are not checked)"};
      } else {
        r = {NeuronStrategy::kNone,
             "rule 2: " + dq + ": d > 128, lnc == 1, but not (q >= 4096 and q % 2048 == 0)"};
      }
    }
  } else if (lnc > 1) {
    if (q < 1024) {
      r = {NeuronStrategy::kNone, "rule 3: " + dq + ": d <= 128, lnc > 1, q < 1024"};
    } else if (q % 1024 == 0) {
      r = {NeuronStrategy::kShardedKernel,
           "rule 3: " + dq + ": d <= 128, lnc > 1, q >= 1024 and q % 1024 == 0"};
    } else {
      r = {NeuronStrategy::kNone, "rule 3: " + dq +
                                      ": d <= 128, lnc > 1, q % 1024 != 0 (optimum-neuron warns "
                                      "that flash attention is disabled)"};
    }
  } else {
    r = q >= 4096 ? NeuronDecision{NeuronStrategy::kUnshardedKernel,
                                   "rule 4: " + dq + ": d <= 128, lnc == 1, q >= 4096"}
                  : NeuronDecision{NeuronStrategy::kNone,
                                   "rule 4: " + dq + ": d <= 128, lnc == 1, q < 4096"};
  }

  // Rule 5: the sharded kernels split batch*heads over the cores.
  if (in.batch_heads % lnc != 0) {
    const std::string why = "; rule 5: batch*heads=" + std::to_string(in.batch_heads) +
                            " is not divisible by lnc=" + std::to_string(lnc);
    if (r.strategy == NeuronStrategy::kLargeDShardedKernel) {
      r.strategy = NeuronStrategy::kLargeDUnshardedKernel;
      r.reason += why +
                  ": LARGE_D_SHARDED_KERNEL -> LARGE_D_UNSHARDED_KERNEL (q >= 4096 is not "
                  "re-checked)";
    } else if (r.strategy == NeuronStrategy::kShardedKernel) {
      r.strategy = q >= 4096 ? NeuronStrategy::kUnshardedKernel : NeuronStrategy::kNone;
      r.reason += why + (q >= 4096 ? ": SHARDED_KERNEL -> UNSHARDED_KERNEL (q >= 4096)"
                                   : ": SHARDED_KERNEL -> NONE (q < 4096)");
    }
  }
  *decision = std::move(r);
  return Status::Ok();
}

// NxD Inference, as SEMANTICS.md writes it. Where the NxD source it summarizes differs, the text
// wins here (it is the specification); the differences, for whoever needs the real behaviour:
// NxD raises an error when the strided CP kernel is enabled but not used (no CP eligibility, or
// a sliding window) instead of falling back to the contiguous CP kernel or NONE.
Status nxdi_strategy(const NxdiStrategyInputs& in, NxdiDecision* decision) {
  if (decision == nullptr) return Status::Error("decision: must not be null");
  if (in.logical_cores < 1) {
    return Status::Error("logical_cores: must be at least 1, got " +
                         std::to_string(in.logical_cores));
  }
  if (in.cp_degree < 1) {
    return Status::Error("cp_degree: must be at least 1, got " + std::to_string(in.cp_degree));
  }
  if (in.head_dim < 1) {
    return Status::Error("head_dim: must be at least 1, got " + std::to_string(in.head_dim));
  }
  if (in.seqlen_q < 0)
    return Status::Error("seqlen_q: must be >= 0, got " + std::to_string(in.seqlen_q));
  if (in.sliding_window < 0) {
    return Status::Error("sliding_window: must be >= 0, got " + std::to_string(in.sliding_window));
  }
  const int64_t d = in.head_dim, q = in.seqlen_q, lnc = in.logical_cores;
  const std::string dq = "q=" + std::to_string(q) + ", lnc=" + std::to_string(lnc);
  NxdiDecision r;
  if (in.attn_kernel_enabled.has_value() && !*in.attn_kernel_enabled) {
    r = {NxdiStrategy::kNone, "the attention kernel is disabled (attn_kernel_enabled=False)"};
  } else if (in.cp_degree > 1) {
    const std::string cp =
        "cp_degree=" + std::to_string(in.cp_degree) + " > 1, " + dq + ", d=" + std::to_string(d);
    if (lnc < 2 || q <= d) {
      r = {NxdiStrategy::kNone,
           cp + ": the CP kernel needs lnc >= 2 and q > d (it infers the sequence axis as the "
                "larger one)"};
    } else if (in.strided_cp_enabled && in.sliding_window == 0) {
      r = {NxdiStrategy::kStridedContextParallel,
           cp + ": lnc >= 2 and q > d, strided CP enabled and no sliding window"};
    } else {
      r = {NxdiStrategy::kContextParallel,
           cp + ": lnc >= 2 and q > d, " +
               (in.strided_cp_enabled ? std::string("strided CP enabled but sliding window ") +
                                            std::to_string(in.sliding_window) + ": contiguous"
                                      : std::string("strided CP not enabled: contiguous"))};
    }
  } else if (lnc > 1 && in.attention_mask) {
    if (q >= 1024 && q % 512 == 0) {
      r = {NxdiStrategy::kSharded, dq + ", attention mask: q >= 1024 and q % 512 == 0"};
    } else if (q < 1024 && q % 256 == 0) {
      r = {NxdiStrategy::kSharded, dq + ", attention mask: q < 1024 and q % 256 == 0"};
    } else {
      r = {NxdiStrategy::kNone,
           dq + ", attention mask: needs q % 512 == 0 (q >= 1024) or q % 256 == 0 (q < 1024)"};
    }
  } else if (lnc > 1) {
    r = {NxdiStrategy::kSharded, dq + ", no attention mask: always sharded"};
  } else if (q >= 4096) {
    r = {NxdiStrategy::kUnsharded, dq + ": q >= 4096"};
  } else if (in.attn_kernel_enabled.value_or(false) && q >= 512) {
    r = {NxdiStrategy::kUnsharded, dq + ": q in [512, 4096) and the kernel explicitly enabled"};
  } else {
    r = {NxdiStrategy::kNone,
         dq + (q >= 512 ? ": q < 4096 and the kernel not explicitly enabled" : ": q < 512")};
  }
  *decision = std::move(r);
  return Status::Ok();
}

namespace {

// Where the materialized path (NONE) beats the kernel on the CPU: the table, the machine (a
// shared 2-core Zen 3 EPYC, AVX2), the commit and the command that measured it are in
// docs/benchmarks/strategy_crossover.md. The limits are the longest S at which the materialized
// path won clearly at every measured d: causal 64 (at 128 a coin toss, at 256 the kernel's
// causal tile skipping wins); non-causal 256 for d >= 64 and 128 below. The table ages with the
// kernel: re-run its command after kernel changes.
int64_t MaterializedMaxLength(bool causal, int64_t head_dim) {
  if (causal) return 64;
  return head_dim >= 64 ? 256 : 128;
}
// Head dims the measurement covered (8 to 256).
constexpr int64_t kMaterializedMaxHeadDim = 256;
// With grouped KV heads the kernel packs each K/V tile once per group and amortizes its fixed
// per-call cost over the group: with 32 heads on 8 KV heads it won at S = 1 and 2, and at 4 for
// d = 64; the materialized path won from 8.
constexpr int64_t kMaterializedMinQueryGrouped = 8;

// The kernel's thread count for the shape, as plan_attention resolves it.
Status KernelThreads(const CpuStrategyInputs& in, int64_t kv_batch, int* threads) {
  *threads = 1;
  if (in.batch == 0 || in.seqlen_q == 0 || in.seqlen_kv == 0) return Status::Ok();
  const auto shape_only = [&](int64_t batch, int64_t rows, int64_t cols) {
    TensorView t;
    t.dtype = in.dtype;
    t.rank = 3;
    t.shape = {batch, rows, cols};
    t.strides = {rows * cols, cols, 1};
    return t;
  };
  Options options;
  options.causal_mask = in.causal;
  options.num_threads = in.threads;
  PlanSummary plan;
  Status planned = plan_attention(shape_only(in.batch, in.seqlen_q, in.head_dim),
                                  shape_only(kv_batch, in.head_dim, in.seqlen_kv),
                                  shape_only(kv_batch, in.seqlen_kv, in.head_dim), options, &plan);
  *threads = plan.threads;
  return planned;
}

}  // namespace

Status cpu_strategy(const CpuStrategyInputs& in, CpuDecision* decision) {
  if (decision == nullptr) return Status::Error("decision: must not be null");
  if (in.batch < 0) return Status::Error("batch: must be >= 0, got " + std::to_string(in.batch));
  if (in.kv_batch < 0)
    return Status::Error("kv_batch: must be >= 0, got " + std::to_string(in.kv_batch));
  const int64_t kv_batch = in.kv_batch > 0 ? in.kv_batch : in.batch;
  if (kv_batch > 0 && in.batch % kv_batch != 0) {
    return Status::Error("kv_batch: " + std::to_string(kv_batch) +
                         " must divide batch = " + std::to_string(in.batch));
  }
  if (in.seqlen_q < 0)
    return Status::Error("seqlen_q: must be >= 0, got " + std::to_string(in.seqlen_q));
  if (in.seqlen_kv < 0)
    return Status::Error("seqlen_kv: must be >= 0, got " + std::to_string(in.seqlen_kv));
  if (in.head_dim < 1) {
    return Status::Error("head_dim: must be at least 1, got " + std::to_string(in.head_dim));
  }
  if (in.threads < 0)
    return Status::Error("threads: must be >= 0, got " + std::to_string(in.threads));

  int kernel_threads = 1;
  if (Status planned = KernelThreads(in, kv_batch, &kernel_threads); !planned.ok) return planned;
  // A materialized path splits heads over threads, one head per thread: the measured peer's
  // second thread inside one head (an OpenMP team for a few softmax rows) made it 3 to 1000
  // times slower than the kernel at every shape on 2 threads, so that is not how NONE would run.
  const int64_t wanted = in.threads > 0 ? in.threads : omp_get_max_threads();
  const int none_threads = static_cast<int>(std::max<int64_t>(1, std::min(wanted, in.batch)));

  const int64_t length = std::max(in.seqlen_q, in.seqlen_kv);
  const int64_t limit = MaterializedMaxLength(in.causal, in.head_dim);
  const std::string shape =
      "Sq=" + std::to_string(in.seqlen_q) + ", Skv=" + std::to_string(in.seqlen_kv) +
      ", d=" + std::to_string(in.head_dim) + ", batch=" + std::to_string(in.batch) + "/" +
      std::to_string(kv_batch) + (in.causal ? ", causal" : ", non-causal");
  std::string why_kernel;
  if (in.seqlen_q == 0 || in.seqlen_kv == 0 || in.batch == 0) {
    why_kernel = "empty problem";
  } else if (!in.plain) {
    why_kernel = "a mode beyond plain attention (prefix, sink, window, CP, packing or statistics)";
  } else if (in.dtype != DType::kFloat32) {
    why_kernel = std::string(dtype_name(in.dtype)) + " inputs (NONE was measured in float32)";
  } else if (in.head_dim > kMaterializedMaxHeadDim) {
    why_kernel = "d > " + std::to_string(kMaterializedMaxHeadDim) + " (not measured)";
  } else if (length > limit) {
    why_kernel = "max(Sq, Skv) > " + std::to_string(limit) + ", the measured crossover";
  } else if (in.seqlen_q == 1 && in.batch > 1) {
    why_kernel = "Sq = 1 with several heads: the kernel shares its fixed cost over the heads";
  } else if (kv_batch != in.batch && in.seqlen_q < kMaterializedMinQueryGrouped) {
    why_kernel = "Sq < " + std::to_string(kMaterializedMinQueryGrouped) +
                 " with grouped KV heads: the kernel packs each K/V tile once per group";
  } else if (kernel_threads > none_threads) {
    why_kernel = "the kernel splits query blocks over " + std::to_string(kernel_threads) +
                 " threads where NONE would use " + std::to_string(none_threads);
  }
  CpuDecision r;
  if (why_kernel.empty()) {
    r.strategy = CpuStrategy::kNone;
    r.threads = none_threads;
    r.reason = shape + ": max(Sq, Skv) <= " + std::to_string(limit) +
               ", where the materialized path measured faster than the kernel";
  } else {
    r.strategy = CpuStrategy::kKernel;
    r.threads = kernel_threads;
    r.reason = shape + ": " + why_kernel;
  }
  *decision = std::move(r);
  return Status::Ok();
}

}  // namespace flashcte
