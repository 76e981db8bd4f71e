#include "src/dispatch/batch.h"

#include <iterator>
#include <string>
#include <tuple>
#include <utility>

#include "src/dispatch/validate.h"
#include "src/dispatch/views.h"

namespace flashcte::internal {
namespace {

using std::to_string;

// Entry b of a view along axis 0, as a view of one rank less.
template <class View>
View batch_entry(const View& v, int64_t b) {
  View r = v;
  if (!v.present()) return r;
  r.rank = v.rank - 1;
  auto* base = static_cast<const unsigned char*>(v.data) + b * v.strides[0] * dtype_size(v.dtype);
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): MutableTensorView's data is writable
  r.data = const_cast<unsigned char*>(base);
  for (int i = 0; i + 1 < kMaxRank; ++i) {
    r.shape[i] = i < r.rank ? v.shape[i + 1] : 0;
    r.strides[i] = i < r.rank ? v.strides[i + 1] : 0;
  }
  r.shape[kMaxRank - 1] = 0;
  r.strides[kMaxRank - 1] = 0;
  return r;
}

// A batched argument (absent is fine): a valid view of rank 2..4 whose axis 0 is the batch.
template <class View>
Status check_batched(const char* name, const View& v, int64_t batch, Extent* extent) {
  if (!v.present()) return Status::Ok();
  FLASHCTE_RETURN_IF_ERROR(check_view(name, v, false, extent));
  if (v.rank < 2) {
    return Status::Error(std::string(name) + ": with rank-4 q (a batch of problems) it needs the " +
                         "batch axis first and the rank-3 call's axes after it, got rank " +
                         to_string(v.rank));
  }
  if (v.shape[0] != batch) {
    return Status::Error(std::string(name) + ": axis 0 is the batch of rank-4 q, " +
                         to_string(batch) + ", got shape " + shape_str(v.shape.data(), v.rank));
  }
  return Status::Ok();
}

struct Named {
  const char* name;
  Extent extent;
};

}  // namespace

