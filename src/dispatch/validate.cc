// Argument validation: every rule of SEMANTICS.md and of the API, checked once, each failure
// reported as "<argument>: <rule>". Nothing below this layer re-validates user input.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "src/dispatch/validate.h"

namespace flashcte::internal {
namespace {

// The largest head dim accepted (q/k and v alike). MLA models use d = 576 with dv = 512; the
// per-thread scratch grows linearly with it.
constexpr int64_t kMaxHeadDim = 1024;
// Tile parameters above these would need scratch beyond any cache and are surely a typo.
constexpr int64_t kMaxQBlock = 4096;
constexpr int64_t kMaxKvTile = 65536;
constexpr int64_t kMaxSection = 1 << 20;

std::string shape_str(const int64_t* shape, int rank) {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (rank == 1) s += ",";
  return s + ")";
}

bool is_float_type(DType t) {
  return t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16;
}

// Inclusive byte extent of a view; returns false (with a message) when it overflows int64.
struct Extent {
  uintptr_t lo = 0, hi = 0;  // [lo, hi) bytes; empty when lo == hi
};

Status check_view_common(const char* name, const void* data, DType dtype, int rank,
                         const int64_t* shape, const int64_t* strides, bool allow_null_data,
                         Extent* extent) {
  int64_t elements = 1;
  int64_t last = 0;  // largest element offset
  for (int i = 0; i < rank; ++i) {
    if (shape[i] < 0) {
      return Status::Error(std::string(name) + ": dimension " + std::to_string(i) +
                           " is negative (" + std::to_string(shape[i]) + ")");
    }
    if (strides[i] < 0) {
      return Status::Error(std::string(name) + ": stride " + std::to_string(i) +
                           " is negative; negative strides are not supported");
    }
    if (__builtin_mul_overflow(elements, shape[i], &elements)) {
      return Status::Error(std::string(name) + ": shape " + shape_str(shape, rank) +
                           " has more elements than fit in 64 bits");
    }
  }
  if (elements > 0) {
    for (int i = 0; i < rank; ++i) {
      int64_t term = 0;
      if (__builtin_mul_overflow(shape[i] - 1, strides[i], &term) ||
          __builtin_add_overflow(last, term, &last)) {
        return Status::Error(std::string(name) + ": shape " + shape_str(shape, rank) +
                             " with its strides addresses past 2^63 elements");
      }
    }
    int64_t bytes = 0;
    if (__builtin_mul_overflow(last + 1, static_cast<int64_t>(dtype_size(dtype)), &bytes)) {
      return Status::Error(std::string(name) + ": shape " + shape_str(shape, rank) +
                           " addresses past 2^63 bytes");
    }
    if (data == nullptr && !allow_null_data) {
      return Status::Error(std::string(name) + ": data is null but the shape " +
                           shape_str(shape, rank) + " has elements");
    }
    if (extent && data) {
      extent->lo = reinterpret_cast<uintptr_t>(data);
      extent->hi = extent->lo + static_cast<uintptr_t>(bytes);
    }
  }
  return Status::Ok();
}

Status check_view(const char* name, const TensorView& t, bool allow_null_data, Extent* extent) {
  if (t.rank < 1 || t.rank > kMaxRank) {
    return Status::Error(std::string(name) + ": rank must be 1 to 3, got " +
                         std::to_string(t.rank));
  }
  return check_view_common(name, t.data, t.dtype, t.rank, t.shape.data(), t.strides.data(),
                           allow_null_data, extent);
}

Status check_view(const char* name, const MutableTensorView& t, bool allow_null_data,
                  Extent* extent) {
  if (t.rank < 1 || t.rank > kMaxRank) {
    return Status::Error(std::string(name) + ": rank must be 1 to 3, got " +
                         std::to_string(t.rank));
  }
  return check_view_common(name, t.data, t.dtype, t.rank, t.shape.data(), t.strides.data(),
                           allow_null_data, extent);
}

Status expect_rank(const char* name, int rank, int want, const char* layout) {
  if (rank != want) {
    return Status::Error(std::string(name) + ": must have rank " + std::to_string(want) + " " +
                         layout + ", got rank " + std::to_string(rank));
  }
  return Status::Ok();
}

Status expect_dim(const char* name, const int64_t* shape, int rank, int axis, int64_t want,
                  const char* what) {
  if (shape[axis] != want) {
    return Status::Error(std::string(name) + ": shape " + shape_str(shape, rank) + " has " +
                         std::to_string(shape[axis]) + " at axis " + std::to_string(axis) +
                         ", expected " + what + " = " + std::to_string(want));
  }
  return Status::Ok();
}

// Reads a (Sq, 1) or (Sq,) bounds tensor into int64.
Status read_bounds(const char* name, const TensorView& t, int64_t seqlen_q,
                   std::vector<int64_t>* values) {
  Status s = check_view(name, t, false, nullptr);
  if (!s.ok) return s;
  const bool col = t.rank == 2 && t.shape[1] == 1;
  if (!(t.rank == 1 || col) || t.shape[0] != seqlen_q) {
    return Status::Error(std::string(name) + ": shape " + shape_str(t.shape.data(), t.rank) +
                         " must be (Sq, 1) or (Sq,) with Sq = " + std::to_string(seqlen_q));
  }
  if (t.dtype != DType::kInt32 && t.dtype != DType::kInt64 && t.dtype != DType::kFloat32) {
    return Status::Error(std::string(name) + ": dtype must be int32, int64 or float32, got " +
                         dtype_name(t.dtype));
  }
  values->resize(seqlen_q);
  for (int64_t i = 0; i < seqlen_q; ++i) {
    const int64_t off = i * t.strides[0];
    switch (t.dtype) {
      case DType::kInt32:
        (*values)[i] = static_cast<const int32_t*>(t.data)[off];
        break;
      case DType::kInt64:
        (*values)[i] = static_cast<const int64_t*>(t.data)[off];
        break;
      default: {
        const float f = static_cast<const float*>(t.data)[off];
        if (!std::isfinite(f) || f != std::floor(f) || std::fabs(f) > 9.0e15f) {
          return Status::Error(std::string(name) + ": row " + std::to_string(i) + " holds " +
                               std::to_string(f) + ", which is not an integral index");
        }
        (*values)[i] = static_cast<int64_t>(f);
      }
    }
  }
  return Status::Ok();
}

// Distinct elements of an output must be distinct memory, or threads would race on them: with
// the axes of extent > 1 sorted by stride, each stride must step over everything the smaller
// strides reach.
Status check_no_self_overlap(const char* name, const MutableTensorView& t) {
  std::array<int, kMaxRank> axes{};
  int n = 0;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 0) return Status::Ok();  // no elements at all
    if (t.shape[i] > 1) axes[n++] = i;
  }
  for (int k = 1; k < n; ++k) {  // insertion sort of at most 3 axes by stride
    for (int m = k; m > 0 && t.strides[axes[m]] < t.strides[axes[m - 1]]; --m) {
      std::swap(axes[m], axes[m - 1]);
    }
  }
  int64_t reach = 0;  // largest offset reachable with the smaller-stride axes
  for (int k = 0; k < n; ++k) {
    const int a = axes[k];
    if (t.strides[a] <= reach) {
      return Status::Error(std::string(name) + ": strides " + shape_str(t.strides.data(), t.rank) +
                           " for shape " + shape_str(t.shape.data(), t.rank) +
                           " make distinct elements overlap");
    }
    reach += t.strides[a] * (t.shape[a] - 1);
  }
  return Status::Ok();
}

