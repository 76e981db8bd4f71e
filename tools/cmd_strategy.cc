// `flashcte strategy`: which attention implementation optimum-neuron, NxD Inference and flashcte
// itself would pick for a prefill shape, and which rule decided (include/flashcte/strategy.h).
// Nothing is computed.
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "flashcte/strategy.h"
#include "tools/args.h"
#include "tools/commands.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "strategy";
constexpr int64_t kMaxLength = int64_t{1} << 40;

std::vector<FlagSpec> StrategyFlagSpecs() {
  return {
      {"sq", FlagKind::kInt, "query length q (required; per CP rank under --cp-degree)", 0,
       kMaxLength},
      {"skv", FlagKind::kInt, "KV length, for the CPU decision (default --sq)", 0, kMaxLength},
      {"d", FlagKind::kInt, "head dim (default 128)", 1, 1 << 20},
      {"lnc", FlagKind::kInt, "Neuron logical cores per rank (default 1)", 1, 1024},
      {"batch-heads", FlagKind::kInt, "batch*heads (default 1)", 1, kMaxLength},
      {"kv-batch-heads", FlagKind::kInt,
       "KV batch*heads, for the CPU decision (default --batch-heads)", 1, kMaxLength},
      {"custom-scale", FlagKind::kBool, "the model sets a custom qk_scale (optimum-neuron)"},
      {"kernel-enabled", FlagKind::kChoice,
       "NxD attn_kernel_enabled: default (unset), true (explicit) or false", 0, 0,
       "default|true|false"},
      {"cp-degree", FlagKind::kInt, "context-parallel degree (default 1)", 1, 1 << 20},
      {"strided", FlagKind::kBool, "NxD's strided CP kernel is enabled"},
      {"sliding-window", FlagKind::kInt, "sliding window (default 0: none)", 0, kMaxLength},
      {"attention-mask", FlagKind::kBool, "the prefill carries an attention mask (NxD)"},
      {"causal", FlagKind::kBool, "causal mask, for the CPU decision (default true)"},
      {"dtype", FlagKind::kChoice, "compute dtype, for the CPU decision (default float32)", 0, 0,
       "float32|bfloat16|float16|fp32|bf16|fp16"},
      {"threads", FlagKind::kInt, "threads for the CPU decision (0: OpenMP's default)", 0, 4096},
  };
}

// A reason under its strategy: one line per "; "-separated part (a demotion by optimum-neuron's
// rule 5 reads as a second step), indented to the strategy column.
std::string Indented(const std::string& reason) {
  std::string out;
  size_t start = 0;
  for (;;) {
    const size_t end = reason.find("; ", start);
    out += "                  " + reason.substr(start, end - start) + "\n";
    if (end == std::string::npos) return out;
    start = end + 2;
  }
}

void PrintStrategyHelp(const std::vector<FlagSpec>& specs) {
  std::printf(
      "usage: flashcte strategy --sq N [--d N --lnc N --batch-heads N --custom-scale B\n"
      "                         --kernel-enabled default|true|false --cp-degree N --strided B\n"
      "                         --sliding-window N --attention-mask B --skv N\n"
      "                         --kv-batch-heads N --causal B --dtype D --threads T]\n\n"
      "Prints the attention strategy three callers would pick for this prefill shape, and the\n"
      "rule that decided:\n"
      "  optimum-neuron  get_flash_attention_strategy (NONE, UNSHARDED_KERNEL, SHARDED_KERNEL,\n"
      "                  LARGE_D_UNSHARDED_KERNEL, LARGE_D_SHARDED_KERNEL): --d --sq --lnc\n"
      "                  --custom-scale --batch-heads;\n"
      "  NxD Inference   (NONE, UNSHARDED, SHARDED, CONTEXT_PARALLEL, "
      "STRIDED_CONTEXT_PARALLEL):\n"
      "                  --kernel-enabled --cp-degree --strided --sliding-window --lnc --sq --d\n"
      "                  --attention-mask;\n"
      "  flashcte (CPU)  materialized NONE or the flash KERNEL, and threads: --batch-heads\n"
      "                  --kv-batch-heads --sq --skv --d --causal --dtype --threads (a sliding\n"
      "                  window or --cp-degree > 1 count as non-plain modes).\n"
      "Both Neuron decisions follow shared/spec/SEMANTICS.md, quirks included. Nothing is\n"
      "computed.\n\nflags:\n%s",
      FlagsHelp(specs).c_str());
}

}  // namespace

