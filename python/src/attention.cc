// The attention calls: attention_cte, flash_attn_with_kvcache, the mixed batch
// (flash_attn_varlen_kvcache), quantize_kv and merge_attn_states, each into caller-allocated
// outputs with every option by keyword (arrays.h's tables).
#include <string>

#include "flashcte/flashcte.h"
#include "flashcte/kvcache.h"
#include "flashcte/merge.h"
#include "python/src/arrays.h"
#include "python/src/bindings.h"

namespace flashcte::python {
namespace {

const OptionTable<flashcte::Options> kAttentionOptions[] = {
    FLASHCTE_TENSOR_OPTION(flashcte::Options, k_prior),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, v_prior),
    FLASHCTE_VALUE_OPTION(flashcte::Options, prior_used_len, std::vector<int64_t>),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, prior_block_table),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, k_prior_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, v_prior_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, sink),
    FLASHCTE_VALUE_OPTION(flashcte::Options, scale, float),
    FLASHCTE_VALUE_OPTION(flashcte::Options, causal_mask, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, sliding_window, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, tp_q, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, tp_k, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, tp_out, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, cache_softmax, bool),
    FLASHCTE_VALUE_OPTION(flashcte::Options, cp_offset, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, global_cp_deg, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, cp_strided_q_slicing, bool),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, bound_min),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, bound_max),
    FLASHCTE_VALUE_OPTION(flashcte::Options, num_threads, int),
    // (q_block, kv_tile, section, section_threshold), or empty for the kernel's choice.
    OptionTable<flashcte::Options>{"tiles",
                                   [](Imports&, flashcte::Options& o, nb::handle h) {
                                     const auto t = nb::cast<std::vector<int64_t>>(h);
                                     if (t.empty()) return;
                                     if (t.size() != 4) {
                                       throw nb::value_error(
                                           "tiles: must hold (q_block, kv_tile, section, "
                                           "section_threshold)");
                                     }
                                     o.tiles = {t[0], t[1], t[2], t[3]};
                                   }},
    FLASHCTE_VALUE_OPTION(flashcte::Options, softcap, float),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, alibi_slopes),
    FLASHCTE_TENSOR_OPTION(flashcte::Options, key_bias),
    FLASHCTE_VALUE_OPTION(flashcte::Options, window_left, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, window_right, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::Options, bottom_right, bool),
};

const OptionTable<flashcte::KvCacheOptions> kKvCacheOptions[] = {
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, k),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, v),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, rotary_cos),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, rotary_sin),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, rotary_interleaved, bool),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, cache_seqlens),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, cache_batch_idx),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, cache_leftpad),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, block_table),
    FLASHCTE_CACHE_OPTION(flashcte::KvCacheOptions, k_scale),
    FLASHCTE_CACHE_OPTION(flashcte::KvCacheOptions, v_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, alibi_slopes),
    FLASHCTE_TENSOR_OPTION(flashcte::KvCacheOptions, sinks),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, softmax_scale, float),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, causal, bool),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, window_left, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, window_right, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, softcap, float),
    FLASHCTE_VALUE_OPTION(flashcte::KvCacheOptions, num_threads, int),
};
const OptionTable<flashcte::VarlenKvCacheOptions> kVarlenKvCacheOptions[] = {
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, cu_seqlens_q),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, seqused_k),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, block_table),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, k_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, v_scale),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, alibi_slopes),
    FLASHCTE_TENSOR_OPTION(flashcte::VarlenKvCacheOptions, sinks),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, softmax_scale, float),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, causal, bool),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, window_left, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, window_right, int64_t),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, softcap, float),
    FLASHCTE_VALUE_OPTION(flashcte::VarlenKvCacheOptions, num_threads, int),
};
#undef FLASHCTE_TENSOR_OPTION
#undef FLASHCTE_CACHE_OPTION
#undef FLASHCTE_VALUE_OPTION

// attention_cte into caller-allocated outputs; every other argument by keyword, as Options names
// it.
void attention_cte(nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle neg_max,
                   nb::handle sum_recip, nb::handle lse, bool bf16_bits,
                   const nb::kwargs& options) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView qv = im.in("q", q);
  const flashcte::TensorView kv = im.in("k", k);
  const flashcte::TensorView vv = im.in("v", v);
  flashcte::Outputs outputs;
  outputs.out = im.out("out", out);
  outputs.neg_max = im.out("neg_max", neg_max);
  outputs.sum_recip = im.out("sum_recip", sum_recip);
  outputs.lse = im.out("lse", lse);
  flashcte::Options o;
  set_options(im, o, options, kAttentionOptions, "attention_cte");
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::attention_cte(qv, kv, vv, outputs, o);
  }
  if (!status.ok) raise_status(status);
}

