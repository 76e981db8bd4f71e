// plan_varlen_kvcache / run_varlen_kvcache (include/flashcte/kvcache.h): a serving step of
// flash_attn_varlen_kvcache checked once (plan_step, varlen.h) and run in every layer. The plan
// keeps the step's problems with their pointers as byte offsets into the tensors they address;
// a run checks what may differ between layers (the layouts against the plan's, outputs over
// inputs, scales over caches, the values of the scales, slopes and sinks), places the pointers
// in its own tensors and runs the kernels.
#include <algorithm>
#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/varlen.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

Status error(const std::string& message) { return Status::Error(message); }

// The tensors of a call that a step's pointers address, one set per layer.
struct LayerTensors {
  TensorView q, k_cache, v_cache, k_scale, v_scale, alibi_slopes, sinks;
  MutableTensorView out, lse;
};

enum LayerTensor { kQ, kKCache, kVCache, kKScale, kVScale, kAlibi, kSinks, kOut, kLse, kTensors };

std::array<const void*, kTensors> data_of(const LayerTensors& t) {
  return {t.q.data,       t.k_cache.data, t.v_cache.data,
          t.k_scale.data, t.v_scale.data, t.alibi_slopes.data,
          t.sinks.data,   t.out.data,     t.lse.data};
}

// Calls f(pointer field, the tensor it points into) for every pointer of a step's problem, in a
// fixed order.
template <class F>
void for_each_pointer(DecodeProblem& p, const F& f) {
  f(p.q, kQ);
  f(p.out, kOut);
  f(p.lse, kLse);
  f(p.k.data, kKCache);
  f(p.v.data, kVCache);
  f(p.k_token_scale.data, kKScale);
  f(p.v_token_scale.data, kVScale);
  f(p.sink, kSinks);
  f(p.alibi, kAlibi);
}
template <class F>
void for_each_pointer(Problem& p, const F& f) {
  f(p.q.data, kQ);
  f(p.out.data, kOut);
  f(p.lse.data, kLse);
  f(p.k_prior.data, kKCache);
  f(p.v_prior.data, kVCache);
  f(p.k_prior_token_scale.data, kKScale);
  f(p.v_prior_token_scale.data, kVScale);
  f(p.sink, kSinks);
  f(p.alibi_slopes, kAlibi);
}

// Where a step's pointers point: each one's byte offset into its tensor (none: null), in
// for_each_pointer's order over the decode problems, then the prefill problems. Taken while the
// plan's tensors are valid, so that a run places the pointers in its own tensors and the plan
// keeps no address of the tensors it was made with.
using PointerOffsets = std::vector<std::optional<std::ptrdiff_t>>;

PointerOffsets offsets_of(Step& step, const std::array<const void*, kTensors>& base) {
  PointerOffsets offsets;
  const auto record = [&](auto* pointer, LayerTensor t) {
    if (pointer == nullptr) {
      offsets.emplace_back();
      return;
    }
    offsets.emplace_back(static_cast<const unsigned char*>(static_cast<const void*>(pointer)) -
                         static_cast<const unsigned char*>(base[t]));
  };
  for (DecodeProblem& p : step.decodes) for_each_pointer(p, record);
  for (Problem& p : step.prefills) for_each_pointer(p, record);
  return offsets;
}

// A layer's 8-bit scales read as the step's per-KV-head values (empty: per token or none).
struct LayerScales {
  std::vector<float> k, v;
};

// The step on a layer's tensors: every pointer at its offset in the layer's tensor, the
// per-KV-head scales the layer's.
void place_in_layer(const PointerOffsets& offsets, const LayerTensors& layer,
                    const LayerScales& scales, Step* step) {
  const std::array<const void*, kTensors> base = data_of(layer);
  size_t next = 0;
  const auto place = [&](auto*& pointer, LayerTensor t) {
    using Pointee = std::remove_pointer_t<std::remove_reference_t<decltype(pointer)>>;
    const std::optional<std::ptrdiff_t>& offset = offsets[next++];
    if (!offset) {
      pointer = nullptr;
      return;
    }
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the layer's outputs are writable
    auto* at = const_cast<unsigned char*>(static_cast<const unsigned char*>(base[t])) + *offset;
    pointer = static_cast<Pointee*>(static_cast<void*>(at));
  };
  for (DecodeProblem& p : step->decodes) {
    for_each_pointer(p, place);
    if (!p.k_scale.empty()) p.k_scale = scales.k;
    if (!p.v_scale.empty()) p.v_scale = scales.v;
  }
  for (Problem& p : step->prefills) {
    for_each_pointer(p, place);
    if (!p.k_prior_scale.empty()) p.k_prior_scale = scales.k;
    if (!p.v_prior_scale.empty()) p.v_prior_scale = scales.v;
  }
}

// A layer's `given` view against the plan's `planned`: given exactly when planned, with its
// dtype, shape and strides, and data.
template <class View>
Status expect_planned(const char* name, const View& planned, const View& given, Extent* extent) {
  if (planned.present() != given.present()) {
    return error(std::string(name) + (planned.present() ? ": is required: the plan has one"
                                                        : ": the plan was made without one"));
  }
  if (!planned.present()) return Status::Ok();
  if (given.dtype != planned.dtype) {
    return Status::DtypeError(std::string(name) + ": dtype " + dtype_name(given.dtype) +
                              " differs from the plan's " + dtype_name(planned.dtype));
  }
  const auto layout = [](const View& v) {
    return "shape " + shape_str(v.shape.data(), v.rank) + " and strides " +
           shape_str(v.strides.data(), v.rank);
  };
  if (given.rank != planned.rank ||
      !std::equal(given.shape.begin(), given.shape.begin() + given.rank, planned.shape.begin()) ||
      !std::equal(given.strides.begin(), given.strides.begin() + given.rank,
                  planned.strides.begin())) {
    return error(std::string(name) + ": " + layout(given) + " differ from the plan's " +
                 layout(planned) + "; a plan runs layers of the layout it was made with");
  }
  return check_view(name, given, false, extent);
}

}  // namespace
}  // namespace flashcte::internal

