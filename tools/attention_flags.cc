#include "tools/attention_flags.h"

#include <cinttypes>
#include <cstdio>

#include "tools/commands.h"

namespace flashcte::tools {
namespace {

// Generous bounds that only catch typos and overflow; the library applies its own exact rules
// and its messages come back translated to these flag names.
constexpr int64_t kMaxLength = int64_t{1} << 40;
constexpr int64_t kMaxTile = int64_t{1} << 30;

}  // namespace

std::vector<FlagSpec> ModeFlagSpecs() {
  return {
      {"scale", FlagKind::kFloat, "score scale applied to q.k (default 1.0; any value, any mode)"},
      {"causal-mask", FlagKind::kBool, "causal masking (default true)"},
      {"sliding-window", FlagKind::kInt, "keep the N most recent positions, own included (0: off)",
       0, kMaxLength},
      {"prior-used-len", FlagKind::kIntList,
       "valid prior tokens: one value, or one per KV batch (default: all of S_prior)", 0,
       kMaxLength},
      {"cp-offset", FlagKind::kInt, "context parallelism: global position of local query row 0", 0,
       kMaxLength},
      {"global-cp-deg", FlagKind::kInt, "context-parallel degree (needs --cp-offset)", 1,
       kMaxLength},
      {"cp-strided-q-slicing", FlagKind::kBool,
       "local row i is global row cp_offset + i*global_cp_deg (default false)"},
      {"bound-min", FlagKind::kString,
       "packing: per-row first allowed KV index, (Sq,1) or (Sq,) int32/int64/float32 .npy"},
      {"bound-max", FlagKind::kString, "packing: per-row end (exclusive) of the allowed KV range"},
      {"softcap", FlagKind::kFloat, "logit soft-capping: S -> c*tanh(S/c) after scale (0: off)"},
      {"window-left", FlagKind::kInt,
       "FlashAttention window_size left: keys at most N positions back (-1: unbounded)", -1,
       kMaxLength},
      {"window-right", FlagKind::kInt,
       "FlashAttention window_size right: keys at most N positions ahead (-1: unbounded)", -1,
       kMaxLength},
      {"bottom-right", FlagKind::kBool,
       "FlashAttention's causal alignment: the last query sits at the last key (default false)"},
      {"dtype", FlagKind::kChoice, "compute dtype; inputs are rounded to it (nearest even)", 0, 0,
       "float32|bfloat16|float16|fp32|bf16|fp16"},
      {"threads", FlagKind::kInt, "worker threads (0: OpenMP's default)", 0, 4096},
      {"q-block", FlagKind::kInt, "query rows per work item (0: automatic; Neuron: 128)", 0,
       kMaxTile},
      {"kv-tile", FlagKind::kInt, "KV columns per streamed tile (0: automatic; Neuron: 512)", 0,
       kMaxTile},
      {"section", FlagKind::kInt, "KV columns per softmax section (0: one tile; Neuron: 8192)", 0,
       kMaxTile},
      {"section-threshold", FlagKind::kInt,
       "section only when the KV length exceeds this (Neuron: 10240)", 0, kMaxLength},
  };
}

int CheckModeFlags(const ParsedFlags& flags, std::string* error) {
  if (flags.has("bound-min") != flags.has("bound-max")) {
    *error = flags.has("bound-min") ? "--bound-min: needs --bound-max too"
                                    : "--bound-max: needs --bound-min too";
    return kExitUsage;
  }
  if (flags.has("global-cp-deg") && !flags.has("cp-offset")) {
    *error = "--global-cp-deg: needs --cp-offset (the global position of local row 0)";
    return kExitUsage;
  }
  if (flags.boolean("cp-strided-q-slicing", false) &&
      !(flags.has("cp-offset") && flags.has("global-cp-deg"))) {
    *error = "--cp-strided-q-slicing: needs --cp-offset and --global-cp-deg";
    return kExitUsage;
  }
  return kExitOk;
}

int ApplyModeFlags(const ParsedFlags& flags, Options* o, HostTensor* bound_min,
                   HostTensor* bound_max, std::string* error) {
  o->scale = static_cast<float>(flags.real("scale", 1.0));
  o->causal_mask = flags.boolean("causal-mask", true);
  o->sliding_window = flags.integer("sliding-window", 0);
  o->prior_used_len = flags.list("prior-used-len");
  if (flags.has("cp-offset")) o->cp_offset = flags.integer("cp-offset", 0);
  if (flags.has("global-cp-deg")) o->global_cp_deg = flags.integer("global-cp-deg", 1);
  o->cp_strided_q_slicing = flags.boolean("cp-strided-q-slicing", false);
  o->softcap = static_cast<float>(flags.real("softcap", 0.0));
  o->window_left = flags.integer("window-left", -1);
  o->window_right = flags.integer("window-right", -1);
  o->bottom_right = flags.boolean("bottom-right", false);
  o->num_threads = static_cast<int>(flags.integer("threads", 0));
  o->tiles.q_block = flags.integer("q-block", 0);
  o->tiles.kv_tile = flags.integer("kv-tile", 0);
  o->tiles.section = flags.integer("section", 0);
  o->tiles.section_threshold = flags.integer("section-threshold", 0);
  if (flags.has("bound-min")) {
    if (!LoadBoundsTensor("--bound-min", flags.text("bound-min"), bound_min, error) ||
        !LoadBoundsTensor("--bound-max", flags.text("bound-max"), bound_max, error)) {
      return kExitRuntime;
    }
    o->bound_min = bound_min->view();
    o->bound_max = bound_max->view();
  }
  return kExitOk;
}

const std::map<std::string, std::string>& ArgumentFlagNames() {
  static const std::map<std::string, std::string> names = {
      {"q", "--q"},
      {"k", "--k"},
      {"v", "--v"},
      {"out", "--out"},
      {"k_prior", "--k-prior"},
      {"v_prior", "--v-prior"},
      {"prior_used_len", "--prior-used-len"},
      {"sink", "--sink"},
      {"scale", "--scale"},
      {"sliding_window", "--sliding-window"},
      {"cp_offset", "--cp-offset"},
      {"global_cp_deg", "--global-cp-deg"},
      {"softcap", "--softcap"},
      {"window_left", "--window-left"},
      {"window_right", "--window-right"},
      {"alibi_slopes", "--alibi-slopes"},
      {"key_bias", "--key-bias"},
      {"bound_min", "--bound-min"},
      {"bound_max", "--bound-max"},
      {"neg_max", "--neg-max"},
      {"sum_recip", "--sum-recip"},
      {"lse", "--lse"},
      {"num_threads", "--threads"},
      {"tiles.q_block", "--q-block"},
      {"tiles.kv_tile", "--kv-tile"},
      {"tiles.section", "--section"},
      {"tiles.section_threshold", "--section-threshold"},
  };
  return names;
}

double UnmaskedPairs(int64_t sq, int64_t skv, bool causal) {
  if (!causal) return static_cast<double>(sq) * static_cast<double>(skv);
  // Row i sees min(i + 1, skv) keys: a triangle over the first min(sq, skv) rows, full rows
  // after that.
  const double n = static_cast<double>(sq < skv ? sq : skv);
  return n * (n + 1) / 2 + static_cast<double>(sq - static_cast<int64_t>(n)) * skv;
}

std::string DescribePlan(const PlanSummary& p) {
  char buf[1024];
  std::string s;
  std::snprintf(buf, sizeof(buf),
                "  shape        bs %" PRId64 " (KV %" PRId64 "), Sq %" PRId64 ", Skv %" PRId64
                " (incl. prior), d %" PRId64 ", dv %" PRId64 "\n",
                p.batch, p.kv_batch, p.seqlen_q, p.seqlen_kv, p.head_dim, p.value_dim);
  s += buf;
  std::snprintf(buf, sizeof(buf),
                "  tiles        q_block %" PRId64 ", kv_tile %" PRId64 ", section %" PRId64
                ", section_threshold %" PRId64 "\n",
                p.tiles.q_block, p.tiles.kv_tile, p.tiles.section, p.tiles.section_threshold);
  s += buf;
  std::snprintf(buf, sizeof(buf),
                "  per batch    %" PRId64 " Q blocks x %" PRId64 " KV tiles, %" PRId64
                " section(s)\n",
                p.q_blocks, p.kv_tiles, p.sections);
  s += buf;
  std::snprintf(buf, sizeof(buf), "  work items   %" PRId64 " on %d thread(s)\n", p.work_items,
                p.threads);
  s += buf;
  const int64_t total = p.tiles_full + p.tiles_masked + p.tiles_skipped;
  const double pct = total > 0 ? 100.0 / static_cast<double>(total) : 0.0;
  std::snprintf(buf, sizeof(buf),
                "  tile pairs   %" PRId64 " full (%.1f%%), %" PRId64 " masked (%.1f%%), %" PRId64
                " skipped (%.1f%%)\n",
                p.tiles_full, p.tiles_full * pct, p.tiles_masked, p.tiles_masked * pct,
                p.tiles_skipped, p.tiles_skipped * pct);
  s += buf;
  std::snprintf(
      buf, sizeof(buf), "  FLOPs        done %s, dense %s, useful %s (done/useful %.3f)\n",
      FormatG(p.flops_done).c_str(), FormatG(p.flops_dense).c_str(),
      FormatG(p.flops_useful).c_str(), p.flops_useful > 0 ? p.flops_done / p.flops_useful : 0.0);
  s += buf;
  return s;
}

}  // namespace flashcte::tools
