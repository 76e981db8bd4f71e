// The attention_cte algorithm on one work item (shared/spec/attention_cte_kernel.txt):
//
//   for each softmax section of the KV axis (one tile by default; 8K tokens on Neuron):
//     pack the section's computed K tiles ([d][keys], the k_sb layout) and V tiles once, for
//       every head of the GQA group ("Q resident, KV streams");
//     for each query head of the group:
//       MM1   S = (scale * Q).K^T per tile, masked element-wise only on tiles that straddle a
//             row's interval (plan.h); on the native bf16 kernels S = scale * (Q.K^T);
//       max   neg_new = min(neg_run, -rowmax(S))       the negated running max, as on Neuron
//             alpha   = exp(-neg_run + neg_new)         = exp(m_old - m_new)
//       exp   P = exp(S + neg_new), summed as it goes   the bias is the shift: no subtract pass
//       sum   l = alpha * l + sum(P)
//       MM2   O = alpha * O + P.V                       the rescale folded into MM2's first tile
//   out = O * (1 / l): one reciprocal per row, at the end.
//
// bfloat16 inputs run either on float32 blocks (widened at packing, the Ops table's FMA kernels)
// or, where simd::bf16_dot_for says so, on bfloat16 pairs and vdpbf16ps (simd/bf16_dot.h), per
// section: a section with a NaN, Inf or subnormal value widens.
//
// The Neuron kernel keeps O in HBM between sections; here O stays in per-thread scratch
// (G x q_block x dv floats), which fits L2. Its 3-stage software pipeline is not reproduced:
// out-of-order cores and the hardware prefetcher overlap loads and arithmetic by themselves.
#include "src/kernel/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "src/kernel/convert.h"
#include "src/kernel/pack.h"
#include "src/kernel/plan.h"
#include "src/simd/bf16_dot.h"

