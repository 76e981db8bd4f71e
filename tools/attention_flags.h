// The flags that set attention_cte's mode (everything but the tensors' shapes and files),
// shared by `run` and `plan` so both spell and check them the same way.
#ifndef FLASHCTE_TOOLS_ATTENTION_FLAGS_H_
#define FLASHCTE_TOOLS_ATTENTION_FLAGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/args.h"
#include "tools/tensors.h"

namespace flashcte::tools {

// --scale --causal-mask --sliding-window --prior-used-len --cp-offset --global-cp-deg
// --cp-strided-q-slicing --bound-min --bound-max --softcap --window-left --window-right
// --bottom-right --dtype --threads --q-block --kv-tile --section --section-threshold.
std::vector<FlagSpec> ModeFlagSpecs();

// Checks the flags that only make sense together (exit code kExitUsage on failure).
int CheckModeFlags(const ParsedFlags& flags, std::string* error);

// Sets every Options field the mode flags describe, reading the packing bounds files into
// `bound_min`/`bound_max` (which must outlive `options`). Returns kExitOk or an exit code.
int ApplyModeFlags(const ParsedFlags& flags, Options* options, HostTensor* bound_min,
                   HostTensor* bound_max, std::string* error);

// attention_cte argument name -> the flag that sets it, for ExplainStatus.
const std::map<std::string, std::string>& ArgumentFlagNames();

// Query-key pairs left unmasked by plain causal masking (query i sees keys 0..i, as in
// SEMANTICS.md without prefix or context parallelism) or by no mask.
double UnmaskedPairs(int64_t seqlen_q, int64_t seqlen_kv, bool causal);

// A multi-line, indented description of a plan.
std::string DescribePlan(const PlanSummary& plan);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_ATTENTION_FLAGS_H_