bool overlaps(const Extent& a, const Extent& b) {
  return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi;
}

// A statistic output: (bs, Sq) row-major, or (bs, 128, Sq/128) in the Neuron layout.
Status read_stat(const char* name, const MutableTensorView& t, int64_t bs, int64_t sq,
                 bool allow_neuron, StatView* view, Extent* extent) {
  Status s = check_view(name, t, false, extent);
  if (!s.ok) return s;
  if ((s = check_no_self_overlap(name, t)), !s.ok) return s;
  if (t.dtype != DType::kFloat32) {
    return Status::Error(std::string(name) + ": dtype must be float32, got " + dtype_name(t.dtype));
  }
  view->data = static_cast<float*>(t.data);
  view->batch_stride = t.strides[0];
  if (t.rank == 2) {
    if (t.shape[0] != bs || t.shape[1] != sq) {
      return Status::Error(std::string(name) + ": shape " + shape_str(t.shape.data(), t.rank) +
                           " must be (bs, Sq) = (" + std::to_string(bs) + ", " +
                           std::to_string(sq) + ")");
    }
    view->row_stride = t.strides[1];
    return Status::Ok();
  }
  if (allow_neuron && t.rank == 3) {
    if (sq % 128 != 0) {
      return Status::Error(std::string(name) + ": the Neuron layout (bs, 128, Sq/128) needs Sq " +
                           "to be a multiple of 128, got Sq = " + std::to_string(sq) +
                           "; use the row-major (bs, Sq) layout");
    }
    if (t.shape[0] != bs || t.shape[1] != 128 || t.shape[2] != sq / 128) {
      return Status::Error(std::string(name) + ": shape " + shape_str(t.shape.data(), t.rank) +
                           " must be (bs, 128, Sq/128) = (" + std::to_string(bs) + ", 128, " +
                           std::to_string(sq / 128) + ")");
    }
    view->neuron_layout = true;
    view->row_stride = t.strides[1];
    view->group_stride = t.strides[2];
    return Status::Ok();
  }
  return Status::Error(std::string(name) +
                       (allow_neuron ? ": must have rank 2 (bs, Sq) or rank 3"
                                       " (bs, 128, Sq/128), got rank "
                                     : ": must have rank 2 (bs, Sq), got rank ") +
                       std::to_string(t.rank));
}

}  // namespace