// flash_attn_with_kvcache (flashcte/kvcache.h) into caller-allocated outputs, the caches written
// in place; every other argument by keyword, as KvCacheOptions names it.
void flash_attn_with_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                             nb::handle lse, bool bf16_bits, const std::string& k_cache_format,
                             const std::string& v_cache_format, const nb::kwargs& options) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView qv = im.in("q", q);
  im.appending = options.contains("k") && !options["k"].is_none();
  const flashcte::MutableTensorView kc =
      im.cache("k_cache", k_cache, kv8_format("k_cache", k_cache_format));
  const flashcte::MutableTensorView vc =
      im.cache("v_cache", v_cache, kv8_format("v_cache", v_cache_format));
  const flashcte::MutableTensorView ov = im.out("out", out), lv = im.out("lse", lse);
  flashcte::KvCacheOptions o;
  set_options(im, o, options, kKvCacheOptions, "flash_attn_with_kvcache");
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::flash_attn_with_kvcache(qv, kc, vc, ov, lv, o);
  }
  if (!status.ok) raise_status(status);
}

// The tensors of a mixed batch's call (flash_attn_varlen_kvcache, its plan and its runs): q, the
// caches (read only; an 8-bit one by its format's name) and the outputs.
struct VarlenTensors {
  Imports im;
  flashcte::TensorView q, k_cache, v_cache;
  flashcte::MutableTensorView out, lse;

  VarlenTensors(nb::handle q_h, nb::handle k_h, nb::handle v_h, nb::handle out_h, nb::handle lse_h,
                bool bf16_bits, const std::string& k_format, const std::string& v_format) {
    im.bf16_bits = bf16_bits;
    q = im.in("q", q_h);
    k_cache = im.in("k_cache", k_h, kv8_format("k_cache", k_format));
    v_cache = im.in("v_cache", v_h, kv8_format("v_cache", v_format));
    out = im.out("out", out_h);
    lse = im.out("lse", lse_h);
  }
};

// flash_attn_varlen_kvcache (flashcte/kvcache.h) into caller-allocated outputs, the caches only
// read; every other argument by keyword, as VarlenKvCacheOptions names it.
void flash_attn_varlen_kvcache(nb::handle q, nb::handle k_cache, nb::handle v_cache, nb::handle out,
                               nb::handle lse, bool bf16_bits, const std::string& k_cache_format,
                               const std::string& v_cache_format, const nb::kwargs& options) {
  VarlenTensors t(q, k_cache, v_cache, out, lse, bf16_bits, k_cache_format, v_cache_format);
  flashcte::VarlenKvCacheOptions o;
  set_options(t.im, o, options, kVarlenKvCacheOptions, "flash_attn_varlen_kvcache");
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::flash_attn_varlen_kvcache(t.q, t.k_cache, t.v_cache, t.out, t.lse, o);
  }
  if (!status.ok) raise_status(status);
}

// plan_varlen_kvcache (flashcte/kvcache.h): flash_attn_varlen_kvcache's checks on one layer's
// tensors, the step kept for run_varlen_kvcache.
flashcte::VarlenKvCachePlan plan_varlen_kvcache(nb::handle q, nb::handle k_cache,
                                                nb::handle v_cache, nb::handle out, nb::handle lse,
                                                bool bf16_bits, const std::string& k_cache_format,
                                                const std::string& v_cache_format,
                                                const nb::kwargs& options) {
  VarlenTensors t(q, k_cache, v_cache, out, lse, bf16_bits, k_cache_format, v_cache_format);
  flashcte::VarlenKvCacheOptions o;
  set_options(t.im, o, options, kVarlenKvCacheOptions, "plan_varlen_kvcache");
  flashcte::VarlenKvCachePlan plan;
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::plan_varlen_kvcache(t.q, t.k_cache, t.v_cache, t.out, t.lse, o, &plan);
  }
  if (!status.ok) raise_status(status);
  return plan;
}

// run_varlen_kvcache (flashcte/kvcache.h): one layer of a planned step into caller-allocated
// outputs.
void run_varlen_kvcache(const flashcte::VarlenKvCachePlan& plan, nb::handle q, nb::handle k_cache,
                        nb::handle v_cache, nb::handle out, nb::handle lse, bool bf16_bits,
                        const std::string& k_cache_format, const std::string& v_cache_format,
                        nb::handle k_scale, nb::handle v_scale, nb::handle alibi_slopes,
                        nb::handle sinks) {
  VarlenTensors t(q, k_cache, v_cache, out, lse, bf16_bits, k_cache_format, v_cache_format);
  flashcte::VarlenKvCacheLayer layer;
  layer.k_scale = t.im.in("k_scale", k_scale);
  layer.v_scale = t.im.in("v_scale", v_scale);
  layer.alibi_slopes = t.im.in("alibi_slopes", alibi_slopes);
  layer.sinks = t.im.in("sinks", sinks);
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::run_varlen_kvcache(plan, t.q, t.k_cache, t.v_cache, t.out, t.lse, layer);
  }
  if (!status.ok) raise_status(status);
}

