// The view checks shared by the dispatch layer's validators (views.h).
#include "src/dispatch/views.h"

#include <array>
#include <cmath>
#include <limits>
#include <utility>

#include "src/core/kv8.h"

namespace flashcte::internal {

bool overlaps(const Extent& a, const Extent& b) {
  return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi;
}

std::string shape_str(const int64_t* shape, int rank) {
  std::string text = "(";
  for (int i = 0; i < rank; ++i) {
    if (i) text += ", ";
    text += std::to_string(shape[i]);
  }
  if (rank == 1) text += ",";
  return text + ")";
}

template <class View>
Status check_view(const char* name, const View& view, bool allow_null_data, Extent* extent) {
  if (view.rank < 1 || view.rank > kMaxRank) {
    return Status::Error(std::string(name) + ": rank must be 1 to 4, got " +
                         std::to_string(view.rank));
  }
  const int64_t* shape = view.shape.data();
  const int64_t* strides = view.strides.data();
  int64_t elements = 1;
  for (int i = 0; i < view.rank; ++i) {
    if (shape[i] < 0) {
      return Status::Error(std::string(name) + ": dimension " + std::to_string(i) +
                           " is negative (" + std::to_string(shape[i]) + ")");
    }
    if (strides[i] < 0) {
      return Status::Error(std::string(name) + ": stride " + std::to_string(i) +
                           " is negative; negative strides are not supported");
    }
    if (__builtin_mul_overflow(elements, shape[i], &elements)) {
      return Status::Error(std::string(name) + ": shape " + shape_str(shape, view.rank) +
                           " has more elements than fit in 64 bits");
    }
  }
  if (elements == 0) return Status::Ok();
  int64_t last = 0;  // largest element offset
  for (int i = 0; i < view.rank; ++i) {
    int64_t term = 0;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &term) ||
        __builtin_add_overflow(last, term, &last)) {
      return Status::Error(std::string(name) + ": shape " + shape_str(shape, view.rank) +
                           " with its strides addresses past 2^63 elements");
    }
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(last + 1, static_cast<int64_t>(dtype_size(view.dtype)), &bytes)) {
    return Status::Error(std::string(name) + ": shape " + shape_str(shape, view.rank) +
                         " addresses past 2^63 bytes");
  }
  if (view.data == nullptr && !allow_null_data) {
    return Status::Error(std::string(name) + ": data is null but the shape " +
                         shape_str(shape, view.rank) + " has elements");
  }
  if (extent && view.data) {
    extent->lo = reinterpret_cast<uintptr_t>(view.data);
    extent->hi = extent->lo + static_cast<uintptr_t>(bytes);
  }
  return Status::Ok();
}

template Status check_view(const char*, const TensorView&, bool, Extent*);
template Status check_view(const char*, const MutableTensorView&, bool, Extent*);

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

Status expect_same_dtype(const char* name, DType dtype, DType want, const char* reference) {
  if (dtype != want) {
    return Status::DtypeError(std::string(name) + ": dtype " + dtype_name(dtype) +
                              " differs from " + reference + "'s dtype " + dtype_name(want));
  }
  return Status::Ok();
}

Status expect_cache_dtype(const char* name, DType cache, DType q) {
  if (kv8::is_8bit(cache) || cache == q) return Status::Ok();
  return Status::DtypeError(std::string(name) + ": dtype " + dtype_name(cache) + " must be q's " +
                            dtype_name(q) +
                            " or an 8-bit cache format (int8, float8_e4m3fn, float8_e5m2)");
}

Status read_scale_entries(const char* name, const TensorView& view, int64_t n,
                          std::vector<float>* scales) {
  scales->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t entry = view.shape[0] == 1 ? 0 : i;
    const float x = static_cast<const float*>(view.data)[entry * view.strides[0]];
    if (!std::isfinite(x) || !(x > 0)) {
      return Status::Error(std::string(name) + ": entry " + std::to_string(entry) + " = " +
                           std::to_string(x) + " must be finite and > 0");
    }
    (*scales)[static_cast<size_t>(i)] = x;
  }
  return Status::Ok();
}

