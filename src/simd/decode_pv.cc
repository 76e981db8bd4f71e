// Decode's PV kernel (decode_pv-inl.h) for every Highway target; ops.cc's table points at it.
// The decode kernels are most of the SIMD layer's compile time, so each matmul is a translation
// unit of its own (decode_qk.cc has the other) and a build's cores share them: in ops.cc, they kept
// one core busy while the other idled (x86 Release, Xeon: ops.cc 17 s without them).

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "src/simd/decode_pv.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/highway.h"
#include "src/simd/decode_pv-inl.h"
