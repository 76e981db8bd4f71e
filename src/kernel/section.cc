#include "src/kernel/section.h"

#include <algorithm>
#include <limits>

#include "src/kernel/pack.h"

namespace flashcte::internal {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// softcap, ALiBi and key_bias on the rows x n scores of the tile starting at key j0.
void apply_modifiers(const Problem& problem, const simd::Ops& ops, const HeadBlock& head,
                     int64_t rows, int64_t j0, int64_t n, float* s, int64_t lds) {
  const float slope =
      problem.alibi_slopes ? problem.alibi_slopes[head.batch * problem.alibi_stride] : 0.0f;
  const float* bias =
      problem.key_bias ? problem.key_bias + head.batch * problem.key_bias_batch_stride : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = s + r * lds;
    if (problem.softcap > 0.0f) ops.softcap(srow, n, problem.softcap);
    if (problem.alibi_slopes) {
      const int64_t q_pos = problem.q_pos_offset + (head.first_row + r) * problem.cp_stride;
      ops.alibi(srow, n, slope, static_cast<float>(j0 - head.prior - q_pos));
    }
    if (bias && problem.key_bias_key_stride == 1) {
      ops.add(srow, bias + j0, n);
    } else if (bias) {
      for (int64_t c = 0; c < n; ++c) srow[c] += bias[(j0 + c) * problem.key_bias_key_stride];
    }
  }
}

// Columns [lo, hi) of a tile starting at column `begin` with n columns, relative to the tile,
// that row interval `interval` leaves unmasked.
struct Columns {
  int64_t lo, hi;
};
Columns unmasked_columns(const RowInterval& interval, int64_t begin, int64_t n) {
  const int64_t lo = std::clamp(interval.lo - begin, int64_t{0}, n);
  return {lo, std::clamp(interval.hi - begin, lo, n)};
}

// MM1 over the section's tiles, with the modifiers and the masks, leaving each row's maximum
// score in block_max.
void scores_and_max(const Problem& problem, const simd::Ops& ops, const PackedSection& section,
                    const TileWork* tiles, int64_t num_tiles, const HeadBlock& head, int64_t rows,
                    const ScoreBuffer& scores, float* block_max) {
  const int64_t d = problem.head_dim, lds = scores.lds;
  float* s = scores.s;
  std::fill(block_max, block_max + rows, -kInf);
  const bool modify = problem.has_modifiers();
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t off = tiles[t].begin - section.begin, n = tiles[t].end - tiles[t].begin;
    // Unmodified, unmasked tiles fold the row max into MM1's epilogue; the others take it once
    // the scores are final.
    const bool fused_max = !tiles[t].masked && !modify && section.k_scale == nullptr;
    if (section.dot) {
      section.dot->qk(head.q_pairs, pair_dim(d), rows, section.k2 + off, section.ldk, n,
                      pair_dim(d), problem.scale, s + off, lds, fused_max ? block_max : nullptr);
    } else {
      ops.qk(head.q, d, rows, section.k + off, section.ldk, n, d, s + off, lds,
             fused_max ? block_max : nullptr);
    }
    if (fused_max) continue;
    if (section.k_scale) {  // an 8-bit prior's codes: scale x code . q, key by key
      for (int64_t r = 0; r < rows; ++r) ops.mul(s + r * lds + off, section.k_scale + off, n);
    }
    if (modify) apply_modifiers(problem, ops, head, rows, tiles[t].begin, n, s + off, lds);
    if (!tiles[t].masked) {
      for (int64_t r = 0; r < rows; ++r) {
        block_max[r] = std::max(block_max[r], ops.row_max(s + r * lds + off, n));
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* srow = s + r * lds + off;
      const Columns c = unmasked_columns(head.intervals[r], tiles[t].begin, n);
      std::fill(srow, srow + c.lo, -kInf);
      std::fill(srow + c.hi, srow + n, -kInf);
      if (c.hi > c.lo) block_max[r] = std::max(block_max[r], ops.row_max(srow + c.lo, c.hi - c.lo));
    }
  }
}