namespace flashcte::internal {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Query rows whose scores are live at once (the S buffer's height). The work item's q_block rows
// share each packed K/V tile; they are computed kSubRows at a time so that S stays small.
// 48 = 8 register blocks of the 6-row float32 micro-kernels and 6 of the 8-row native bf16 ones;
// a sub-block of 48 x 256 scores is 48 KiB, L1/L2 resident.
constexpr int64_t kSubRows = 48;

// Elements on 64-byte cache lines. The micro-kernels load 64-byte rows of K, V, S and O (leading
// dimensions are multiples of 16 floats); from std::vector, whose large blocks start 16 bytes
// into a page, every such row straddled two lines.
template <class T>
class LineAligned {
 public:
  T* data() { return data_.get(); }
  T& operator[](size_t i) { return data_.get()[i]; }
  // At least n elements; the contents are not kept when it grows.
  void ensure(size_t n) {
    if (n <= size_) return;
    constexpr size_t kLine = 64;
    const size_t bytes = (n * sizeof(T) + kLine - 1) / kLine * kLine;
    data_.reset(static_cast<T*>(std::aligned_alloc(kLine, bytes)));
    if (!data_) throw std::bad_alloc();
    size_ = n;
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0;
};
using LineAlignedFloats = LineAligned<float>;

// Per-thread buffers, grown on demand and kept across calls so that the hot path allocates
// nothing once warm.
struct Scratch {
  LineAlignedFloats q;      // [q_block][d]
  LineAlignedFloats k;      // [d][ldk]       one section of K, transposed
  LineAlignedFloats v;      // [section][ldv] one section of V
  LineAlignedFloats s;      // [q_block][lds] scores / probabilities of one head
  LineAlignedFloats o;      // [group][q_block][ldo]
  LineAlignedFloats state;  // [group][3][q_block]: neg_run, sum, alpha
  // The native bfloat16 path (simd/bf16_dot.h): the same blocks as bfloat16 pairs.
  LineAligned<uint16_t> q2;    // [group][q_block][d2]  unscaled
  LineAligned<uint32_t> k2;    // [d2 / 2][ldk]
  LineAligned<uint32_t> v2;    // [section / 2 + 1][ldv]
  LineAligned<uint16_t> p2;    // [q_block][lds]
  std::vector<float> convert;  // one row or column being converted
  std::vector<RowInterval> intervals;
  BlockPlan plan;                    // the whole work item: what gets packed
  std::vector<BlockPlan> sub_plans;  // each sub-block: what it computes
  std::vector<size_t> sub_cursor;    // next section of each sub-block
  bool v_nonfinite = false;          // the packed V section holds a NaN or Inf
};

Scratch& thread_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

template <class T>
void ensure(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}
template <class T>
void ensure(LineAligned<T>& v, size_t n) {
  v.ensure(n);
}

// Writes output row i of batch b from its unnormalized accumulator o (scaled in place) and the
// statistics.
void write_row(const Problem& p, int64_t b, int64_t i, float* o, float neg_run, float sum) {
  const MutView3& out = p.out;
  const int64_t off = b * out.batch_stride + i * out.row_stride;
  float neg_max = neg_run, sum_recip, lse;
  // Empty only when the sum is exactly 0: a NaN sum (a NaN or Inf among the row's scores or
  // values) must come out as NaN, not as an empty row.
  if (sum != 0.0f) {
    sum_recip = 1.0f / sum;
    for (int64_t c = 0; c < p.value_dim; ++c) o[c] *= sum_recip;
    lse = -neg_run + std::log(sum);
  } else {
    // No key and no sink: the documented empty-row result.
    std::fill(o, o + p.value_dim, 0.0f);
    neg_max = kInf;
    sum_recip = kInf;
    lse = -kInf;
  }
  store_row_from_float(out.data, off, out.col_stride, p.dtype, o, p.value_dim);
  if (p.neg_max.data) *p.neg_max.at(b, i) = neg_max;
  if (p.sum_recip.data) *p.sum_recip.at(b, i) = sum_recip;
  if (p.lse.data) *p.lse.at(b, i) = lse;
}

// One head's rows (a sub-block of the work item) through one softmax section: MM1, the mask of
// straddling tiles, the negated running max and alpha, the fused exp-and-sum, MM2.
struct HeadRows {
  int64_t b;                     // query batch
  int64_t row0;                  // global index of the first row (positions, key_bias)
  int64_t prior;                 // prior_used_len of the KV batch
  const float* q;                // [rows][d]
  const uint16_t* q2;            // [rows][d2] (native bfloat16 path only)
  const RowInterval* intervals;  // [rows]
  float* neg_run;                // [rows]
  float* sum;                    // [rows]
  float* alpha;                  // [rows]
  float* o;                      // [rows][ldo]
  int64_t rows;
};

// softcap, ALiBi and key_bias on the rows x n scores of the tile starting at key j0.
void apply_modifiers(const Problem& p, const simd::Ops& ops, const HeadRows& hr, int64_t j0,
                     int64_t n, float* s, int64_t lds) {
  const float slope = p.alibi_slopes ? p.alibi_slopes[hr.b * p.alibi_stride] : 0.0f;
  const float* bias = p.key_bias ? p.key_bias + hr.b * p.key_bias_batch_stride : nullptr;
  for (int64_t r = 0; r < hr.rows; ++r) {
    float* srow = s + r * lds;
    if (p.softcap > 0.0f) ops.softcap(srow, n, p.softcap);
    if (p.alibi_slopes) {
      const int64_t q_pos = p.q_pos_offset + (hr.row0 + r) * p.cp_stride;
      ops.alibi(srow, n, slope, static_cast<float>(j0 - hr.prior - q_pos));
    }
    if (bias && p.key_bias_key_stride == 1) {
      ops.add(srow, bias + j0, n);
    } else if (bias) {
      for (int64_t c = 0; c < n; ++c) srow[c] += bias[(j0 + c) * p.key_bias_key_stride];
    }
  }
}

// `dot` non-null: the section runs on the native bfloat16 kernels.
void process_section(const Problem& p, const simd::Ops& ops, const simd::Bf16DotOps* dot,
                     Scratch& sc, const TileWork* tiles, int64_t num_tiles, int64_t sec_begin,
                     int64_t ldk, int64_t ldv, const HeadRows& hr) {
  const int64_t d = p.head_dim, lds = ldk, ldo = ldv, rows = hr.rows;
  float* s = sc.s.data();
  float* row_max = hr.alpha;  // alpha is free until the max is known
  std::fill(row_max, row_max + rows, -kInf);
  const bool modify = p.has_modifiers();
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t off = tiles[t].begin - sec_begin, n = tiles[t].end - tiles[t].begin;
    // Unmodified, unmasked tiles fold the row max into MM1's epilogue; the others take it once
    // the scores are final.
    const bool fused_max = !tiles[t].masked && !modify;
    if (dot) {
      dot->qk(hr.q2, pair_dim(d), rows, sc.k2.data() + off, ldk, n, pair_dim(d), p.scale, s + off,
              lds, fused_max ? row_max : nullptr);
    } else {
      ops.qk(hr.q, d, rows, sc.k.data() + off, ldk, n, d, s + off, lds,
             fused_max ? row_max : nullptr);
    }
    if (fused_max) continue;
    if (modify) apply_modifiers(p, ops, hr, tiles[t].begin, n, s + off, lds);
    if (!tiles[t].masked) {
      for (int64_t r = 0; r < rows; ++r) {
        row_max[r] = std::max(row_max[r], ops.row_max(s + r * lds + off, n));
      }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      // Columns [lo, hi) of this tile, relative to the tile, are the row's unmasked ones.
      float* srow = s + r * lds + off;
      const int64_t lo = std::clamp(hr.intervals[r].lo - tiles[t].begin, int64_t{0}, n);
      const int64_t hi = std::clamp(hr.intervals[r].hi - tiles[t].begin, lo, n);
      std::fill(srow, srow + lo, -kInf);
      std::fill(srow + hi, srow + n, -kInf);
      if (hi > lo) row_max[r] = std::max(row_max[r], ops.row_max(srow + lo, hi - lo));
    }
  }

  const bool round_p = p.dtype == DType::kBFloat16;
  for (int64_t r = 0; r < rows; ++r) {
    float* srow = s + r * lds;
    const float neg_new = std::min(hr.neg_run[r], -row_max[r]);
    hr.alpha[r] = hr.neg_run[r] == kInf ? 0.0f : std::exp(neg_new - hr.neg_run[r]);
    // A row with nothing unmasked yet keeps bias 0 so that exp(-inf + 0) = 0, not NaN.
    const float bias = neg_new == kInf ? 0.0f : neg_new;
    float section_sum = 0.0f;
    for (int64_t t = 0; t < num_tiles; ++t) {
      const int64_t off = tiles[t].begin - sec_begin, n = tiles[t].end - tiles[t].begin;
      section_sum += dot ? dot->exp_sum(srow + off, n, bias, sc.p2.data() + r * lds + off)
                         : ops.exp_sum(srow + off, n, bias, round_p);
    }
    hr.sum[r] = hr.alpha[r] * hr.sum[r] + section_sum;
    hr.neg_run[r] = neg_new;
  }

  // MM2, with alpha folded into the first tile of the section, over V's padded width (zeros
  // past dv; ldv may be wider still, see simd::odd_cache_lines).
  const int64_t dv_pad = simd::padded(p.value_dim);
  if (dot) {
    // Runs of touching tiles on whole pairs of keys (P2 from the exp above); a pair's key outside
    // the run gets P = 0 (and V = 0 or a packed value, pack_pairs).
    uint16_t* p2 = sc.p2.data();
    bool first = true;
    for_each_run(tiles, num_tiles, sec_begin, [&](int64_t a, int64_t b) {
      const int64_t a2 = a / 2 * 2, b2 = pair_dim(b);
      for (int64_t r = 0; r < rows; ++r) {
        if (a2 != a) p2[r * lds + a2] = 0;
        if (b2 != b) p2[r * lds + b] = 0;
      }
      dot->pv(p2 + a2, lds, rows, b2 - a2, sc.v2.data() + a2 / 2 * ldv, ldv, dv_pad,
              first ? hr.alpha : nullptr, hr.o, ldo);
      first = false;
    });
    return;
  }
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t off = tiles[t].begin - sec_begin, n = tiles[t].end - tiles[t].begin;
    const float* v = sc.v.data() + off * ldv;
    if (!(tiles[t].masked && sc.v_nonfinite)) {
      ops.pv(s + off, lds, rows, n, v, ldv, dv_pad, t == 0 ? hr.alpha : nullptr, hr.o, ldo);
      continue;
    }
    // A NaN or Inf value must reach only the rows that attend its key: 0 * NaN is NaN, so
    // each row contracts over its own unmasked columns only (rare: non-finite inputs).
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lo = std::clamp(hr.intervals[r].lo - tiles[t].begin, int64_t{0}, n);
      const int64_t hi = std::clamp(hr.intervals[r].hi - tiles[t].begin, lo, n);
      ops.pv(s + r * lds + off + lo, lds, 1, hi - lo, v + lo * ldv, ldv, dv_pad,
             t == 0 ? hr.alpha + r : nullptr, hr.o + r * ldo, ldo);
    }
  }
}

