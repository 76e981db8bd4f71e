// `flashcte run`: attention_cte on .npy files. Every kernel argument is a flag; tensors are read
// from float16/float32/float64 files, rounded to the compute dtype, and every output is written
// as float32 .npy.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/args.h"
#include "tools/attention_flags.h"
#include "tools/commands.h"
#include "tools/npy.h"
#include "tools/tensors.h"

namespace flashcte::tools {
namespace {

constexpr char kCommand[] = "run";

std::vector<FlagSpec> RunFlagSpecs() {
  std::vector<FlagSpec> specs = {
      {"q", FlagKind::kString, "queries: (bs, Sq, d), or (bs, d, Sq) with --tp-q false"},
      {"k", FlagKind::kString, "keys: (bs_kv, d, Skv), or (bs_kv, Skv, d) with --tp-k true"},
      {"v", FlagKind::kString, "values: (bs_kv, Skv, dv)"},
      {"out", FlagKind::kString,
       "output .npy (float32): (bs, Sq, dv), or (bs, dv, Sq) with --tp-out"},
      {"k-prior", FlagKind::kString, "prefix cache keys, laid out like --k (with --v-prior)"},
      {"v-prior", FlagKind::kString, "prefix cache values: (bs_kv, S_prior, dv)"},
      {"sink", FlagKind::kString, "attention sink logits: (bs, 1) or (bs,); not scaled"},
      {"alibi-slopes", FlagKind::kString, "ALiBi slopes, one per batch*head: (bs,) or (bs, 1)"},
      {"key-bias", FlagKind::kString,
       "additive bias per key: (bs, prior_used_len + Skv) float32; -inf masks a key"},
      {"tp-q", FlagKind::kBool, "q is (bs, Sq, d) (default true)"},
      {"tp-k", FlagKind::kBool, "k is (bs_kv, Skv, d) (default false: (bs_kv, d, Skv))"},
      {"tp-out", FlagKind::kBool, "write out as (bs, dv, Sq) (default false)"},
      {"cache-softmax", FlagKind::kBool,
       "also write --neg-max and --sum-recip, Neuron layout (bs, 128, Sq/128)"},
      {"neg-max", FlagKind::kString, "output: -max of each score row (with --cache-softmax)"},
      {"sum-recip", FlagKind::kString, "output: 1/sum of exp(S - max) (with --cache-softmax)"},
      {"lse", FlagKind::kString, "output: log-sum-exp per row, (bs, Sq), any Sq"},
  };
  for (const FlagSpec& s : ModeFlagSpecs()) specs.push_back(s);
  return specs;
}

void PrintRunHelp(const std::vector<FlagSpec>& specs) {
  std::printf(
      "usage: flashcte run --q Q.npy --k K.npy --v V.npy --out OUT.npy [flags]\n"
      "\n"
      "Computes attention_cte (shared/spec/SEMANTICS.md) on .npy files. Batch and heads are one\n"
      "axis (bs = batch*heads; GQA when bs is a multiple of bs_kv). Inputs may be float16,\n"
      "float32 or float64; they are rounded to --dtype (default: float16 for a float16 q file,\n"
      "else float32). Outputs are float32.\n"
      "\n"
      "flags:\n%s",
      FlagsHelp(specs).c_str());
}

// Checks the flags that only make sense together, before touching any file.
int CheckFlags(const ParsedFlags& f, std::string* error) {
  for (const char* required : {"q", "k", "v", "out"}) {
    if (!f.has(required)) {
      *error = std::string("--") + required + " is required";
      return kExitUsage;
    }
  }
  if (f.has("k-prior") != f.has("v-prior")) {
    *error = f.has("k-prior") ? "--k-prior: needs --v-prior too" : "--v-prior: needs --k-prior too";
    return kExitUsage;
  }
  if (f.has("prior-used-len") && !f.has("k-prior")) {
    *error = "--prior-used-len: needs --k-prior and --v-prior";
    return kExitUsage;
  }
  const bool cache = f.boolean("cache-softmax", false);
  if (cache && !(f.has("neg-max") && f.has("sum-recip"))) {
    *error = "--cache-softmax: needs --neg-max NM.npy and --sum-recip SR.npy (output files)";
    return kExitUsage;
  }
  if (!cache && (f.has("neg-max") || f.has("sum-recip"))) {
    *error = std::string(f.has("neg-max") ? "--neg-max" : "--sum-recip") +
             ": only written with --cache-softmax true (use --lse for the log-sum-exp alone)";
    return kExitUsage;
  }
  return CheckModeFlags(f, error);
}

// Names each library argument after its flag and, for files, the file.
std::map<std::string, std::string> ArgumentNames(const ParsedFlags& f) {
  std::map<std::string, std::string> names = ArgumentFlagNames();
  for (auto& [arg, flag] : names) {
    const std::string flag_name = flag.substr(2);
    if (f.has(flag_name) &&
        (arg == "q" || arg == "k" || arg == "v" || arg == "out" || arg == "k_prior" ||
         arg == "v_prior" || arg == "sink" || arg == "bound_min" || arg == "bound_max" ||
         arg == "alibi_slopes" || arg == "key_bias" || arg == "neg_max" || arg == "sum_recip" ||
         arg == "lse")) {
      flag += " " + f.text(flag_name);
    }
  }
  return names;
}

bool IsScalarArgument(const std::string& argument) {
  return argument == "scale" || argument == "sliding_window" || argument == "prior_used_len" ||
         argument == "softcap" || argument == "window_left" || argument == "window_right" ||
         argument == "cp_offset" || argument == "global_cp_deg" || argument == "num_threads" ||
         argument.compare(0, 6, "tiles.") == 0;
}

// The tensors a run reads, in the compute dtype (float32 for sink, ALiBi slopes and key bias).
struct RunInputs {
  DType dtype = DType::kFloat32;
  HostTensor q, k, v, k_prior, v_prior, sink, alibi_slopes, key_bias;
};

// Reads the input files into *in and points o's optional inputs at them. Returns the exit code,
// with the message in *error.
int LoadInputs(const ParsedFlags& f, Options* o, RunInputs* in, std::string* error) {
  // The compute dtype: as asked, or what q's file holds.
  NpyArray q_file;
  if (!read_npy(f.text("q"), &q_file, error)) {
    *error = "--q: " + *error;
    return kExitRuntime;
  }
  if (f.has("dtype")) {
    ParseFloatDType(f.text("dtype"), &in->dtype);  // the flag's choices are all valid dtypes
  } else {
    in->dtype = NaturalDType(q_file.dtype);
  }
  if (!ConvertFloatArray(q_file, in->dtype, &in->q)) {
    *error = "--q: " + f.text("q") + ": dtype " + npy_dtype_name(q_file.dtype) +
             " is not a floating-point type (expected float32, float16 or float64)";
    return kExitRuntime;
  }
  q_file = NpyArray();  // release the file image before loading the rest
  if (in->q.rank() != 3) {
    *error = "--q: " + f.text("q") + ": shape " + shape_string(in->q.shape()) +
             " must have rank 3: " + (o->tp_q ? "(bs, Sq, d)" : "(bs, d, Sq) with --tp-q false");
    return kExitRuntime;
  }
  if (!LoadFloatTensor("--k", f.text("k"), in->dtype, &in->k, error) ||
      !LoadFloatTensor("--v", f.text("v"), in->dtype, &in->v, error)) {
    return kExitRuntime;
  }
  if (f.has("k-prior")) {
    if (!LoadFloatTensor("--k-prior", f.text("k-prior"), in->dtype, &in->k_prior, error) ||
        !LoadFloatTensor("--v-prior", f.text("v-prior"), in->dtype, &in->v_prior, error)) {
      return kExitRuntime;
    }
    o->k_prior = in->k_prior.view();
    o->v_prior = in->v_prior.view();
  }
  const struct {
    const char* flag;
    HostTensor* tensor;
    TensorView* option;
  } float32_inputs[] = {{"sink", &in->sink, &o->sink},
                        {"alibi-slopes", &in->alibi_slopes, &o->alibi_slopes},
                        {"key-bias", &in->key_bias, &o->key_bias}};
  for (const auto& input : float32_inputs) {
    if (!f.has(input.flag)) continue;
    if (!LoadFloatTensor(std::string("--") + input.flag, f.text(input.flag), DType::kFloat32,
                         input.tensor, error)) {
      return kExitRuntime;
    }
    *input.option = input.tensor->view();
  }
  return kExitOk;
}

// The outputs of a run: shapes follow q and v (the library checks everything else).
struct RunOutputs {
  HostTensor out, neg_max, sum_recip, lse;
  Outputs views;
};

// Allocates the outputs the flags ask for. Returns the exit code, with the message in *error.
int AllocateOutputs(const ParsedFlags& f, const Options& o, const RunInputs& in, RunOutputs* r,
                    std::string* error) {
  const int64_t bs = in.q.shape()[0];
  const int64_t sq = in.q.shape()[o.tp_q ? 1 : 2];
  const int64_t dv = in.v.rank() == 3 ? in.v.shape()[2] : 0;
  if (o.cache_softmax && sq % 128 != 0) {
    *error =
        "--cache-softmax: --neg-max and --sum-recip use the Neuron layout (bs, 128, Sq/128), "
        "which needs Sq to be a multiple of 128, but " +
        f.text("q") + " has Sq = " + std::to_string(sq) +
        "; use --lse L.npy, which works for any Sq";
    return kExitUsage;
  }
  r->out = HostTensor(
      in.dtype, o.tp_out ? std::vector<int64_t>{bs, dv, sq} : std::vector<int64_t>{bs, sq, dv});
  r->views.out = r->out.mutable_view();
  if (o.cache_softmax) {
    r->neg_max = HostTensor(DType::kFloat32, {bs, 128, sq / 128});
    r->sum_recip = HostTensor(DType::kFloat32, {bs, 128, sq / 128});
    r->views.neg_max = r->neg_max.mutable_view();
    r->views.sum_recip = r->sum_recip.mutable_view();
  }
  if (f.has("lse")) {
    r->lse = HostTensor(DType::kFloat32, {bs, sq});
    r->views.lse = r->lse.mutable_view();
  }
  return kExitOk;
}

// Writes every output asked for as float32 .npy; false with the message in *error.
bool SaveOutputs(const ParsedFlags& f, const Options& o, const RunOutputs& r, std::string* error) {
  if (!SaveFloat32("--out", f.text("out"), ToFloat32(r.out), r.out.shape(), error)) return false;
  if (o.cache_softmax && (!SaveFloat32("--neg-max", f.text("neg-max"), ToFloat32(r.neg_max),
                                       r.neg_max.shape(), error) ||
                          !SaveFloat32("--sum-recip", f.text("sum-recip"), ToFloat32(r.sum_recip),
                                       r.sum_recip.shape(), error))) {
    return false;
  }
  return !f.has("lse") ||
         SaveFloat32("--lse", f.text("lse"), ToFloat32(r.lse), r.lse.shape(), error);
}

}  // namespace

int RunCommand(const std::vector<std::string>& args) {
  ParsedFlags f;
  if (int rc = ParseCommandFlags(kCommand, args, RunFlagSpecs(), PrintRunHelp, &f);
      rc != kContinue) {
    return rc;
  }
  std::string error;
  if (int rc = CheckFlags(f, &error); rc != kExitOk) return UsageError(kCommand, error);

  Options o;
  HostTensor bound_min, bound_max;
  if (int rc = ApplyModeFlags(f, &o, &bound_min, &bound_max, &error); rc != kExitOk) {
    return rc == kExitUsage ? UsageError(kCommand, error) : RuntimeError(kCommand, error);
  }
  o.tp_q = f.boolean("tp-q", true);
  o.tp_k = f.boolean("tp-k", false);
  o.tp_out = f.boolean("tp-out", false);
  o.cache_softmax = f.boolean("cache-softmax", false);

  RunInputs in;
  RunOutputs r;
  if (int rc = LoadInputs(f, &o, &in, &error); rc != kExitOk) return RuntimeError(kCommand, error);
  if (int rc = AllocateOutputs(f, o, in, &r, &error); rc != kExitOk) {
    return UsageError(kCommand, error);
  }

  const auto start = std::chrono::steady_clock::now();
  const Status status = attention_cte(in.q.view(), in.k.view(), in.v.view(), r.views, o);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!status.ok) {
    // A rule broken by a number on the command line is a usage error; one broken by a file's
    // shape or contents is a runtime error.
    const std::string message =
        "attention_cte rejected the arguments: " + ExplainStatus(status.message, ArgumentNames(f));
    const std::string argument = status.message.substr(0, status.message.find(':'));
    return IsScalarArgument(argument) ? UsageError(kCommand, message)
                                      : RuntimeError(kCommand, message);
  }
  if (!SaveOutputs(f, o, r, &error)) return RuntimeError(kCommand, error);
  std::printf("wrote %s %s float32 (computed in %s) in %.3f ms\n", f.text("out").c_str(),
              shape_string(r.out.shape()).c_str(), dtype_name(in.dtype), ms);
  return kExitOk;
}

}  // namespace flashcte::tools