// quantize_kv (flashcte/kvcache.h). dst arrives as its bytes (an int8 or uint8 array: numpy has
// no float8 of its own, and DLPack producers differ on float8) with its format by name.
void quantize_kv(nb::handle src, nb::handle dst, nb::handle scale, const std::string& format,
                 bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView sv = im.in("src", src);
  const flashcte::MutableTensorView scv = im.out("scale", scale);
  const flashcte::MutableTensorView dv = im.out("dst", dst, kv8_format("dst", format));
  if (dv.rank != 3) {
    throw nb::value_error(
        ("dst: must have rank 3 (tokens, kv_heads, d), got rank " + std::to_string(dv.rank))
            .c_str());
  }
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::quantize_kv(sv, dv, scv);
  }
  if (!status.ok) raise_status(status);
}

// merge_attn_states (flashcte/merge.h) into caller-allocated outputs; lse may be None.
void merge_attn_states(nb::handle out_a, nb::handle lse_a, nb::handle out_b, nb::handle lse_b,
                       nb::handle out, nb::handle lse, bool bf16_bits) {
  Imports im;
  im.bf16_bits = bf16_bits;
  const flashcte::TensorView oa = im.in("out_a", out_a), la = im.in("lse_a", lse_a);
  const flashcte::TensorView ob = im.in("out_b", out_b), lb = im.in("lse_b", lse_b);
  const flashcte::MutableTensorView o = im.out("out", out), l = im.out("lse", lse);
  flashcte::Status status;
  {
    nb::gil_scoped_release release;
    status = flashcte::merge_attn_states(oa, la, ob, lb, o, l);
  }
  if (!status.ok) raise_status(status);
}

}  // namespace

void bind_attention(nb::module_& m) {
  m.def("attention_cte", &attention_cte, nb::kw_only(), nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("out"), nb::arg("neg_max").none(), nb::arg("sum_recip").none(),
        nb::arg("lse").none(), nb::arg("bf16_bits"), nb::arg("options"),
        "attention_cte into caller-allocated outputs (all tensors as numpy arrays or DLPack "
        "tensors, read in place); the other arguments are Options' fields by name. Raises "
        "TypeError/ValueError with the library's message.");
  m.def("merge_attn_states", &merge_attn_states, nb::kw_only(), nb::arg("out_a"), nb::arg("lse_a"),
        nb::arg("out_b"), nb::arg("lse_b"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"),
        "merge_attn_states into caller-allocated outputs (out may be out_a or out_b itself, lse "
        "lse_a or lse_b). Raises TypeError/ValueError with the library's message.");
  m.def("quantize_kv", &quantize_kv, nb::kw_only(), nb::arg("src"), nb::arg("dst"),
        nb::arg("scale"), nb::arg("format"), nb::arg("bf16_bits"),
        "quantize_kv into dst (its bytes, int8 or uint8) in the 8-bit `format`; per-token "
        "scales are written into scale. Raises TypeError/ValueError with the library's message.");
  m.def("flash_attn_with_kvcache", &flash_attn_with_kvcache, nb::kw_only(), nb::arg("q"),
        nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"), nb::arg("k_cache_format") = "", nb::arg("v_cache_format") = "",
        nb::arg("options"),
        "flash_attn_with_kvcache into caller-allocated outputs, the caches appended in place; "
        "the other arguments are KvCacheOptions' fields by name. Raises TypeError/ValueError "
        "with the library's message.");
  m.def("flash_attn_varlen_kvcache", &flash_attn_varlen_kvcache, nb::kw_only(), nb::arg("q"),
        nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"), nb::arg("k_cache_format") = "", nb::arg("v_cache_format") = "",
        nb::arg("options"),
        "flash_attn_varlen_kvcache into caller-allocated outputs, the caches read only; the "
        "other arguments are VarlenKvCacheOptions' fields by name. Raises TypeError/ValueError "
        "with the library's message.");
  nb::class_<flashcte::VarlenKvCachePlan>(
      m, "VarlenKvCachePlan",
      "A serving step of flash_attn_varlen_kvcache planned once (plan_varlen_kvcache), run in "
      "every layer (run_varlen_kvcache).");
  m.def("plan_varlen_kvcache", &plan_varlen_kvcache, nb::kw_only(), nb::arg("q"),
        nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"), nb::arg("k_cache_format") = "", nb::arg("v_cache_format") = "",
        nb::arg("options"),
        "flash_attn_varlen_kvcache's checks on one layer's tensors (nothing is computed); the "
        "step comes back as a VarlenKvCachePlan. Raises TypeError/ValueError with the library's "
        "message.");
  m.def("run_varlen_kvcache", &run_varlen_kvcache, nb::kw_only(), nb::arg("plan"), nb::arg("q"),
        nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("out"), nb::arg("lse").none(),
        nb::arg("bf16_bits"), nb::arg("k_cache_format") = "", nb::arg("v_cache_format") = "",
        nb::arg("k_scale").none() = nb::none(), nb::arg("v_scale").none() = nb::none(),
        nb::arg("alibi_slopes").none() = nb::none(), nb::arg("sinks").none() = nb::none(),
        "One layer of a planned step into caller-allocated outputs: its tensors at any address, "
        "in the plan's layouts. Raises TypeError/ValueError with the library's message.");
}

}  // namespace flashcte::python
