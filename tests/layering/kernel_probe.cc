// Compiled (never linked) by the CTests `layers_*` (tests/CMakeLists.txt) with exactly the include
// directories of the kernel layer: its own headers and those below it must be found, and a header
// of a layer above it (dispatch) must not be.
#include "src/core/problem.h"
#include "src/kernel/attention.h"
#include "src/simd/ops.h"
#ifdef FLASHCTE_PROBE_UPWARD
#include "src/dispatch/validate.h"
#endif