namespace flashcte {

struct VarlenKvCachePlan::State {
  internal::Step step;
  internal::PointerOffsets offsets;
  // The layouts of the tensors the plan was made with, which bind every run (their data
  // pointers are cleared: the plan reads nothing of them once made).
  internal::LayerTensors layouts;
  int threads = 0;
};

Status plan_varlen_kvcache(const TensorView& q, const TensorView& k_cache,
                           const TensorView& v_cache, const MutableTensorView& out,
                           const MutableTensorView& lse, const VarlenKvCacheOptions& options,
                           VarlenKvCachePlan* plan) {
  if (plan == nullptr) return Status::Error("plan: must not be null");
  return internal::guarded("the plan", [&]() -> Status {
    auto state = std::make_shared<VarlenKvCachePlan::State>();
    FLASHCTE_RETURN_IF_ERROR(
        internal::plan_step(q, k_cache, v_cache, out, lse, options, &state->step));
    internal::LayerTensors& t = state->layouts;
    t = {q,
         k_cache,
         v_cache,
         options.k_scale,
         options.v_scale,
         options.alibi_slopes,
         options.sinks,
         out,
         lse};
    state->offsets = internal::offsets_of(state->step, internal::data_of(t));
    for (TensorView* view :
         {&t.q, &t.k_cache, &t.v_cache, &t.k_scale, &t.v_scale, &t.alibi_slopes, &t.sinks}) {
      view->data = nullptr;
    }
    t.out.data = nullptr;
    t.lse.data = nullptr;
    state->threads = options.num_threads;
    plan->state = std::move(state);
    return Status::Ok();
  });
}

Status run_varlen_kvcache(const VarlenKvCachePlan& plan, const TensorView& q,
                          const TensorView& k_cache, const TensorView& v_cache,
                          const MutableTensorView& out, const MutableTensorView& lse,
                          const VarlenKvCacheLayer& layer, ThreadProfile* profile) {
  if (plan.state == nullptr) {
    return Status::Error("plan: holds no step; make it with plan_varlen_kvcache");
  }
  const VarlenKvCachePlan::State& planned = *plan.state;
  const internal::LayerTensors& was = planned.layouts;
  const internal::LayerTensors now = {
      q, k_cache, v_cache, layer.k_scale, layer.v_scale, layer.alibi_slopes, layer.sinks, out, lse};
  return internal::guarded("the call's scratch", [&]() -> Status {
    internal::Extent eq, ek, ev, eks, evs, ealibi, esinks, eout, e_lse;
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("q", was.q, now.q, &eq));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("k_cache", was.k_cache, now.k_cache, &ek));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("v_cache", was.v_cache, now.v_cache, &ev));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("k_scale", was.k_scale, now.k_scale, &eks));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("v_scale", was.v_scale, now.v_scale, &evs));
    FLASHCTE_RETURN_IF_ERROR(
        internal::expect_planned("alibi_slopes", was.alibi_slopes, now.alibi_slopes, &ealibi));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("sinks", was.sinks, now.sinks, &esinks));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("out", was.out, now.out, &eout));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_planned("lse", was.lse, now.lse, &e_lse));
    FLASHCTE_RETURN_IF_ERROR(
        internal::check_disjoint({{"out", eout}, {"lse", e_lse}}, {{"q", eq},
                                                                   {"k_cache", ek},
                                                                   {"v_cache", ev},
                                                                   {"alibi_slopes", ealibi},
                                                                   {"sinks", esinks},
                                                                   {"k_scale", eks},
                                                                   {"v_scale", evs}}));
    // As the direct call: a cache's scales are memory of their own.
    for (const auto& [scale, e_scale] : {std::pair{"k_scale", eks}, std::pair{"v_scale", evs}}) {
      for (const auto& [cache, e_cache] : {std::pair{"k_cache", ek}, std::pair{"v_cache", ev}}) {
        if (internal::overlaps(e_scale, e_cache)) {
          return Status::Error(std::string(scale) + ": overlaps " + cache +
                               "; a cache's scales are memory of their own");
        }
      }
    }
    if (now.alibi_slopes.present()) {
      FLASHCTE_RETURN_IF_ERROR(internal::check_alibi_values(now.alibi_slopes));
    }
    if (now.sinks.present()) {
      FLASHCTE_RETURN_IF_ERROR(
          internal::check_sink_values("sinks", static_cast<const float*>(now.sinks.data),
                                      now.sinks.strides[0], now.sinks.shape[0]));
    }
    // One scale per cache or KV head is read (and checked) as the step reads it; per token,
    // the step reads the layer's scales through its pages.
    internal::LayerScales scales;
    const int64_t kv_heads = k_cache.shape[2];
    for (auto [name, view, values] : {std::tuple{"k_scale", &now.k_scale, &scales.k},
                                      std::tuple{"v_scale", &now.v_scale, &scales.v}}) {
      if (view->present() && view->rank == 1) {
        FLASHCTE_RETURN_IF_ERROR(internal::read_scale_entries(name, *view, kv_heads, values));
      }
    }
    internal::Step step = planned.step;
    internal::place_in_layer(planned.offsets, now, scales, &step);
    internal::run_step(step, planned.threads, profile);
    return Status::Ok();
  });
}

}  // namespace flashcte