// MM2 on the native kernels: runs of touching tiles on whole pairs of keys (P2 from the exp);
// a pair's key outside the run gets P = 0 (and V = 0 or a packed value, pack_pairs).
void pv_native(const Problem& problem, const PackedSection& section, const TileWork* tiles,
               int64_t num_tiles, const ScoreBuffer& scores, SoftmaxState& state) {
  const int64_t lds = scores.lds, rows = state.rows(), dv_pad = simd::padded(problem.value_dim);
  uint16_t* p2 = scores.p2;
  bool first = true;
  for_each_run(tiles, num_tiles, section.begin, [&](int64_t a, int64_t b) {
    const int64_t a2 = a / 2 * 2, b2 = pair_dim(b);
    for (int64_t r = 0; r < rows; ++r) {
      if (a2 != a) p2[r * lds + a2] = 0;
      if (b2 != b) p2[r * lds + b] = 0;
    }
    section.dot->pv(p2 + a2, lds, rows, b2 - a2, section.v2 + a2 / 2 * section.ldv, section.ldv,
                    dv_pad, first ? state.alpha() : nullptr, state.o(), state.ldo());
    first = false;
  });
}

// MM2 on float32 blocks, over V's padded width (zeros past dv; ldv may be wider still, see
// simd::odd_cache_lines).
void pv_float(const Problem& problem, const simd::Ops& ops, const PackedSection& section,
              const TileWork* tiles, int64_t num_tiles, const HeadBlock& head,
              const ScoreBuffer& scores, SoftmaxState& state) {
  const int64_t lds = scores.lds, ldv = section.ldv, dv_pad = simd::padded(problem.value_dim);
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t off = tiles[t].begin - section.begin, n = tiles[t].end - tiles[t].begin;
    const float* v = section.v + off * ldv;
    float* alpha = t == 0 ? state.alpha() : nullptr;
    if (!(tiles[t].masked && section.v_nonfinite)) {
      ops.pv(scores.s + off, lds, state.rows(), n, v, ldv, dv_pad, alpha, state.o(), state.ldo());
      continue;
    }
    // A NaN or Inf value must reach only the rows that attend its key: 0 * NaN is NaN, so
    // each row contracts over its own unmasked columns only (rare: non-finite inputs).
    for (int64_t r = 0; r < state.rows(); ++r) {
      const Columns c = unmasked_columns(head.intervals[r], tiles[t].begin, n);
      ops.pv(scores.s + r * lds + off + c.lo, lds, 1, c.hi - c.lo, v + c.lo * ldv, ldv, dv_pad,
             alpha ? alpha + r : nullptr, state.o(r), state.ldo());
    }
  }
}

}  // namespace

void attend_section(const Problem& problem, const simd::Ops& ops, const PackedSection& section,
                    const TileWork* tiles, int64_t num_tiles, const HeadBlock& head,
                    const ScoreBuffer& scores, SoftmaxState& state) {
  const int64_t rows = state.rows(), lds = scores.lds;
  // alpha is free until the block's max is known.
  float* block_max = state.alpha();
  scores_and_max(problem, ops, section, tiles, num_tiles, head, rows, scores, block_max);

  const bool round_p = problem.dtype == DType::kBFloat16;
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = scores.s + r * lds;
    const float bias = state.rescale(r, block_max[r]);
    float block_sum = 0.0f;
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t off = tiles[t].begin - section.begin, n = tiles[t].end - tiles[t].begin;
      if (section.dot && section.v_scale) {
        // An 8-bit prior's V codes: P times each key's scale, rounded to bfloat16 once.
        block_sum += ops.exp_sum(srow + off, n, bias, false);
        ops.mul(srow + off, section.v_scale + off, n);
        ops.from_float(srow + off, DType::kBFloat16, n, scores.p2 + r * lds + off);
        continue;
      }
      block_sum += section.dot
                       ? section.dot->exp_sum(srow + off, n, bias, scores.p2 + r * lds + off)
                       : ops.exp_sum(srow + off, n, bias, round_p);
    }
    state.add_to_sum(r, block_sum);
  }

  if (section.dot) {
    pv_native(problem, section, tiles, num_tiles, scores, state);
  } else {
    pv_float(problem, ops, section, tiles, num_tiles, head, scores, state);
  }
}

}  // namespace flashcte::internal