Status validate(const TensorView& q, const TensorView& k, const TensorView& v,
                const Outputs& outputs, const Options& o, bool shapes_only, Problem* p) {
  *p = Problem{};
  Extent eq, ek, ev, ekp, evp, esink, eout, enm, esr, e_lse, ealibi, ebias;
  Status s;

  // --- q, k, v: presence, rank, dtype ---
  if (!q.present()) return Status::Error("q: is required");
  if (!k.present()) return Status::Error("k: is required");
  if (!v.present()) return Status::Error("v: is required");
  if ((s = check_view("q", q, shapes_only, &eq)), !s.ok) return s;
  if ((s = check_view("k", k, shapes_only, &ek)), !s.ok) return s;
  if ((s = check_view("v", v, shapes_only, &ev)), !s.ok) return s;
  if ((s = expect_rank("q", q.rank, 3, o.tp_q ? "(bs, Sq, d) with tp_q" : "(bs, d, Sq)")), !s.ok)
    return s;
  if ((s = expect_rank("k", k.rank, 3, o.tp_k ? "(bs_kv, Skv, d) with tp_k" : "(bs_kv, d, Skv)")),
      !s.ok)
    return s;
  if ((s = expect_rank("v", v.rank, 3, "(bs_kv, Skv, dv)")), !s.ok) return s;
  if (!is_float_type(q.dtype)) {
    return Status::Error(std::string("q: dtype must be float32, bfloat16 or float16, got ") +
                         dtype_name(q.dtype));
  }
  if (k.dtype != q.dtype) {
    return Status::Error(std::string("k: dtype ") + dtype_name(k.dtype) +
                         " differs from q's dtype " + dtype_name(q.dtype));
  }
  if (v.dtype != q.dtype) {
    return Status::Error(std::string("v: dtype ") + dtype_name(v.dtype) +
                         " differs from q's dtype " + dtype_name(q.dtype));
  }
  p->dtype = q.dtype;

  // --- shapes, with the transposes folded into strides ---
  const int qs = o.tp_q ? 1 : 2, qc = o.tp_q ? 2 : 1;
  p->batch = q.shape[0];
  p->seqlen_q = q.shape[qs];
  p->head_dim = q.shape[qc];
  p->q = {q.data, q.strides[0], q.strides[qs], q.strides[qc]};
  const int ks = o.tp_k ? 1 : 2, kc = o.tp_k ? 2 : 1;
  p->kv_batch = k.shape[0];
  p->seqlen_kv = k.shape[ks];
  p->k = {k.data, k.strides[0], k.strides[ks], k.strides[kc]};
  p->value_dim = v.shape[2];
  p->v = {v.data, v.strides[0], v.strides[1], v.strides[2]};

  if (p->head_dim < 1 || p->head_dim > kMaxHeadDim) {
    return Status::Error("q: head dim d = " + std::to_string(p->head_dim) + " must be in [1, " +
                         std::to_string(kMaxHeadDim) + "]");
  }
  if (k.shape[kc] != p->head_dim) {
    return Status::Error("k: head dim " + std::to_string(k.shape[kc]) + " differs from q's d = " +
                         std::to_string(p->head_dim) + " (shape " + shape_str(k.shape.data(), 3) +
                         (o.tp_k ? " read as (bs_kv, Skv, d))" : " read as (bs_kv, d, Skv))"));
  }
  if (p->value_dim < 1 || p->value_dim > kMaxHeadDim) {
    return Status::Error("v: value head dim dv = " + std::to_string(p->value_dim) +
                         " must be in [1, " + std::to_string(kMaxHeadDim) + "]");
  }
  if (v.shape[0] != p->kv_batch || v.shape[1] != p->seqlen_kv) {
    return Status::Error("v: shape " + shape_str(v.shape.data(), 3) +
                         " must be (bs_kv, Skv, dv) with bs_kv = " + std::to_string(p->kv_batch) +
                         " and Skv = " + std::to_string(p->seqlen_kv) + " from k");
  }
  if (p->kv_batch == 0 && p->batch != 0) {
    return Status::Error("k: bs_kv is 0 but q has bs = " + std::to_string(p->batch));
  }
  if (p->kv_batch > 0 && p->batch % p->kv_batch != 0) {
    return Status::Error("q: bs = " + std::to_string(p->batch) +
                         " must be a multiple of k's bs_kv = " + std::to_string(p->kv_batch) +
                         " (grouped-query attention)");
  }
  p->group = p->kv_batch > 0 ? p->batch / p->kv_batch : 1;

  // --- prefix caching ---
  if (o.k_prior.present() != o.v_prior.present()) {
    return Status::Error(o.k_prior.present() ? "v_prior: is required when k_prior is given"
                                             : "k_prior: is required when v_prior is given");
  }
  p->prior_used.assign(p->kv_batch, 0);
  if (o.k_prior.present()) {
    const TensorView& kp = o.k_prior;
    const TensorView& vp = o.v_prior;
    if ((s = check_view("k_prior", kp, shapes_only, &ekp)), !s.ok) return s;
    if ((s = check_view("v_prior", vp, shapes_only, &evp)), !s.ok) return s;
    if ((s = expect_rank("k_prior", kp.rank, 3, "laid out like k")), !s.ok) return s;
    if ((s = expect_rank("v_prior", vp.rank, 3, "(bs_kv, S_prior, dv)")), !s.ok) return s;
    if (kp.dtype != q.dtype) {
      return Status::Error(std::string("k_prior: dtype ") + dtype_name(kp.dtype) +
                           " differs from q's dtype " + dtype_name(q.dtype));
    }
    if (vp.dtype != q.dtype) {
      return Status::Error(std::string("v_prior: dtype ") + dtype_name(vp.dtype) +
                           " differs from q's dtype " + dtype_name(q.dtype));
    }
    p->seqlen_prior = kp.shape[ks];
    p->k_prior = {kp.data, kp.strides[0], kp.strides[ks], kp.strides[kc]};
    p->v_prior = {vp.data, vp.strides[0], vp.strides[1], vp.strides[2]};
    if ((s = expect_dim("k_prior", kp.shape.data(), 3, 0, p->kv_batch, "bs_kv")), !s.ok) return s;
    if ((s = expect_dim("k_prior", kp.shape.data(), 3, kc, p->head_dim, "d")), !s.ok) return s;
    if ((s = expect_dim("v_prior", vp.shape.data(), 3, 0, p->kv_batch, "bs_kv")), !s.ok) return s;
    if ((s = expect_dim("v_prior", vp.shape.data(), 3, 1, p->seqlen_prior, "S_prior of k_prior")),
        !s.ok)
      return s;
    if ((s = expect_dim("v_prior", vp.shape.data(), 3, 2, p->value_dim, "dv of v")), !s.ok)
      return s;
    const auto& used = o.prior_used_len;
    if (!used.empty() && used.size() != 1 && static_cast<int64_t>(used.size()) != p->kv_batch) {
      return Status::Error(
          "prior_used_len: must hold 1 value or bs_kv = " + std::to_string(p->kv_batch) +
          " values, got " + std::to_string(used.size()));
    }
    for (int64_t b = 0; b < p->kv_batch; ++b) {
      const int64_t u = used.empty() ? p->seqlen_prior : used.size() == 1 ? used[0] : used[b];
      if (u < 0 || u > p->seqlen_prior) {
        return Status::Error("prior_used_len: " + std::to_string(u) +
                             " must be in [0, S_prior = " + std::to_string(p->seqlen_prior) + "]");
      }
      p->prior_used[b] = u;
    }
  } else if (!o.prior_used_len.empty()) {
    return Status::Error("prior_used_len: given without k_prior and v_prior");
  }

  // --- sink ---
  if (o.sink.present()) {
    const TensorView& t = o.sink;
    if ((s = check_view("sink", t, false, &esink)), !s.ok) return s;
    if (t.dtype != DType::kFloat32) {
      return Status::Error(std::string("sink: dtype must be float32, got ") + dtype_name(t.dtype));
    }
    if (!((t.rank == 2 && t.shape[1] == 1) || t.rank == 1) || t.shape[0] != p->batch) {
      return Status::Error("sink: shape " + shape_str(t.shape.data(), t.rank) +
                           " must be (bs, 1) with bs = " + std::to_string(p->batch));
    }
    p->sink = static_cast<const float*>(t.data);
    p->sink_stride = t.strides[0];
    for (int64_t b = 0; b < p->batch; ++b) {
      const float x = p->sink[b * p->sink_stride];
      if (std::isnan(x) || x == std::numeric_limits<float>::infinity()) {
        return Status::Error("sink: entry " + std::to_string(b) + " is " + std::to_string(x) +
                             "; a sink logit must be finite or -inf (no sink)");
      }
    }
  }

  // --- scalars ---
  if (!std::isfinite(o.scale)) {
    return Status::Error("scale: must be finite, got " + std::to_string(o.scale));
  }
  p->scale = o.scale;
  if (o.sliding_window < 0) {
    return Status::Error("sliding_window: must be >= 0 (0 disables it), got " +
                         std::to_string(o.sliding_window));
  }
  if (o.window_left < -1) {
    return Status::Error("window_left: must be >= 0, or -1 for unbounded, got " +
                         std::to_string(o.window_left));
  }
  if (o.window_right < -1) {
    return Status::Error("window_right: must be >= 0, or -1 for unbounded, got " +
                         std::to_string(o.window_right));
  }
  // Every window form is one allowed range of diff = kv_pos - q_pos (SEMANTICS.md step 3).
  const int64_t kNoLimit = Problem::kNoLimit;
  p->window_left = o.window_left >= 0 ? std::min(o.window_left, kNoLimit) : kNoLimit;
  p->window_right = o.window_right >= 0 ? std::min(o.window_right, kNoLimit) : kNoLimit;
  if (o.causal_mask) p->window_right = std::min<int64_t>(p->window_right, 0);
  if (o.sliding_window > 0) {
    p->window_left = std::min(p->window_left, std::min(o.sliding_window, kNoLimit) - 1);
  }

  // --- context parallelism and the query positions ---
  if (o.global_cp_deg && *o.global_cp_deg < 1) {
    return Status::Error("global_cp_deg: must be >= 1, got " + std::to_string(*o.global_cp_deg));
  }
  if (o.cp_offset && *o.cp_offset < 0) {
    return Status::Error("cp_offset: must be >= 0, got " + std::to_string(*o.cp_offset));
  }
  if (o.cp_strided_q_slicing && (!o.cp_offset || !o.global_cp_deg)) {
    return Status::Error(std::string(o.cp_offset ? "global_cp_deg" : "cp_offset") +
                         ": is required with cp_strided_q_slicing");
  }
  if (o.global_cp_deg && !o.cp_offset) {
    return Status::Error("cp_offset: is required when global_cp_deg is given");
  }
  p->cp_stride = o.cp_strided_q_slicing ? *o.global_cp_deg : 1;
  // Positions stay below 2^60 in magnitude so that interval arithmetic never overflows.
  constexpr int64_t kMaxPosition = int64_t{1} << 60;
  if (o.cp_offset && *o.cp_offset > kMaxPosition) {
    return Status::Error("cp_offset: " + std::to_string(*o.cp_offset) + " exceeds 2^60");
  }
  p->q_pos_offset = o.cp_offset.value_or(0) + (o.bottom_right ? p->seqlen_kv - p->seqlen_q : 0);
  {
    int64_t last = 0;
    if (__builtin_mul_overflow(std::max<int64_t>(p->seqlen_q - 1, 0), p->cp_stride, &last) ||
        __builtin_add_overflow(last, p->q_pos_offset, &last) || last > kMaxPosition) {
      return Status::Error(
          "global_cp_deg: query positions cp_offset + i*global_cp_deg exceed "
          "2^60");
    }
  }

  // --- score modifiers ---
  if (!(o.softcap >= 0.0f) || std::isinf(o.softcap)) {
    return Status::Error("softcap: must be finite and >= 0 (0 disables it), got " +
                         std::to_string(o.softcap));
  }
  p->softcap = o.softcap;
  if (o.alibi_slopes.present()) {
    const TensorView& t = o.alibi_slopes;
    if ((s = check_view("alibi_slopes", t, false, &ealibi)), !s.ok) return s;
    if (t.dtype != DType::kFloat32) {
      return Status::Error(std::string("alibi_slopes: dtype must be float32, got ") +
                           dtype_name(t.dtype));
    }
    if (!((t.rank == 2 && t.shape[1] == 1) || t.rank == 1) || t.shape[0] != p->batch) {
      return Status::Error("alibi_slopes: shape " + shape_str(t.shape.data(), t.rank) +
                           " must be (bs,) or (bs, 1) with bs = " + std::to_string(p->batch));
    }
    p->alibi_slopes = static_cast<const float*>(t.data);
    p->alibi_stride = t.strides[0];
    for (int64_t b = 0; b < p->batch; ++b) {
      if (!std::isfinite(p->alibi_slopes[b * p->alibi_stride])) {
        return Status::Error("alibi_slopes: entry " + std::to_string(b) + " is not finite");
      }
    }
  }
  if (o.key_bias.present()) {
    const TensorView& t = o.key_bias;
    if ((s = check_view("key_bias", t, false, &ebias)), !s.ok) return s;
    if (t.dtype != DType::kFloat32) {
      return Status::Error(std::string("key_bias: dtype must be float32, got ") +
                           dtype_name(t.dtype));
    }
    const int64_t total = p->max_kv_total();
    if (t.rank != 2 || t.shape[0] != p->batch || t.shape[1] != total) {
      return Status::Error("key_bias: shape " + shape_str(t.shape.data(), t.rank) +
                           " must be (bs, prior_used_len + Skv) = (" + std::to_string(p->batch) +
                           ", " + std::to_string(total) + ")");
    }
    p->key_bias = static_cast<const float*>(t.data);
    p->key_bias_batch_stride = t.strides[0];
    p->key_bias_key_stride = t.strides[1];
  }

  // --- packing ---
  if (o.bound_min.present() != o.bound_max.present()) {
    return Status::Error(o.bound_min.present() ? "bound_max: is required when bound_min is given"
                                               : "bound_min: is required when bound_max is given");
  }
  if (o.bound_min.present()) {
    if ((s = read_bounds("bound_min", o.bound_min, p->seqlen_q, &p->bound_lo)), !s.ok) return s;
    if ((s = read_bounds("bound_max", o.bound_max, p->seqlen_q, &p->bound_hi)), !s.ok) return s;
    const int64_t total = p->max_kv_total();
    for (int64_t i = 0; i < p->seqlen_q; ++i) {
      if (p->bound_lo[i] < 0 || p->bound_lo[i] > total) {
        return Status::Error("bound_min: row " + std::to_string(i) + " holds " +
                             std::to_string(p->bound_lo[i]) + ", outside [0, " +
                             std::to_string(total) + "] (the concatenated KV length)");
      }
      if (p->bound_hi[i] < p->bound_lo[i] || p->bound_hi[i] > total) {
        return Status::Error(
            "bound_max: row " + std::to_string(i) + " holds " + std::to_string(p->bound_hi[i]) +
            ", outside [bound_min = " + std::to_string(p->bound_lo[i]) + ", " +
            std::to_string(total) + "] (bounds are [min, max) over the concatenated KV axis)");
      }
    }
  }

  // --- outputs ---
  const MutableTensorView& out = outputs.out;
  if (!out.present()) return Status::Error("out: is required");
  if ((s = check_view("out", out, shapes_only, &eout)), !s.ok) return s;
  if ((s = expect_rank("out", out.rank, 3, o.tp_out ? "(bs, dv, Sq) with tp_out" : "(bs, Sq, dv)")),
      !s.ok)
    return s;
  if (out.dtype != q.dtype) {
    return Status::Error(std::string("out: dtype ") + dtype_name(out.dtype) +
                         " must be q's dtype " + dtype_name(q.dtype));
  }
  const int os = o.tp_out ? 2 : 1, oc = o.tp_out ? 1 : 2;
  if ((s = expect_dim("out", out.shape.data(), 3, 0, p->batch, "bs")), !s.ok) return s;
  if ((s = expect_dim("out", out.shape.data(), 3, os, p->seqlen_q, "Sq")), !s.ok) return s;
  if ((s = expect_dim("out", out.shape.data(), 3, oc, p->value_dim, "dv")), !s.ok) return s;
  p->out = {out.data, out.strides[0], out.strides[os], out.strides[oc]};
  if ((s = check_no_self_overlap("out", out)), !s.ok) return s;

  if (o.cache_softmax) {
    if (!outputs.neg_max.present()) return Status::Error("neg_max: is required with cache_softmax");
    if (!outputs.sum_recip.present()) {
      return Status::Error("sum_recip: is required with cache_softmax");
    }
    if ((s = read_stat("neg_max", outputs.neg_max, p->batch, p->seqlen_q, true, &p->neg_max, &enm)),
        !s.ok)
      return s;
    if ((s = read_stat("sum_recip", outputs.sum_recip, p->batch, p->seqlen_q, true, &p->sum_recip,
                       &esr)),
        !s.ok)
      return s;
  } else if (outputs.neg_max.present() || outputs.sum_recip.present()) {
    return Status::Error(std::string(outputs.neg_max.present() ? "neg_max" : "sum_recip") +
                         ": given without cache_softmax = true");
  }
  if (outputs.lse.present()) {
    if ((s = read_stat("lse", outputs.lse, p->batch, p->seqlen_q, false, &p->lse, &e_lse)), !s.ok)
      return s;
  }

  // --- aliasing: no output may overlap an input or another output ---
  const struct {
    const char* name;
    Extent e;
  } inputs[] = {{"q", eq},
                {"k", ek},
                {"v", ev},
                {"k_prior", ekp},
                {"v_prior", evp},
                {"sink", esink},
                {"alibi_slopes", ealibi},
                {"key_bias", ebias}},
    outs[] = {{"out", eout}, {"neg_max", enm}, {"sum_recip", esr}, {"lse", e_lse}};
  for (size_t a = 0; a < sizeof(outs) / sizeof(outs[0]); ++a) {
    for (const auto& in : inputs) {
      if (overlaps(outs[a].e, in.e)) {
        return Status::Error(std::string(outs[a].name) + ": overlaps the input " + in.name +
                             "; outputs must not alias inputs");
      }
    }
    for (size_t b = a + 1; b < sizeof(outs) / sizeof(outs[0]); ++b) {
      if (overlaps(outs[a].e, outs[b].e)) {
        return Status::Error(std::string(outs[b].name) + ": overlaps the output " + outs[a].name);
      }
    }
  }

  // --- execution settings ---
  if (o.num_threads < 0) {
    return Status::Error("num_threads: must be >= 0 (0 = OpenMP default), got " +
                         std::to_string(o.num_threads));
  }
  const TileConfig& t = o.tiles;
  if (t.q_block < 0 || t.q_block > kMaxQBlock) {
    return Status::Error("tiles.q_block: must be in [0, " + std::to_string(kMaxQBlock) +
                         "] (0 = automatic), got " + std::to_string(t.q_block));
  }
  if (t.kv_tile < 0 || t.kv_tile > kMaxKvTile) {
    return Status::Error("tiles.kv_tile: must be in [0, " + std::to_string(kMaxKvTile) +
                         "] (0 = automatic), got " + std::to_string(t.kv_tile));
  }
  if (t.section < 0 || t.section > kMaxSection) {
    return Status::Error("tiles.section: must be in [0, " + std::to_string(kMaxSection) +
                         "] (0 = one tile), got " + std::to_string(t.section));
  }
  if (t.section_threshold < 0) {
    return Status::Error("tiles.section_threshold: must be >= 0, got " +
                         std::to_string(t.section_threshold));
  }
  if (t.section > 0 && t.kv_tile > 0 && t.section % t.kv_tile != 0) {
    return Status::Error("tiles.section: " + std::to_string(t.section) +
                         " must be a multiple of tiles.kv_tile = " + std::to_string(t.kv_tile));
  }
  p->tile_request = t;
  p->threads = o.num_threads;
  return Status::Ok();
}

}  // namespace flashcte::internal