Status check_cache_scale(const char* name, const TensorView& scale, const char* cache_name,
                         const TensorView& cache, int heads_axis, std::vector<float>* scales,
                         bool* per_token, Extent* extent) {
  *per_token = false;
  if (!kv8::is_8bit(cache.dtype)) {
    if (!scale.present()) return Status::Ok();
    return Status::Error(std::string(name) + ": is for 8-bit caches; " + cache_name + " is " +
                         dtype_name(cache.dtype));
  }
  if (!scale.present()) {
    return Status::Error(std::string(name) + ": is required with the " + dtype_name(cache.dtype) +
                         " " + cache_name + " (its dequantization scale)");
  }
  const int64_t kv_heads = cache.shape[heads_axis];
  FLASHCTE_RETURN_IF_ERROR(
      check_tensor(name, scale, scale.rank == 3 ? 3 : 1,
                   "(1,), (kv_heads,) or the cache's shape without its last axis", extent));
  FLASHCTE_RETURN_IF_ERROR(expect_float32(name, scale.dtype));
  if (scale.rank == 3) {
    for (int axis = 0; axis < 3; ++axis) {
      if (scale.shape[axis] != cache.shape[axis]) {
        return Status::Error(std::string(name) + ": shape " + shape_str(scale.shape.data(), 3) +
                             " must be " + cache_name + "'s without its last axis, " +
                             shape_str(cache.shape.data(), 3) + " (one scale per token)");
      }
    }
    *per_token = true;
    return Status::Ok();
  }
  if (scale.shape[0] != 1 && scale.shape[0] != kv_heads) {
    return Status::Error(std::string(name) + ": shape " + shape_str(scale.shape.data(), 1) +
                         " must be (1,) (per tensor), (kv_heads,) = (" + std::to_string(kv_heads) +
                         ",) (per KV head) or " + cache_name + "'s shape without its last axis");
  }
  return read_scale_entries(name, scale, kv_heads, scales);
}

Status expect_float32(const char* name, DType dtype) {
  if (dtype != DType::kFloat32) {
    return Status::DtypeError(std::string(name) + ": dtype must be float32, got " +
                              dtype_name(dtype));
  }
  return Status::Ok();
}

Status expect_attention_dtype(const char* name, DType dtype) {
  if (dtype != DType::kFloat32 && dtype != DType::kBFloat16 && dtype != DType::kFloat16) {
    return Status::DtypeError(std::string(name) +
                              ": dtype must be float32, bfloat16 or float16, got " +
                              dtype_name(dtype));
  }
  return Status::Ok();
}

// With the axes of extent > 1 sorted by stride, each stride must step over everything the
// smaller strides reach.
Status check_no_self_overlap(const char* name, const MutableTensorView& view) {
  std::array<int, kMaxRank> axes{};
  int count = 0;
  for (int i = 0; i < view.rank; ++i) {
    if (view.shape[i] == 0) return Status::Ok();  // no elements at all
    if (view.shape[i] > 1) axes[count++] = i;
  }
  for (int i = 1; i < count; ++i) {  // insertion sort of at most 4 axes by stride
    for (int j = i; j > 0 && view.strides[axes[j]] < view.strides[axes[j - 1]]; --j) {
      std::swap(axes[j], axes[j - 1]);
    }
  }
  int64_t reach = 0;  // largest offset reachable with the smaller-stride axes
  for (int i = 0; i < count; ++i) {
    const int axis = axes[i];
    if (view.strides[axis] <= reach) {
      return Status::Error(std::string(name) + ": strides " +
                           shape_str(view.strides.data(), view.rank) + " for shape " +
                           shape_str(view.shape.data(), view.rank) +
                           " make distinct elements overlap");
    }
    reach += view.strides[axis] * (view.shape[axis] - 1);
  }
  return Status::Ok();
}

Status read_batch_vector(const char* name, const TensorView& view, int64_t batch,
                         const char* layout, const char* what, BatchVector* vector,
                         Extent* extent) {
  FLASHCTE_RETURN_IF_ERROR(check_view(name, view, false, extent));
  FLASHCTE_RETURN_IF_ERROR(expect_float32(name, view.dtype));
  const bool column = view.rank == 2 && view.shape[1] == 1;
  if (!(column || view.rank == 1) || view.shape[0] != batch) {
    return Status::Error(std::string(name) + ": shape " + shape_str(view.shape.data(), view.rank) +
                         " must be " + layout + " with " + what + " = " + std::to_string(batch));
  }
  vector->data = static_cast<const float*>(view.data);
  vector->stride = view.strides[0];
  return Status::Ok();
}

namespace {

// Row `row` of a bounds view of int32, int64 or float32 (integral) values.
Status read_bound(const char* name, const TensorView& view, int64_t row, int64_t* value) {
  const int64_t offset = row * view.strides[0];
  switch (view.dtype) {
    case DType::kInt32:
      *value = static_cast<const int32_t*>(view.data)[offset];
      return Status::Ok();
    case DType::kInt64:
      *value = static_cast<const int64_t*>(view.data)[offset];
      return Status::Ok();
    case DType::kFloat32: {
      const float f = static_cast<const float*>(view.data)[offset];
      if (!std::isfinite(f) || f != std::floor(f) || std::fabs(f) > 9.0e15f) {
        return Status::Error(std::string(name) + ": row " + std::to_string(row) + " holds " +
                             std::to_string(f) + ", which is not an integral index");
      }
      *value = static_cast<int64_t>(f);
      return Status::Ok();
    }
    case DType::kBFloat16:
    case DType::kFloat16:
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      break;
  }
  return Status::DtypeError(std::string(name) + ": dtype must be int32, int64 or float32, got " +
                            dtype_name(view.dtype));
}

}  // namespace