// Packs section `sec` of the item's plan for the path it runs on and returns the native
// kernels when that path is theirs (dot non-null and the section's values allow it), else null.
// The native kernels flush subnormal inputs, and a NaN or Inf value needs the float32 path's
// per-row exact MM2 (process_section): such sections widen.
const simd::Bf16DotOps* pack_section(const Problem& p, const simd::Ops& ops,
                                     const simd::Bf16DotOps* dot, int64_t kv_b,
                                     const SectionWork& sec, int64_t ldk, int64_t ldv,
                                     Scratch& sc) {
  const TileWork* tiles = sc.plan.tiles.data() + sec.first_tile;
  const int64_t num_tiles = sec.end_tile - sec.first_tile;
  sc.v_nonfinite = false;
  if (dot && can_pack_pairs_directly(p) &&
      !pack_pairs_directly(p, ops, kv_b, tiles, num_tiles, sec.begin, ldk, ldv, sc.k2.data(),
                           sc.v2.data())) {
    return dot;
  }
  bool subnormal = false;
  for (int64_t t = 0; t < num_tiles; ++t) {
    pack_kv(p, ops, kv_b, tiles[t].begin, tiles[t].end, sec.begin, sc.k.data(), ldk, sc.v.data(),
            ldv, sc.convert);
    const int64_t off = tiles[t].begin - sec.begin, n = tiles[t].end - tiles[t].begin;
    const unsigned v_classes = ops.classify(sc.v.data() + off * ldv, n * ldv);
    sc.v_nonfinite |= (v_classes & simd::kNonFinite) != 0;
    if (!dot) continue;
    subnormal |= (v_classes & simd::kSubnormal) != 0;
    for (int64_t x = 0; x < p.head_dim; ++x) {
      subnormal |= (ops.classify(sc.k.data() + x * ldk + off, n) & simd::kSubnormal) != 0;
    }
  }
  if (!dot || sc.v_nonfinite || subnormal) return nullptr;
  pack_pairs(p, ops, tiles, num_tiles, sec.begin, sc.k.data(), ldk, sc.v.data(), ldv, sc.k2.data(),
             sc.v2.data());
  return dot;
}

}  // namespace

