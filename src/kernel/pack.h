// Packing: a work item's Q rows and K/V tiles from the caller's tensors into the micro-kernels'
// layouts, once per item (Q) or per section (K, V), against O(rows x tile x d) arithmetic.
//   float32 (every dtype widened): Q [rows][d] scaled, K [d][ldk] transposed, V [keys][ldv]
//     (float32 V already in that layout is read in place)
//   bfloat16 pairs for the native kernels (src/simd/native_ops.h): Q2, K2, V2; from the float32
//     blocks (pack_pairs) or, for bfloat16 tensors in the usual layouts, straight from the
//     tensors (pack_pairs_directly), which skips the float32 pass
#ifndef FLASHCTE_SRC_KERNEL_PACK_H_
#define FLASHCTE_SRC_KERNEL_PACK_H_

#include <cstdint>
#include <vector>

#include "src/core/problem.h"
#include "src/kernel/plan.h"
#include "src/kernel/scratch.h"
#include "src/kernel/section.h"
#include "src/simd/native_ops.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// Head dims rounded up to whole bfloat16 pairs (simd/native_ops.h).
inline int64_t pair_dim(int64_t d) { return (d + 1) / 2 * 2; }

// Calls body(begin, end) for each run of consecutive tiles [begin, end) that touch, as offsets
// from `origin`.
template <class Body>
void for_each_run(const TileWork* tiles, int64_t num_tiles, int64_t origin, const Body& body) {
  for (int64_t t = 0; t < num_tiles;) {
    const int64_t begin = tiles[t].begin;
    int64_t end = tiles[t].end;
    for (++t; t < num_tiles && tiles[t].begin == end; ++t) end = tiles[t].end;
    body(begin - origin, end - origin);
  }
}

// Packs keys [begin, end) of KV batch kv_b's concatenated axis: K transposed into
// k[c * ldk + (j - base)], V (unless null) into v[(j - base) * ldv + c], V's padding columns zero.
// An 8-bit prior's keys hold code x scale, or with `codes_only` the codes' values alone.
void pack_kv(const Problem& problem, const simd::Ops& ops, int64_t kv_b, int64_t begin, int64_t end,
             int64_t base, float* k, int64_t ldk, float* v, int64_t ldv, Scratch& scratch,
             bool codes_only);

// Packs query rows [row0, row0 + rows) of batch b, multiplied by scale, into q [rows][d]; with
// q2, also the unscaled rows as bfloat16 [rows][pair_dim(d)]. Returns whether q2's rows hold a
// subnormal, which the native kernels would flush.
bool pack_q(const Problem& problem, const simd::Ops& ops, int64_t b, int64_t row0, int64_t rows,
            float* q, uint16_t* q2, std::vector<float>& tmp);

// The section's tiles of packed float32 K and V (pack_kv) again as bfloat16 pairs in k2, v2.
void pack_pairs(const Problem& problem, const simd::Ops& ops, const TileWork* tiles,
                int64_t num_tiles, int64_t sec_begin, const float* k, int64_t ldk, const float* v,
                int64_t ldv, uint32_t* k2, uint32_t* v2);

// Whether pack_pairs_directly serves this problem: bfloat16 K with the keys of a channel
// contiguous and V with the channels of a key contiguous.
bool can_pack_pairs_directly(const Problem& problem);

// The section's tiles as pack_kv + pack_pairs would leave k2 and v2, straight from the tensors;
// returns whether any value read is non-finite or subnormal (then the section needs the float32
// path, which the caller packs).
bool pack_pairs_directly(const Problem& problem, const simd::Ops& ops, int64_t kv_b,
                         const TileWork* tiles, int64_t num_tiles, int64_t sec_begin, int64_t ldk,
                         int64_t ldv, uint32_t* k2, uint32_t* v2);

// Sizes the buffers packing uses in `scratch` for any work item of `problem`: query blocks of
// up to `rows` rows, tiles of up to `keys` keys, sections of up to `section` keys, on the native
// bfloat16 path or not.
void reserve_pack_buffers(const Problem& problem, int64_t rows, int64_t keys, int64_t section,
                          bool native, Scratch& scratch);

// Packs section `section` of the work item's plan (scratch.plan) for the path it runs on: the
// native bfloat16 kernels when `dot` is non-null and the section's values allow it, else float32
// blocks. The native kernels flush subnormal inputs, and a NaN or Inf value needs the float32
// path's per-row exact MM2 (section.cc): such sections widen.
PackedSection pack_section(const Problem& problem, const simd::Ops& ops, const simd::NativeOps* dot,
                           int64_t kv_b, const SectionWork& section, int64_t ldk, int64_t ldv,
                           Scratch& scratch);

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_PACK_H_
