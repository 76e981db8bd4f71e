// The public entry points: validate once into a Step (step.h), then run it.
#include <algorithm>
#include <exception>
#include <new>

#include "flashcte/flashcte.h"
#include "src/core/problem.h"
#include "src/dispatch/batch.h"
#include "src/dispatch/contiguous.h"
#include "src/dispatch/guarded.h"
#include "src/dispatch/step.h"
#include "src/dispatch/validate.h"
#include "src/kernel/attention.h"
#include "src/schedule/schedule.h"
#include "src/simd/ops.h"

namespace flashcte {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kInt8:
      return "int8";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kInt8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

TensorView TensorView::contiguous(const void* data, DType dtype,
                                  const std::vector<int64_t>& shape) {
  return internal::make_contiguous<TensorView>(data, dtype, shape);
}

MutableTensorView MutableTensorView::contiguous(void* data, DType dtype,
                                                const std::vector<int64_t>& shape) {
  return internal::make_contiguous<MutableTensorView>(data, dtype, shape);
}

Status attention_cte(const TensorView& q, const TensorView& k, const TensorView& v,
                     const Outputs& outputs, const Options& options) {
  return internal::guarded("scratch or plan buffers", [&]() -> Status {
    internal::Step step;
    Status s = Status::Ok();
    if (q.rank == 4) {
      s = internal::validate_batch(q, k, v, outputs, options, &step.prefills);
    } else {
      step.prefills.resize(1);
      s = internal::validate(q, k, v, outputs, options, false, &step.prefills[0]);
    }
    if (!s.ok) return s;
    internal::run_step(step, options.num_threads);
    return Status::Ok();
  });
}

Status plan_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Options& options, PlanSummary* summary) {
  if (summary == nullptr) return Status::Error("summary: must not be null");
  return internal::guarded("plan buffers", [&]() -> Status {
    // A shape-only out view so validation can check it like a real call.
    internal::Problem p;
    Outputs outputs;
    MutableTensorView& out = outputs.out;
    out.dtype = q.dtype;
    out.rank = 3;
    const int64_t bs = q.rank == 3 ? q.shape[0] : 0;
    const int64_t sq = q.rank == 3 ? q.shape[options.tp_q ? 1 : 2] : 0;
    const int64_t dv = v.rank == 3 ? v.shape[2] : 0;
    out.shape = options.tp_out ? std::array<int64_t, kMaxRank>{bs, dv, sq}
                               : std::array<int64_t, kMaxRank>{bs, sq, dv};
    out.strides = {out.shape[1] * out.shape[2], out.shape[2], 1};
    Options o = options;
    o.cache_softmax = false;  // statistics do not change the plan
    Status s = internal::validate(q, k, v, outputs, o, true, &p);
    if (!s.ok) return s;

    PlanSummary& r = *summary;
    r = PlanSummary{};
    r.batch = p.batch;
    r.kv_batch = p.kv_batch;
    r.seqlen_q = p.seqlen_q;
    r.seqlen_kv = p.max_kv_total();
    r.head_dim = p.head_dim;
    r.value_dim = p.value_dim;
    const internal::AttentionKernel kernel(p);
    kernel.describe(&r);
    r.kv_splits = internal::kv_splits(kernel);
    r.work_items = kernel.num_items() * r.kv_splits;
    r.threads = internal::resolve_threads(p.threads, r.work_items);
    return Status::Ok();
  });
}

std::string simd_target() { return simd::ops().target; }

std::string version() { return FLASHCTE_VERSION; }

}  // namespace flashcte