void run_work_item(const Problem& p, const simd::Ops& ops, const ItemRange& item, float* partial) {
  Scratch& sc = thread_scratch();
  const int64_t kv_b = item.kv_batch, q_block = item.q_block;
  const int64_t row0 = q_block * p.tiles.q_block;
  const int64_t rows = std::min(p.tiles.q_block, p.seqlen_q - row0);
  const int64_t group = p.group, d = p.head_dim;
  const int64_t section = section_length(p, kv_b);
  const int64_t ldk = simd::leading_dim(section), lds = ldk;
  const int64_t ldv = simd::odd_cache_lines(simd::padded(p.value_dim)), ldo = ldv;
  const int64_t subs = (rows + kSubRows - 1) / kSubRows;

  // The item's plan decides what is packed; each sub-block's own plan what it computes.
  // A KV split sees only its own keys: its rows' intervals are clipped to the split.
  ensure(sc.intervals, rows);
  for (int64_t r = 0; r < rows; ++r) {
    RowInterval iv = row_interval(p, kv_b, row0 + r);
    iv.lo = std::max(iv.lo, item.kv_begin);
    iv.hi = std::max(iv.lo, std::min(iv.hi, item.kv_end));
    sc.intervals[r] = iv;
  }
  plan_block(p, kv_b, sc.intervals.data(), rows, &sc.plan);
  if (sc.sub_plans.size() < static_cast<size_t>(subs)) sc.sub_plans.resize(subs);
  for (int64_t sb = 0; sb < subs; ++sb) {
    const int64_t r0 = sb * kSubRows;
    plan_block(p, kv_b, sc.intervals.data() + r0, std::min(kSubRows, rows - r0), &sc.sub_plans[sb]);
  }

  ensure(sc.q, group * rows * d);
  ensure(sc.k, d * ldk);
  ensure(sc.v, (section + simd::kPadFloats) * ldv);
  ensure(sc.s, std::min(kSubRows, rows) * lds);
  ensure(sc.o, group * rows * ldo);
  ensure(sc.state, group * 3 * rows);
  ensure(sc.sub_cursor, subs);
  // bfloat16 inputs run on the native kernels where the policy says so (simd/bf16_dot.h).
  const simd::Bf16DotOps* dot = p.dtype == DType::kBFloat16 ? simd::bf16_dot_for(ops) : nullptr;
  const int64_t d2 = pair_dim(d);
  if (dot) {
    ensure(sc.q2, group * rows * d2);
    ensure(sc.k2, d2 / 2 * ldk);
    ensure(sc.v2, (section / 2 + 1) * ldv);
    ensure(sc.p2, std::min(kSubRows, rows) * lds);
  }
  std::fill(sc.sub_cursor.begin(), sc.sub_cursor.begin() + subs, 0);

  // Q resident: every head's rows packed once. Initial state: the sink is a column of logit
  // sink[b] with no value, so it seeds the max and contributes exp(sink - sink) = 1 to the sum
  // (the kernel appends it in section 0).
  bool q_subnormal = false;
  for (int64_t h = 0; h < group; ++h) {
    const int64_t b = kv_b * group + h;
    q_subnormal |= pack_q(p, ops, b, row0, rows, &sc.q[h * rows * d],
                          dot ? &sc.q2[h * rows * d2] : nullptr, sc.convert);
    float* neg_run = &sc.state[(h * 3 + 0) * rows];
    float* sum = &sc.state[(h * 3 + 1) * rows];
    // A sink of -inf is no sink (validation refuses +inf and NaN). Splits leave the sink to
    // the merge.
    const float sink = p.sink && !partial ? p.sink[b * p.sink_stride] : -kInf;
    std::fill(neg_run, neg_run + rows, -sink);
    std::fill(sum, sum + rows, sink == -kInf ? 0.0f : 1.0f);
    std::fill(&sc.o[h * rows * ldo], &sc.o[(h + 1) * rows * ldo], 0.0f);
  }
  const simd::Bf16DotOps* item_dot = q_subnormal ? nullptr : dot;

  for (const SectionWork& sec : sc.plan.sections) {
    const simd::Bf16DotOps* sec_dot = pack_section(p, ops, item_dot, kv_b, sec, ldk, ldv, sc);
    for (int64_t sb = 0; sb < subs; ++sb) {
      // The sub-block's sections are a subset of the item's, in the same order.
      const BlockPlan& sp = sc.sub_plans[sb];
      size_t& cursor = sc.sub_cursor[sb];
      if (cursor >= sp.sections.size() || sp.sections[cursor].begin != sec.begin) continue;
      const SectionWork& ss = sp.sections[cursor++];
      const int64_t r0 = sb * kSubRows;
      for (int64_t h = 0; h < group; ++h) {
        HeadRows hr;
        hr.b = kv_b * group + h;
        hr.row0 = row0 + r0;
        hr.prior = p.prior_used[kv_b];
        hr.rows = std::min(kSubRows, rows - r0);
        hr.q = &sc.q[(h * rows + r0) * d];
        hr.q2 = item_dot ? &sc.q2[(h * rows + r0) * d2] : nullptr;
        hr.intervals = sc.intervals.data() + r0;
        hr.neg_run = &sc.state[(h * 3 + 0) * rows + r0];
        hr.sum = &sc.state[(h * 3 + 1) * rows + r0];
        hr.alpha = &sc.state[(h * 3 + 2) * rows + r0];
        hr.o = &sc.o[(h * rows + r0) * ldo];
        process_section(p, ops, sec_dot, sc, sp.tiles.data() + ss.first_tile,
                        ss.end_tile - ss.first_tile, sec.begin, ldk, ldv, hr);
      }
    }
  }

  for (int64_t h = 0; h < group; ++h) {
    const int64_t b = kv_b * group + h;
    const float* neg_run = &sc.state[(h * 3 + 0) * rows];
    const float* sum = &sc.state[(h * 3 + 1) * rows];
    for (int64_t r = 0; r < rows; ++r) {
      float* o = &sc.o[(h * rows + r) * ldo];
      if (partial == nullptr) {
        write_row(p, b, row0 + r, o, neg_run[r], sum[r]);
        continue;
      }
      float* dst = partial + (h * p.tiles.q_block + r) * (p.value_dim + 2);
      std::copy(o, o + p.value_dim, dst);
      dst[p.value_dim] = neg_run[r];
      dst[p.value_dim + 1] = sum[r];
    }
  }
}

