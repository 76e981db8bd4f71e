// The per-target table of the kernel's building blocks (ops.h) and its run-time dispatch.
// foreach_target compiles this file, and with it each kernel family's -inl.h, once per Highway
// target (decode's kernels in decode_qk.cc and decode_pv.cc, for a shorter build);
// HWY_DYNAMIC_DISPATCH picks the best table the CPU runs.

#include <type_traits>

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

// Defined in decode_qk.cc and decode_pv.cc for the same targets, with the table's own signatures.
std::remove_pointer_t<decltype(Ops::decode_qk)> DecodeQk;
std::remove_pointer_t<decltype(Ops::decode_pv)> DecodePv;

const Ops* GetOps() {
  // Filled by name, so that a field added to Ops cannot take another's place unnoticed.
  static const Ops table = [] {
    Ops t{};
    t.target = hwy::TargetName(HWY_TARGET);
    t.target_bits = HWY_TARGET;
    t.lanes = static_cast<int64_t>(hn::Lanes(DF()));
    t.mm_rows = kRows;
    t.qk = &Qk;
    t.row_max = &RowMax;
    t.exp_sum = &ExpSum;
    t.softcap = &Softcap;
    t.alibi = &Alibi;
    t.add = &AddRow;
    t.mul = &MulRow;
    t.classify = &Classify;
    t.to_float = &ToFloat;
    t.from_float = &FromFloat;
    t.narrow_bf16 = &NarrowBf16;
    t.interleave_bf16 = &InterleaveBf16;
    t.pair_bf16 = &PairBf16;
    t.pv = &Pv;
    t.decode_qk = &DecodeQk;
    t.decode_pv = &DecodePv;
    return t;
  }();
  return &table;
}

}  // namespace HWY_NAMESPACE
}  // namespace flashcte::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <cstdio>
#include <cstdlib>
#include <string>

namespace flashcte::simd {
namespace {

HWY_EXPORT(GetOps);

// Every compiled target's table by target bit, best first, for the cap below: x86's and
// aarch64's (there SVE2_128 and SVE_256 are Highway's SVE2 and SVE specialized for one vector
// length, ranked above the length-agnostic ones, and NEON is the baseline).
struct TargetTable {
  int64_t bit;
  const Ops* (*get)();
};
constexpr TargetTable kTables[] = {
#if HWY_TARGETS & HWY_AVX3_DL
    {HWY_AVX3_DL, &N_AVX3_DL::GetOps},
#endif
#if HWY_TARGETS & HWY_AVX3
    {HWY_AVX3, &N_AVX3::GetOps},
#endif
#if HWY_TARGETS & HWY_AVX2
    {HWY_AVX2, &N_AVX2::GetOps},
#endif
#if HWY_TARGETS & HWY_SSE4
    {HWY_SSE4, &N_SSE4::GetOps},
#endif
#if HWY_TARGETS & HWY_SSSE3
    {HWY_SSSE3, &N_SSSE3::GetOps},
#endif
#if HWY_TARGETS & HWY_SVE2_128
    {HWY_SVE2_128, &N_SVE2_128::GetOps},
#endif
#if HWY_TARGETS & HWY_SVE_256
    {HWY_SVE_256, &N_SVE_256::GetOps},
#endif
#if HWY_TARGETS & HWY_SVE2
    {HWY_SVE2, &N_SVE2::GetOps},
#endif
#if HWY_TARGETS & HWY_SVE
    {HWY_SVE, &N_SVE::GetOps},
#endif
#if HWY_TARGETS & HWY_NEON
    {HWY_NEON, &N_NEON::GetOps},
#endif
#if HWY_TARGETS & HWY_EMU128
    {HWY_EMU128, &N_EMU128::GetOps},
#endif
#if HWY_TARGETS & HWY_SCALAR
    {HWY_SCALAR, &N_SCALAR::GetOps},
#endif
    {0, nullptr},
};

// FLASHCTE_SIMD_TARGET=NAME (a Highway target name: AVX3, AVX2, SSE4, ... on x86; SVE2, SVE,
// NEON, ... on aarch64) caps the dispatch at that target, as on a CPU without the better ones:
// for reproducing another machine's results or timings, and for CI, which runs the suite under
// FLASHCTE_SIMD_TARGET=AVX2 as well. Returns the bit of the capped target, or 0 for no cap; a
// name that is not a compiled target is reported and ignored.
int64_t target_cap_from_env() {
  const char* env = std::getenv("FLASHCTE_SIMD_TARGET");
  if (env == nullptr || *env == '\0') return 0;
  std::string known;
  for (const TargetTable& t : kTables) {
    if (t.get == nullptr) break;
    if (std::string(hwy::TargetName(t.bit)) == env) {
      // Highway numbers better targets with lower bits. Disabled, they leave the lists of
      // supported targets (what tests iterate over) too.
      hwy::DisableTargets(HWY_TARGETS & (t.bit - 1));
      return t.bit;
    }
    known += std::string(known.empty() ? "" : ", ") + hwy::TargetName(t.bit);
  }
  std::fprintf(stderr,
               "flashcte: FLASHCTE_SIMD_TARGET=%s is not one of this build's targets (%s); "
               "ignored\n",
               env, known.empty() ? "none on this architecture" : known.c_str());
  return 0;
}

// At load time, before anyone (a test enumerating targets, say) asks Highway what the CPU runs.
const int64_t kTargetCap = target_cap_from_env();

// The table of the best target the CPU runs at or below the cap.
const Ops& capped_table() {
  const int64_t allowed = hwy::SupportedTargets() & HWY_TARGETS;
  for (const TargetTable& t : kTables) {
    if (t.get != nullptr && t.bit >= kTargetCap && (allowed & t.bit)) return *t.get();
  }
  return *HWY_DYNAMIC_DISPATCH(GetOps)();
}

}  // namespace

const Ops& ops() {
  const Ops& chosen = *HWY_DYNAMIC_DISPATCH(GetOps)();
  // Highway 1.0.3 can keep a target that DisableTargets removed as its chosen one (a later
  // SupportedTargets() call re-chooses from the CPU's full set), so the cap is enforced here.
  if (kTargetCap == 0 || chosen.target_bits >= kTargetCap) return chosen;
  return capped_table();
}

}  // namespace flashcte::simd
#endif  // HWY_ONCE
