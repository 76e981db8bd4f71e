// `flashcte plan`: what attention_cte would do for a shape and mode, without computing it.
// Shapes come from flags; q, k and v are views with null data, which plan_attention accepts.
#include <cstdio>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/args.h"
#include "tools/attention_flags.h"
#include "tools/commands.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "plan";
constexpr int64_t kMaxLength = int64_t{1} << 40;

std::vector<FlagSpec> PlanFlagSpecs() {
  std::vector<FlagSpec> specs = {
      {"bs", FlagKind::kInt, "query batch*heads (default 1)", 0, kMaxLength},
      {"bs-kv", FlagKind::kInt, "KV batch*heads (default --bs)", 0, kMaxLength},
      {"sq", FlagKind::kInt, "query length (required)", 0, kMaxLength},
      {"skv", FlagKind::kInt, "KV length, without the prior (default --sq)", 0, kMaxLength},
      {"d", FlagKind::kInt, "head dim of q and k (default 128)", 1, 1 << 20},
      {"dv", FlagKind::kInt, "head dim of v (default --d)", 1, 1 << 20},
      {"s-prior", FlagKind::kInt, "prefix cache length S_prior (default 0: none)", 0, kMaxLength},
  };
  for (const FlagSpec& s : ModeFlagSpecs()) specs.push_back(s);
  return specs;
}

void PrintPlanHelp(const std::vector<FlagSpec>& specs) {
  std::printf(
      "usage: flashcte plan --sq N [--bs N --bs-kv N --skv N --d N --dv N --s-prior N] "
      "[mode flags]\n\n"
      "Prints the schedule attention_cte would follow: Q blocks, KV tiles, sections, work\n"
      "items, tile pairs computed unmasked / masked / skipped, and FLOPs done vs dense vs\n"
      "useful. Nothing is computed.\n\nflags:\n%s",
      FlagsHelp(specs).c_str());
}

}  // namespace

int PlanCommand(const std::vector<std::string>& args) {
  ParsedFlags f;
  if (int rc = ParseCommandFlags(kCommand, args, PlanFlagSpecs(), PrintPlanHelp, &f);
      rc != kContinue) {
    return rc;
  }
  if (!f.has("sq")) return UsageError(kCommand, "--sq is required");
  std::string error;
  if (int rc = CheckModeFlags(f, &error); rc != kExitOk) return UsageError(kCommand, error);
  if (f.has("prior-used-len") && f.integer("s-prior", 0) == 0) {
    return UsageError(kCommand, "--prior-used-len: needs --s-prior (the prefix cache length)");
  }

  Options o;
  HostTensor bound_min, bound_max;
  if (int rc = ApplyModeFlags(f, &o, &bound_min, &bound_max, &error); rc != kExitOk) {
    return rc == kExitUsage ? UsageError(kCommand, error) : RuntimeError(kCommand, error);
  }
  DType dtype = DType::kFloat32;
  if (f.has("dtype")) ParseFloatDType(f.text("dtype"), &dtype);

  const int64_t bs = f.integer("bs", 1);
  const int64_t bs_kv = f.integer("bs-kv", bs);
  const int64_t sq = f.integer("sq", 0);
  const int64_t skv = f.integer("skv", sq);
  const int64_t d = f.integer("d", 128);
  const int64_t dv = f.integer("dv", d);
  const int64_t s_prior = f.integer("s-prior", 0);

  // Shapes only: plan_attention reads no q, k or v data.
  auto shape_view = [dtype](const std::vector<int64_t>& shape) {
    return TensorView::contiguous(nullptr, dtype, shape);
  };
  const TensorView q = shape_view({bs, sq, d});
  const TensorView k = shape_view({bs_kv, d, skv});
  const TensorView v = shape_view({bs_kv, skv, dv});
  // plan_attention reads the priors' shapes only, but validation wants their data present. A
  // broadcast view (all strides 0) of one element stands in for a prior of any size without
  // allocating it.
  alignas(8) static const uint32_t kOneElement[2] = {0, 0};
  if (s_prior > 0) {
    o.k_prior = shape_view({bs_kv, d, s_prior});
    o.v_prior = shape_view({bs_kv, s_prior, dv});
    for (TensorView* t : {&o.k_prior, &o.v_prior}) {
      t->data = kOneElement;
      t->strides = {0, 0, 0};
    }
  }

  PlanSummary plan;
  const Status status = plan_attention(q, k, v, o, &plan);
  if (!status.ok) {
    std::map<std::string, std::string> names = ArgumentFlagNames();
    names["q"] = "--bs/--sq/--d";
    names["k"] = "--bs-kv/--skv/--d";
    names["v"] = "--bs-kv/--skv/--dv";
    names["k_prior"] = names["v_prior"] = "--s-prior";
    // Every shape and value here came from a flag, so a broken rule is a usage error, except
    // for what the packing bounds files hold.
    const std::string argument = status.message.substr(0, status.message.find(':'));
    const std::string message = ExplainStatus(status.message, names);
    return argument == "bound_min" || argument == "bound_max" ? RuntimeError(kCommand, message)
                                                              : UsageError(kCommand, message);
  }
  std::printf(
      "plan for attention_cte (%s, %s%s):\n", dtype_name(dtype),
      o.causal_mask ? "causal" : "non-causal",
      o.sliding_window > 0 ? (", sliding window " + std::to_string(o.sliding_window)).c_str() : "");
  std::printf("%s", DescribePlan(plan).c_str());
  std::printf("  SIMD target  %s\n", simd_target().c_str());
  return kExitOk;
}

}  // namespace flashcte::tools