Status check_disjoint(std::initializer_list<NamedExtent> written,
                      std::initializer_list<NamedExtent> read) {
  for (auto w = written.begin(); w != written.end(); ++w) {
    for (const NamedExtent& r : read) {
      if (overlaps(w->extent, r.extent)) {
        return Status::Error(std::string(w->name) + ": overlaps the input " + r.name +
                             ", which the call reads while it writes " + w->name);
      }
    }
    for (auto earlier = written.begin(); earlier != w; ++earlier) {
      if (overlaps(w->extent, earlier->extent)) {
        return Status::Error(std::string(w->name) + ": overlaps the output " + earlier->name);
      }
    }
  }
  return Status::Ok();
}

Status check_block_table(const TensorView& table, int64_t batch, const char* what,
                         int64_t page_slots, int64_t* capacity, Extent* extent) {
  FLASHCTE_RETURN_IF_ERROR(
      check_tensor("block_table", table, 2, "(batch, max_blocks_per_seq)", extent));
  if (table.dtype != DType::kInt32) {
    return Status::DtypeError(std::string("block_table: dtype must be int32, got ") +
                              dtype_name(table.dtype));
  }
  FLASHCTE_RETURN_IF_ERROR(expect_axis("block_table", table, 0, batch, what));
  if (__builtin_mul_overflow(table.shape[1], page_slots, capacity)) {
    return Status::Error("block_table: " + std::to_string(table.shape[1]) + " pages of " +
                         std::to_string(page_slots) + " slots are more slots than fit in 64 bits");
  }
  return Status::Ok();
}

Status read_int32_vector(const char* name, const TensorView& view, const char* layout, int64_t n,
                         const char* what, std::vector<int64_t>* values, Extent* extent) {
  if (!view.present()) return Status::Error(std::string(name) + ": is required");
  FLASHCTE_RETURN_IF_ERROR(check_tensor(name, view, 1, layout, extent));
  if (view.dtype != DType::kInt32) {
    return Status::DtypeError(std::string(name) + ": dtype must be int32, got " +
                              dtype_name(view.dtype));
  }
  if (n >= 0) FLASHCTE_RETURN_IF_ERROR(expect_axis(name, view, 0, n, what));
  values->resize(static_cast<size_t>(view.shape[0]));
  const auto* data = static_cast<const int32_t*>(view.data);
  for (int64_t i = 0; i < view.shape[0]; ++i) (*values)[i] = data[i * view.strides[0]];
  return Status::Ok();
}

Status read_bounds(const char* name, const TensorView& view, int64_t seqlen_q,
                   std::vector<int64_t>* values) {
  FLASHCTE_RETURN_IF_ERROR(check_view(name, view, false, nullptr));
  const bool column = view.rank == 2 && view.shape[1] == 1;
  if (!(view.rank == 1 || column) || view.shape[0] != seqlen_q) {
    return Status::Error(std::string(name) + ": shape " + shape_str(view.shape.data(), view.rank) +
                         " must be (Sq, 1) or (Sq,) with Sq = " + std::to_string(seqlen_q));
  }
  if (view.dtype != DType::kInt32 && view.dtype != DType::kInt64 && view.dtype != DType::kFloat32) {
    return Status::DtypeError(std::string(name) + ": dtype must be int32, int64 or float32, got " +
                              dtype_name(view.dtype));
  }
  values->resize(seqlen_q);
  for (int64_t row = 0; row < seqlen_q; ++row) {
    FLASHCTE_RETURN_IF_ERROR(read_bound(name, view, row, &(*values)[row]));
  }
  return Status::Ok();
}

Status check_alibi_values(const TensorView& t) {
  const bool per_batch = t.rank == 2;
  const auto* slopes = static_cast<const float*>(t.data);
  for (int64_t b = 0; b < (per_batch ? t.shape[0] : 1); ++b) {
    for (int64_t h = 0; h < t.shape[per_batch ? 1 : 0]; ++h) {
      if (!std::isfinite(slopes[(per_batch ? b * t.strides[0] : 0) + h * t.strides[t.rank - 1]])) {
        return Status::Error("alibi_slopes: entry (" + (per_batch ? std::to_string(b) + ", " : "") +
                             std::to_string(h) + ") is not finite");
      }
    }
  }
  return Status::Ok();
}

Status check_sink_values(const char* name, const float* sinks, int64_t stride, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float logit = sinks[i * stride];
    if (std::isnan(logit) || logit == std::numeric_limits<float>::infinity()) {
      return Status::Error(std::string(name) + ": entry " + std::to_string(i) + " is " +
                           std::to_string(logit) + "; must be finite or -inf (-inf: none)");
    }
  }
  return Status::Ok();
}

}  // namespace flashcte::internal
