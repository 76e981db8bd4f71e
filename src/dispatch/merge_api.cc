// merge_attn_states (include/flashcte/merge.h): validate the six views, then merge row by row
// with the kernel's SoftmaxState (src/kernel/softmax_state.h), the one implementation of the
// online-softmax merge: each row starts empty, takes side a and side b as normalized states
// (merge_normalized) and is finished.
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "flashcte/merge.h"
#include "src/core/convert.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/views.h"
#include "src/kernel/softmax_state.h"

namespace flashcte {
namespace {

using internal::Extent;

// Row `offset` (elements) of a side's out as dv floats: the memory itself when it is float32
// with unit column stride, else converted into `buf`.
const float* widen(const void* data, DType dtype, int64_t offset, int64_t stride, int64_t dv,
                   float* buf) {
  if (dtype == DType::kFloat32 && stride == 1) return static_cast<const float*>(data) + offset;
  internal::load_row_as_float(data, offset, stride, dtype, buf, dv);
  return buf;
}

// The same memory seen the same way: an output that is exactly one of the inputs.
template <class A, class B>
bool same_view(const A& a, const B& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i) {
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  }
  return true;
}

// A state's views as (outer, batch, rows, dv) and (outer, batch, rows): the leading axes a
// rank-2 or rank-3 out (rank-1 or rank-2 lse) lacks count 1.
struct Side {
  const void* out = nullptr;
  DType dtype = DType::kFloat32;
  int64_t oo = 0, ob = 0, orow = 0, oc = 0;  // out strides: outer, batch, row, column
  const float* lse = nullptr;
  int64_t lo = 0, lb = 0, lrow = 0;  // lse strides: outer, batch, row
};

template <class OutView, class LseView>
Side side(const OutView& out, const LseView& lse) {
  Side s;
  s.out = out.data;
  s.dtype = out.dtype;
  const int k = out.rank - 2;  // leading axes: 0, 1 or 2
  s.oo = k == 2 ? out.strides[0] : 0;
  s.ob = k >= 1 ? out.strides[k - 1] : 0;
  s.orow = out.strides[k];
  s.oc = out.strides[k + 1];
  if (lse.present()) {
    s.lse = static_cast<const float*>(lse.data);
    s.lo = k == 2 ? lse.strides[0] : 0;
    s.lb = k >= 1 ? lse.strides[k - 1] : 0;
    s.lrow = lse.strides[k];
  }
  return s;
}

Status check_pair(const char* out_name, const TensorView& out, const char* lse_name,
                  const TensorView& lse, Extent* out_extent, Extent* lse_extent) {
  if (!out.present()) return Status::Error(std::string(out_name) + ": is required");
  if (!lse.present()) return Status::Error(std::string(lse_name) + ": is required");
  FLASHCTE_RETURN_IF_ERROR(internal::check_view(out_name, out, false, out_extent));
  FLASHCTE_RETURN_IF_ERROR(internal::check_view(lse_name, lse, false, lse_extent));
  FLASHCTE_RETURN_IF_ERROR(internal::expect_attention_dtype(out_name, out.dtype));
  FLASHCTE_RETURN_IF_ERROR(internal::expect_float32(lse_name, lse.dtype));
  return Status::Ok();
}

// `name`'s shape equals `want` (the reference argument's shape).
Status expect_shape(const char* name, const int64_t* shape, int rank, const int64_t* want,
                    int want_rank, const char* reference) {
  bool same = rank == want_rank;
  for (int i = 0; same && i < rank; ++i) same = shape[i] == want[i];
  if (same) return Status::Ok();
  return Status::Error(std::string(name) + ": shape " + internal::shape_str(shape, rank) +
                       " differs from " + reference + "'s " + internal::shape_str(want, want_rank));
}

Status validate(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                const TensorView& lse_b, const MutableTensorView& out,
                const MutableTensorView& lse) {
  Extent ea, la, eb, lb, eo, lo;
  FLASHCTE_RETURN_IF_ERROR(check_pair("out_a", out_a, "lse_a", lse_a, &ea, &la));
  FLASHCTE_RETURN_IF_ERROR(check_pair("out_b", out_b, "lse_b", lse_b, &eb, &lb));
  if (out_a.rank < 2) {
    return Status::Error(
        "out_a: must have rank 2 (rows, dv), 3 (batch, rows, dv) or 4 (batch, heads, rows, dv), "
        "got shape " +
        internal::shape_str(out_a.shape.data(), out_a.rank));
  }
  const int64_t* shape = out_a.shape.data();
  const int rank = out_a.rank;
  FLASHCTE_RETURN_IF_ERROR(expect_shape("lse_a", lse_a.shape.data(), lse_a.rank, shape, rank - 1,
                                        "out_a without its last axis"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_shape("out_b", out_b.shape.data(), out_b.rank, shape, rank, "out_a"));
  FLASHCTE_RETURN_IF_ERROR(
      expect_shape("lse_b", lse_b.shape.data(), lse_b.rank, shape, rank - 1, "lse_a"));
  if (!out.present()) return Status::Error("out: is required");
  FLASHCTE_RETURN_IF_ERROR(internal::check_view("out", out, false, &eo));
  FLASHCTE_RETURN_IF_ERROR(internal::expect_attention_dtype("out", out.dtype));
  FLASHCTE_RETURN_IF_ERROR(expect_shape("out", out.shape.data(), out.rank, shape, rank, "out_a"));
  FLASHCTE_RETURN_IF_ERROR(internal::check_no_self_overlap("out", out));
  if (lse.present()) {
    FLASHCTE_RETURN_IF_ERROR(internal::check_view("lse", lse, false, &lo));
    FLASHCTE_RETURN_IF_ERROR(internal::expect_float32("lse", lse.dtype));
    FLASHCTE_RETURN_IF_ERROR(
        expect_shape("lse", lse.shape.data(), lse.rank, shape, rank - 1, "lse_a"));
    FLASHCTE_RETURN_IF_ERROR(internal::check_no_self_overlap("lse", lse));
    if (internal::overlaps(eo, lo)) return Status::Error("lse: overlaps out");
  }
  // An output may be one of the inputs exactly (each row is read whole before it is written),
  // and must not touch any other input.
  struct Input {
    const char* name;
    const TensorView* view;
    const Extent* extent;
  };
  const Input inputs[] = {{"out_a", &out_a, &ea},
                          {"lse_a", &lse_a, &la},
                          {"out_b", &out_b, &eb},
                          {"lse_b", &lse_b, &lb}};
  for (const Input& in : inputs) {
    if (internal::overlaps(eo, *in.extent) && !same_view(out, *in.view)) {
      return Status::Error(std::string("out: overlaps ") + in.name +
                           " without being the same view (in place, out must be exactly out_a or "
                           "out_b)");
    }
    if (lse.present() && internal::overlaps(lo, *in.extent) && !same_view(lse, *in.view)) {
      return Status::Error(std::string("lse: overlaps ") + in.name +
                           " without being the same view (in place, lse must be exactly lse_a or "
                           "lse_b)");
    }
  }
  return Status::Ok();
}

}  // namespace

Status merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                         const TensorView& lse_b, const MutableTensorView& out,
                         const MutableTensorView& lse) {
  return internal::guarded("the merge's row buffers", [&]() -> Status {
    FLASHCTE_RETURN_IF_ERROR(validate(out_a, lse_a, out_b, lse_b, out, lse));
    const int k = out_a.rank - 2;
    const int64_t outer = k == 2 ? out_a.shape[0] : 1;
    const int64_t batch = k >= 1 ? out_a.shape[k - 1] : 1;
    const int64_t rows = out_a.shape[k];
    const int64_t dv = out_a.shape[k + 1];
    const Side a = side(out_a, lse_a), b = side(out_b, lse_b);
    const Side o = side(out, lse);
    // validate() refuses null data for views with elements: a null here means nothing to merge.
    if (a.out == nullptr || b.out == nullptr || a.lse == nullptr || b.lse == nullptr ||
        out.data == nullptr) {
      return Status::Ok();
    }
    // One row of state; side a and side b widened into float rows.
    std::vector<float> row_a(dv), row_b(dv), acc(dv);
    float neg_max = 0, sum = 0, alpha = 0;
    internal::SoftmaxState state(&neg_max, &sum, &alpha, acc.data(), dv, 1, dv);
    for (int64_t bo = 0; bo < outer; ++bo) {
      for (int64_t bi = 0; bi < batch; ++bi) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t ao = bo * a.oo + bi * a.ob + r * a.orow;
          const int64_t bo_off = bo * b.oo + bi * b.ob + r * b.orow;
          const float* ra = widen(a.out, a.dtype, ao, a.oc, dv, row_a.data());
          const float* rb = widen(b.out, b.dtype, bo_off, b.oc, dv, row_b.data());
          const float lse_a_r = a.lse[bo * a.lo + bi * a.lb + r * a.lrow];
          const float lse_b_r = b.lse[bo * b.lo + bi * b.lb + r * b.lrow];
          state.seed(-std::numeric_limits<float>::infinity());  // empty: no key, no sink
          state.merge_normalized(0, ra, lse_a_r);
          state.merge_normalized(0, rb, lse_b_r);
          const internal::SoftmaxState::Stats stats = state.finish(0);
          internal::store_row_from_float(out.data, bo * o.oo + bi * o.ob + r * o.orow, o.oc,
                                         out.dtype, acc.data(), dv);
          if (lse.present()) {
            static_cast<float*>(lse.data)[bo * o.lo + bi * o.lb + r * o.lrow] = stats.lse;
          }
        }
      }
    }
    return Status::Ok();
  });
}

}  // namespace flashcte