ItemCounts count_work_item(const Problem& p, int64_t kv_b, int64_t q_block) {
  ItemCounts counts;
  const int64_t row0 = q_block * p.tiles.q_block;
  const int64_t rows = std::min(p.tiles.q_block, p.seqlen_q - row0);
  std::vector<RowInterval> iv(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    iv[r] = row_interval(p, kv_b, row0 + r);
    counts.pairs_useful += iv[r].hi - iv[r].lo;
  }
  BlockPlan plan;
  for (int64_t r0 = 0; r0 < rows; r0 += kSubRows) {
    const int64_t n = std::min(kSubRows, rows - r0);
    plan_block(p, kv_b, iv.data() + r0, n, &plan);
    counts.tiles_full += plan.tiles_full;
    counts.tiles_masked += plan.tiles_masked;
    counts.tiles_skipped += plan.tiles_skipped;
    counts.pairs_computed += n * plan.computed_columns;
  }
  return counts;
}

void merge_splits(const Problem& p, int64_t kv_b, int64_t q_block, const float* partials,
                  int64_t splits) {
  const int64_t row0 = q_block * p.tiles.q_block;
  const int64_t rows = std::min(p.tiles.q_block, p.seqlen_q - row0);
  const int64_t dv = p.value_dim, stride = dv + 2;
  std::vector<float> o(static_cast<size_t>(dv));
  for (int64_t h = 0; h < p.group; ++h) {
    const int64_t b = kv_b * p.group + h;
    const float sink = p.sink ? p.sink[b * p.sink_stride] : -kInf;
    for (int64_t r = 0; r < rows; ++r) {
      // The same recurrence as across sections, over the splits in order; the sink seeds it.
      float neg_run = -sink, sum = sink == -kInf ? 0.0f : 1.0f;
      std::fill(o.begin(), o.end(), 0.0f);
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* part = partials + sp * partial_floats(p) + (h * p.tiles.q_block + r) * stride;
        const float part_neg = part[dv], part_sum = part[dv + 1];
        if (part_sum == 0.0f) continue;  // the split saw no key of this row
        const float neg_new = std::min(neg_run, part_neg);
        const float alpha = neg_run == kInf ? 0.0f : std::exp(neg_new - neg_run);
        const float beta = std::exp(neg_new - part_neg);
        for (int64_t c = 0; c < dv; ++c) o[c] = alpha * o[c] + beta * part[c];
        sum = alpha * sum + beta * part_sum;
        neg_run = neg_new;
      }
      write_row(p, b, row0 + r, o.data(), neg_run, sum);
    }
  }
}

}  // namespace flashcte::internal