Status validate_batch(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Outputs& outputs, const Options& options,
                      std::vector<Problem>* problems) {
  const int64_t batch = q.shape[0];
  const bool paged = options.prior_block_table.present();
  Extent eq, ek, ev, ekp, evp, eks, evs, etable, esink, emin, emax, ealibi, ebias;
  Extent eout, eneg, esum, e_lse;
  for (const auto& [name, view] : {std::pair<const char*, const TensorView&>{"k", k}, {"v", v}}) {
    if (!view.present()) return Status::Error(std::string(name) + ": is required");
    if (view.rank != 4) {
      return Status::Error(std::string(name) + ": must have rank 4 (a batch of rank-3 problems) " +
                           "as q does, got rank " + to_string(view.rank));
    }
  }
  FLASHCTE_RETURN_IF_ERROR(check_batched("q", q, batch, &eq));
  FLASHCTE_RETURN_IF_ERROR(check_batched("k", k, batch, &ek));
  FLASHCTE_RETURN_IF_ERROR(check_batched("v", v, batch, &ev));
  FLASHCTE_RETURN_IF_ERROR(
      check_batched("prior_block_table", options.prior_block_table, batch, &etable));
  FLASHCTE_RETURN_IF_ERROR(check_batched("sink", options.sink, batch, &esink));
  FLASHCTE_RETURN_IF_ERROR(check_batched("bound_min", options.bound_min, batch, &emin));
  FLASHCTE_RETURN_IF_ERROR(check_batched("bound_max", options.bound_max, batch, &emax));
  FLASHCTE_RETURN_IF_ERROR(check_batched("alibi_slopes", options.alibi_slopes, batch, &ealibi));
  FLASHCTE_RETURN_IF_ERROR(check_batched("key_bias", options.key_bias, batch, &ebias));
  if (paged) {  // the pools are shared; only their extents matter here
    if (options.k_prior.present()) {
      FLASHCTE_RETURN_IF_ERROR(check_view("k_prior", options.k_prior, false, &ekp));
    }
    if (options.v_prior.present()) {
      FLASHCTE_RETURN_IF_ERROR(check_view("v_prior", options.v_prior, false, &evp));
    }
    for (const auto& [name, view, extent] : {std::tuple<const char*, const TensorView&, Extent*>{
                                                 "k_prior_scale", options.k_prior_scale, &eks},
                                             {"v_prior_scale", options.v_prior_scale, &evs}}) {
      if (view.present()) FLASHCTE_RETURN_IF_ERROR(check_view(name, view, false, extent));
    }
  } else {
    FLASHCTE_RETURN_IF_ERROR(check_batched("k_prior", options.k_prior, batch, &ekp));
    FLASHCTE_RETURN_IF_ERROR(check_batched("v_prior", options.v_prior, batch, &evp));
    FLASHCTE_RETURN_IF_ERROR(check_batched("k_prior_scale", options.k_prior_scale, batch, &eks));
    FLASHCTE_RETURN_IF_ERROR(check_batched("v_prior_scale", options.v_prior_scale, batch, &evs));
  }
  if (!outputs.out.present()) return Status::Error("out: is required");
  if (outputs.out.rank != 4) {
    return Status::Error("out: must have rank 4 (a batch of rank-3 problems) as q does, got rank " +
                         to_string(outputs.out.rank));
  }
  FLASHCTE_RETURN_IF_ERROR(check_batched("out", outputs.out, batch, &eout));
  FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap("out", outputs.out));
  const Named written[] = {{"out", eout}, {"neg_max", eneg}, {"sum_recip", esum}, {"lse", e_lse}};
  FLASHCTE_RETURN_IF_ERROR(check_batched("neg_max", outputs.neg_max, batch, &eneg));
  FLASHCTE_RETURN_IF_ERROR(check_batched("sum_recip", outputs.sum_recip, batch, &esum));
  FLASHCTE_RETURN_IF_ERROR(check_batched("lse", outputs.lse, batch, &e_lse));
  const Named inputs[] = {{"q", eq},
                          {"k", ek},
                          {"v", ev},
                          {"k_prior", ekp},
                          {"v_prior", evp},
                          {"k_prior_scale", eks},
                          {"v_prior_scale", evs},
                          {"prior_block_table", etable},
                          {"sink", esink},
                          {"bound_min", emin},
                          {"bound_max", emax},
                          {"alibi_slopes", ealibi},
                          {"key_bias", ebias}};
  // Across entries: an entry's own call sees only its own slices.
  for (size_t w = 0; w < std::size(written); ++w) {
    for (const Named& in : inputs) {
      if (overlaps(written[w].extent, in.extent)) {
        return Status::Error(std::string(written[w].name) + ": overlaps the input " + in.name +
                             ", which the call reads while it writes " + written[w].name);
      }
    }
    for (size_t u = 0; u < w; ++u) {
      if (overlaps(written[w].extent, written[u].extent)) {
        return Status::Error(std::string(written[w].name) + ": overlaps the output " +
                             written[u].name);
      }
    }
  }
  for (const auto& [name, view] :
       {std::pair<const char*, const MutableTensorView&>{"neg_max", outputs.neg_max},
        {"sum_recip", outputs.sum_recip},
        {"lse", outputs.lse}}) {
    if (view.present()) FLASHCTE_RETURN_IF_ERROR(check_no_self_overlap(name, view));
  }

  problems->clear();
  problems->reserve(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    Options o = options;
    if (!paged) {
      o.k_prior = batch_entry(options.k_prior, b);
      o.v_prior = batch_entry(options.v_prior, b);
      o.k_prior_scale = batch_entry(options.k_prior_scale, b);
      o.v_prior_scale = batch_entry(options.v_prior_scale, b);
    }
    o.prior_block_table = batch_entry(options.prior_block_table, b);
    o.sink = batch_entry(options.sink, b);
    o.bound_min = batch_entry(options.bound_min, b);
    o.bound_max = batch_entry(options.bound_max, b);
    o.alibi_slopes = batch_entry(options.alibi_slopes, b);
    o.key_bias = batch_entry(options.key_bias, b);
    Outputs out_b;
    out_b.out = batch_entry(outputs.out, b);
    out_b.neg_max = batch_entry(outputs.neg_max, b);
    out_b.sum_recip = batch_entry(outputs.sum_recip, b);
    out_b.lse = batch_entry(outputs.lse, b);
    problems->emplace_back();
    const Status s = validate(batch_entry(q, b), batch_entry(k, b), batch_entry(v, b), out_b, o,
                              false, &problems->back());
    if (!s.ok) return s.with_suffix(" (batch entry " + to_string(b) + ")");
  }
  return Status::Ok();
}

}  // namespace flashcte::internal
