// Checks of the caller's strided views, shared by every validator of the dispatch layer (the
// attention_cte validator, a decode entry point). Each returns a Status whose message is
// "<argument>: <rule>", with the argument named by the caller.
#ifndef FLASHCTE_SRC_DISPATCH_VIEWS_H_
#define FLASHCTE_SRC_DISPATCH_VIEWS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/kv_source.h"

// Evaluates `expr`, a Status, and returns it from the enclosing function when it is an error
// (Abseil's RETURN_IF_ERROR idiom).
#define FLASHCTE_RETURN_IF_ERROR(expr)                           \
  do {                                                           \
    ::flashcte::Status flashcte_return_if_error_status = (expr); \
    if (!flashcte_return_if_error_status.ok) {                   \
      return flashcte_return_if_error_status;                    \
    }                                                            \
  } while (false)

namespace flashcte::internal {

// The bytes a view addresses, [lo, hi); empty (lo == hi) for a view without elements or data.
struct Extent {
  uintptr_t lo = 0, hi = 0;
};

// Whether two non-empty extents share a byte.
bool overlaps(const Extent& a, const Extent& b);

// "(2, 3, 4)", and "(5,)" for rank 1, as Python prints a shape.
std::string shape_str(const int64_t* shape, int rank);

// A view of rank 1 to 4 with no negative dimension or stride whose elements, and their bytes,
// are addressable in int64. Null data is an error when the view has elements, unless
// `allow_null_data` (shapes only). Fills `extent` (when given) with the bytes it addresses.
// Defined for TensorView and MutableTensorView.
template <class View>
Status check_view(const char* name, const View& view, bool allow_null_data, Extent* extent);
extern template Status check_view(const char*, const TensorView&, bool, Extent*);
extern template Status check_view(const char*, const MutableTensorView&, bool, Extent*);

// `rank` is `want`; `layout` names the axes in the message, e.g. "(bs, Sq, d)".
Status expect_rank(const char* name, int rank, int want, const char* layout);

// check_view (data required) and expect_rank: a view of exactly `rank` axes named by `layout`.
template <class View>
Status check_tensor(const char* name, const View& view, int rank, const char* layout,
                    Extent* extent) {
  FLASHCTE_RETURN_IF_ERROR(check_view(name, view, false, extent));
  return expect_rank(name, view.rank, rank, layout);
}

// shape[axis] is `want`; `what` names the expected size in the message, e.g. "bs".
Status expect_dim(const char* name, const int64_t* shape, int rank, int axis, int64_t want,
                  const char* what);

// expect_dim on a view's own shape.
template <class View>
Status expect_axis(const char* name, const View& view, int axis, int64_t want, const char* what) {
  return expect_dim(name, view.shape.data(), view.rank, axis, want, what);
}

// `dtype` is `want`, the dtype of the argument `reference` ("k: dtype ... differs from q's").
Status expect_same_dtype(const char* name, DType dtype, DType want, const char* reference);

// `dtype` is float32.
Status expect_float32(const char* name, DType dtype);

// `dtype` is one of the attention input types: float32, bfloat16 or float16.
Status expect_attention_dtype(const char* name, DType dtype);

// A cache's (or prior's) dtype: q's, or an 8-bit format (read with its scale).
Status expect_cache_dtype(const char* name, DType cache, DType q);

// An 8-bit cache's scale of one value (per tensor) or of n (one per KV head or KV batch), float32
// rank 1 (its shape is the caller's check), read into `scales` as n values, each finite and > 0.
Status read_scale_entries(const char* name, const TensorView& view, int64_t n,
                          std::vector<float>* scales);

// k_scale / v_scale of a rank-4 cache (decode_attention, flash_attn_with_kvcache): required with
// an 8-bit cache and refused with a float one; float32, (1,) or (kv_heads,) (the cache's axis
// heads_axis), each entry finite and > 0, read into `scales` one per KV head; or one per token,
// the cache's shape without its channel axis (then `per_token` is set; its entries are data like
// the cache's and not checked).
Status check_cache_scale(const char* name, const TensorView& scale, const char* cache_name,
                         const TensorView& cache, int heads_axis, std::vector<float>* scales,
                         bool* per_token, Extent* extent);

// A per-token scale tensor as a source beside its cache's (the same sequences, slots and pages):
// float32 at `data` with the (sequence or page, head, slot) strides given, channel stride 0.
inline KvSource token_scale_source(const KvSource& cache, const void* data, int64_t seq_stride,
                                   int64_t head_stride, int64_t slot_stride) {
  KvSource s = cache;
  s.data = data;
  s.dtype = DType::kFloat32;
  s.strides = {seq_stride, head_stride, slot_stride, 0};
  return s;
}

// A writable view read as an input.
inline TensorView as_input(const MutableTensorView& v) {
  return {v.data, v.dtype, v.rank, v.shape, v.strides};
}

// Distinct elements of an output are distinct memory (else threads would race on them).
Status check_no_self_overlap(const char* name, const MutableTensorView& view);

// A float32 vector with one entry per batch, where entry b is data[b * stride].
struct BatchVector {
  const float* data = nullptr;
  int64_t stride = 0;
};

// Reads a float32 view of shape (n,) or (n, 1) with n = `batch`; `layout` names the accepted
// shapes in the message, e.g. "(bs, 1)", and `what` the count, e.g. "bs". Fills `extent` with the
// bytes it addresses.
Status read_batch_vector(const char* name, const TensorView& view, int64_t batch,
                         const char* layout, const char* what, BatchVector* vector, Extent* extent);

// Reads a rank-1 int32 view into int64 `values` (present: a missing one is "is required"); with
// n >= 0 it must hold n entries, `what` naming n in the message (e.g. "q's batch"). `layout`
// names the axis, e.g. "(batch,)". Fills `extent` with the bytes it addresses.
Status read_int32_vector(const char* name, const TensorView& view, const char* layout, int64_t n,
                         const char* what, std::vector<int64_t>* values, Extent* extent);

// The sequence and channel axes of attention_cte's q, k and k_prior: (bs, S, d) when transposed
// (tp_q, tp_k), else (bs, d, S).
inline int seq_axis(bool transposed) { return transposed ? 1 : 2; }
inline int channel_axis(bool transposed) { return transposed ? 2 : 1; }

// A named argument's bytes, for the aliasing rules.
struct NamedExtent {
  const char* name;
  Extent extent;
};

// What a call writes touches nothing it reads, nor anything else it writes: "<w>: overlaps the
// input <r>, which the call reads while it writes <w>", or "<w>: overlaps the output <earlier
// w>". Absent arguments have empty extents.
Status check_disjoint(std::initializer_list<NamedExtent> written,
                      std::initializer_list<NamedExtent> read);

// A block table's shape: block_table (batch, max_blocks_per_seq) int32, `batch` rows (`what`
// names them in the message, e.g. "q's batch"); *capacity is the slots a row's pages hold
// (max_blocks_per_seq x page_slots), refused when it overflows 64 bits. Fills `extent`. The
// pages' values are each caller's to check: they depend on the slots each sequence reads.
Status check_block_table(const TensorView& table, int64_t batch, const char* what,
                         int64_t page_slots, int64_t* capacity, Extent* extent);

// Reads an (Sq, 1) or (Sq,) view of int32, int64 or float32 holding integers into int64.
Status read_bounds(const char* name, const TensorView& view, int64_t seqlen_q,
                   std::vector<int64_t>* values);

// The values the KV-cache calls read from alibi_slopes ((heads,) or (batch, heads)
// float32: each finite), of a view whose shape and dtype are checked.
Status check_alibi_values(const TensorView& alibi_slopes);
// Every call's sink logits, n of them `stride` floats apart: each finite or -inf (no sink). The
// message does not say "sink" beyond the argument's name, which Python renames (s_aux).
Status check_sink_values(const char* name, const float* sinks, int64_t stride, int64_t n);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_DISPATCH_VIEWS_H_
