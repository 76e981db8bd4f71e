// The per-target table of the kernel's building blocks (ops.h) and its run-time dispatch.
// foreach_target compiles this file, and with it each kernel family's -inl.h, once per Highway
// target; HWY_DYNAMIC_DISPATCH picks the best table the CPU runs.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/simd/ops.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "src/simd/convert-inl.h"
#include "src/simd/elementwise-inl.h"
#include "src/simd/mm1-inl.h"
#include "src/simd/mm2-inl.h"
#include "src/simd/ops.h"
#include "src/simd/shared-inl.h"
#include "src/simd/softmax-inl.h"

HWY_BEFORE_NAMESPACE();
namespace flashcte::simd {
namespace HWY_NAMESPACE {

const Ops* GetOps() {
  static const Ops table = {hwy::TargetName(HWY_TARGET),
                            HWY_TARGET,
                            static_cast<int64_t>(hn::Lanes(DF())),
                            kRows,
                            &Qk,
                            &RowMax,
                            &ExpSum,
                            &ExpSumBf16,
                            &Softcap,
                            &Alibi,
                            &AddRow,
                            &Classify,
                            &ToFloat,
                            &NarrowBf16,
                            &InterleaveBf16,
                            &Pv};
  return &table;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace flashcte::simd {

HWY_EXPORT(GetOps);

const Ops& ops() { return *HWY_DYNAMIC_DISPATCH(GetOps)(); }

}  // namespace flashcte::simd
#endif  // HWY_ONCE