int StrategyCommand(const std::vector<std::string>& args) {
  ParsedFlags f;
  if (int rc = ParseCommandFlags(kCommand, args, StrategyFlagSpecs(), PrintStrategyHelp, &f);
      rc != kContinue) {
    return rc;
  }
  if (!f.has("sq")) return UsageError(kCommand, "--sq is required");
  if (f.integer("batch-heads", 1) % f.integer("kv-batch-heads", f.integer("batch-heads", 1)) != 0) {
    return UsageError(kCommand, "--kv-batch-heads: must divide --batch-heads");
  }

  NeuronStrategyInputs neuron;
  neuron.head_dim = f.integer("d", 128);
  neuron.seqlen_q = f.integer("sq", 0);
  neuron.logical_cores = f.integer("lnc", 1);
  neuron.custom_qk_scale = f.boolean("custom-scale", false);
  neuron.batch_heads = f.integer("batch-heads", 1);

  NxdiStrategyInputs nxdi;
  const std::string enabled = f.text("kernel-enabled", "default");
  if (enabled != "default") nxdi.attn_kernel_enabled = enabled == "true";
  nxdi.cp_degree = f.integer("cp-degree", 1);
  nxdi.strided_cp_enabled = f.boolean("strided", false);
  nxdi.sliding_window = f.integer("sliding-window", 0);
  nxdi.logical_cores = neuron.logical_cores;
  nxdi.seqlen_q = neuron.seqlen_q;
  nxdi.head_dim = neuron.head_dim;
  nxdi.attention_mask = f.boolean("attention-mask", false);

  CpuStrategyInputs cpu;
  cpu.batch = neuron.batch_heads;
  cpu.kv_batch = f.integer("kv-batch-heads", cpu.batch);
  cpu.seqlen_q = neuron.seqlen_q;
  cpu.seqlen_kv = f.integer("skv", cpu.seqlen_q);
  cpu.head_dim = neuron.head_dim;
  cpu.causal = f.boolean("causal", true);
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &cpu.dtype);
  cpu.plain = nxdi.sliding_window == 0 && nxdi.cp_degree == 1;
  cpu.threads = static_cast<int>(f.integer("threads", 0));

  NeuronDecision neuron_decision;
  NxdiDecision nxdi_decision;
  CpuDecision cpu_decision;
  // Every input came from a range-checked flag, so a rejected one is a usage error.
  for (const Status& s : {neuron_strategy(neuron, &neuron_decision),
                          nxdi_strategy(nxdi, &nxdi_decision), cpu_strategy(cpu, &cpu_decision)}) {
    if (!s.ok) return UsageError(kCommand, s.message);
  }

  std::printf("strategy for d=%lld, q=%lld, lnc=%lld, batch*heads=%lld:\n",
              static_cast<long long>(neuron.head_dim), static_cast<long long>(neuron.seqlen_q),
              static_cast<long long>(neuron.logical_cores),
              static_cast<long long>(neuron.batch_heads));
  std::printf("  optimum-neuron  %s\n%s", strategy_name(neuron_decision.strategy),
              Indented(neuron_decision.reason).c_str());
  std::printf("  NxD Inference   %s\n%s", strategy_name(nxdi_decision.strategy),
              Indented(nxdi_decision.reason).c_str());
  std::printf("  flashcte (CPU)  %s, %d thread%s\n%s", strategy_name(cpu_decision.strategy),
              cpu_decision.threads, cpu_decision.threads == 1 ? "" : "s",
              Indented(cpu_decision.reason).c_str());
  return kExitOk;
}

}  // namespace flashcte::tools
