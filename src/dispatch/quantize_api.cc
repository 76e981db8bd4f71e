// quantize_kv (include/flashcte/kvcache.h): rows of K or V into an 8-bit cache format. Every
// check (shapes, dtypes, overlaps, the scales it reads, NaN for int8) runs before the first
// write, so a refused call leaves dst and scale as they were. Element by element: a write path
// of O(tokens * heads * d), bound by memory, not by the conversion.
#include <cmath>
#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/core/convert.h"
#include "src/core/kv8.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/views.h"

namespace flashcte {
namespace {

using std::to_string;

enum class Granularity { kTensor, kHead, kToken };

struct Call {
  int64_t tokens = 0, heads = 0, d = 0;
  Granularity granularity = Granularity::kTensor;
};

Status check(const TensorView& src, const MutableTensorView& dst, const MutableTensorView& scale,
             Call* c) {
  internal::Extent esrc, edst, escale;
  if (!src.present()) return Status::Error("src: is required");
  if (!dst.present()) return Status::Error("dst: is required");
  if (!scale.present()) return Status::Error("scale: is required");
  FLASHCTE_RETURN_IF_ERROR(internal::check_tensor("src", src, 3, "(tokens, kv_heads, d)", &esrc));
  FLASHCTE_RETURN_IF_ERROR(internal::expect_attention_dtype("src", src.dtype));
  FLASHCTE_RETURN_IF_ERROR(internal::check_tensor("dst", dst, 3, "(tokens, kv_heads, d)", &edst));
  if (!kv8::is_8bit(dst.dtype)) {
    return Status::DtypeError(std::string("dst: dtype must be an 8-bit cache format (int8, "
                                          "float8_e4m3fn or float8_e5m2), got ") +
                              dtype_name(dst.dtype));
  }
  for (int axis = 0; axis < 3; ++axis) {
    FLASHCTE_RETURN_IF_ERROR(internal::expect_axis("dst", dst, axis, src.shape[axis], "src's"));
  }
  FLASHCTE_RETURN_IF_ERROR(internal::check_no_self_overlap("dst", dst));
  c->tokens = src.shape[0];
  c->heads = src.shape[1];
  c->d = src.shape[2];
  FLASHCTE_RETURN_IF_ERROR(internal::check_view("scale", scale, false, &escale));
  FLASHCTE_RETURN_IF_ERROR(internal::expect_float32("scale", scale.dtype));
  const int64_t* s = scale.shape.data();
  if (scale.rank == 1 && s[0] == 1) {
    c->granularity = Granularity::kTensor;
  } else if (scale.rank == 1 && s[0] == c->heads) {
    c->granularity = Granularity::kHead;
  } else if (scale.rank == 2 && s[0] == c->tokens && s[1] == c->heads) {
    c->granularity = Granularity::kToken;
    FLASHCTE_RETURN_IF_ERROR(internal::check_no_self_overlap("scale", scale));
  } else {
    return Status::Error("scale: shape " + internal::shape_str(s, scale.rank) +
                         " must be (1,) (per tensor), (kv_heads,) = (" + to_string(c->heads) +
                         ",) (per KV head) or (tokens, kv_heads) = (" + to_string(c->tokens) +
                         ", " + to_string(c->heads) + ") (per token, computed)");
  }
  if (internal::overlaps(edst, esrc)) return Status::Error("dst: overlaps the input src");
  if (internal::overlaps(edst, escale)) return Status::Error("dst: overlaps scale");
  if (c->granularity == Granularity::kToken && internal::overlaps(escale, esrc)) {
    return Status::Error(
        "scale: overlaps the input src, which the call reads while it writes "
        "the scales");
  }
  if (c->granularity != Granularity::kToken) {
    const auto* p = static_cast<const float*>(scale.data);
    const int64_t n = c->granularity == Granularity::kHead ? c->heads : 1;
    for (int64_t h = 0; h < n; ++h) {
      const float x = p[h * scale.strides[0]];
      if (!std::isfinite(x) || !(x > 0)) {
        return Status::Error("scale: entry " + to_string(h) + " = " + std::to_string(x) +
                             " must be finite and > 0");
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status quantize_kv(const TensorView& src, const MutableTensorView& dst,
                   const MutableTensorView& scale) {
  return internal::guarded("a row buffer", [&]() -> Status {
    Call c;
    FLASHCTE_RETURN_IF_ERROR(check(src, dst, scale, &c));
    const int64_t n = c.tokens * c.heads;
    std::vector<float> row(static_cast<size_t>(c.d));
    // int8 holds no NaN: find one before anything is written.
    if (dst.dtype == DType::kInt8) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = i / c.heads, h = i % c.heads;
        internal::load_row_as_float(src.data, t * src.strides[0] + h * src.strides[1],
                                    src.strides[2], src.dtype, row.data(), c.d);
        for (int64_t x = 0; x < c.d; ++x) {
          if (std::isnan(row[x])) {
            return Status::Error("src: element (" + to_string(t) + ", " + to_string(h) + ", " +
                                 to_string(x) + ") is NaN, which int8 cannot hold");
          }
        }
      }
    }
    auto* scales = static_cast<float*>(scale.data);
    auto* out = static_cast<uint8_t*>(dst.data);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = i / c.heads, h = i % c.heads;
      internal::load_row_as_float(src.data, t * src.strides[0] + h * src.strides[1], src.strides[2],
                                  src.dtype, row.data(), c.d);
      float s = 0;
      switch (c.granularity) {
        case Granularity::kTensor:
          s = scales[0];
          break;
        case Granularity::kHead:
          s = scales[h * scale.strides[0]];
          break;
        case Granularity::kToken:
          s = kv8::row_scale(dst.dtype, row.data(), c.d);
          scales[t * scale.strides[0] + h * scale.strides[1]] = s;
          break;
      }
      kv8::encode_row(dst.dtype, row.data(), c.d, s, out + t * dst.strides[0] + h * dst.strides[1],
                      dst.strides[2]);
    }
    return Status::Ok();
  });
}

}  // namespace flashcte
