// The attention_cte algorithm on one work item (shared/spec/attention_cte_kernel.txt):
//
//   for each softmax section of the KV axis (one tile by default; 8K tokens on Neuron):
//     pack the section's computed K tiles ([d][keys], the k_sb layout) and V tiles once, for
//       every head of the GQA group ("Q resident, KV streams");
//     for each query head of the group:
//       MM1   S = scale * Q.K^T per tile, masked element-wise only on tiles that straddle a
//             row's interval (plan.h);
//       max   neg_new = min(neg_run, -rowmax(S))       the negated running max, as on Neuron
//             alpha   = exp(-neg_run + neg_new)         = exp(m_old - m_new)
//       exp   P = exp(S + neg_new), summed as it goes   the bias is the shift: no subtract pass
//       sum   l = alpha * l + sum(P)
//       MM2   O = alpha * O + P.V                       the rescale folded into MM2's first tile
//   out = O * (1 / l): one reciprocal per row, at the end.
//
// The Neuron kernel keeps O in HBM between sections; here O stays in per-thread scratch
// (G x q_block x dv floats), which fits L2. Its 3-stage software pipeline is not reproduced:
// out-of-order cores and the hardware prefetcher overlap loads and arithmetic by themselves.
#include "src/kernel/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/kernel/convert.h"
#include "src/kernel/plan.h"

namespace flashcte::internal {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Per-thread buffers, grown on demand and kept across calls so that the hot path allocates
// nothing once warm.
struct Scratch {
  std::vector<float> q;      // [q_block][d]
  std::vector<float> k;      // [d][ldk]       one section of K, transposed
  std::vector<float> v;      // [section][ldv] one section of V
  std::vector<float> s;      // [q_block][lds] scores / probabilities of one head
  std::vector<float> o;      // [group][q_block][ldo]
  std::vector<float> state;  // [group][3][q_block]: neg_run, sum, alpha
  std::vector<RowInterval> intervals;
  BlockPlan plan;
};

Scratch& thread_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

template <class T>
void ensure(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Packs keys [begin, end) of the concatenated axis of KV batch kv_b: K transposed into
// k[c][j - base] (ldk), V into v[(j - base) * ldv + c].
void pack_kv(const Problem& p, int64_t kv_b, int64_t begin, int64_t end, int64_t base, float* k,
             int64_t ldk, float* v, int64_t ldv) {
  const int64_t prior = p.prior_used[kv_b];
  const int64_t d = p.head_dim, dv = p.value_dim;
  for (int64_t j = begin; j < end; ++j) {
    const bool from_prior = j < prior;
    const View3& kt = from_prior ? p.k_prior : p.k;
    const View3& vt = from_prior ? p.v_prior : p.v;
    const int64_t row = from_prior ? j : j - prior;
    const int64_t koff = kv_b * kt.batch_stride + row * kt.row_stride;
    const int64_t voff = kv_b * vt.batch_stride + row * vt.row_stride;
    const int64_t col = j - base;
    for (int64_t c = 0; c < d; ++c) {
      k[c * ldk + col] = load_as_float(kt.data, koff + c * kt.col_stride, p.dtype);
    }
    float* vrow = v + col * ldv;
    for (int64_t c = 0; c < dv; ++c) {
      vrow[c] = load_as_float(vt.data, voff + c * vt.col_stride, p.dtype);
    }
  }
}

void pack_q(const Problem& p, int64_t b, int64_t row0, int64_t rows, float* q) {
  const int64_t d = p.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = b * p.q.batch_stride + (row0 + r) * p.q.row_stride;
    for (int64_t c = 0; c < d; ++c) {
      q[r * d + c] = load_as_float(p.q.data, off + c * p.q.col_stride, p.dtype);
    }
  }
}

void write_row(const Problem& p, int64_t b, int64_t i, const float* o, float neg_run, float sum) {
  const MutView3& out = p.out;
  const int64_t off = b * out.batch_stride + i * out.row_stride;
  float neg_max = neg_run, sum_recip, lse;
  if (sum > 0.0f) {
    sum_recip = 1.0f / sum;
    for (int64_t c = 0; c < p.value_dim; ++c) {
      store_from_float(out.data, off + c * out.col_stride, p.dtype, o[c] * sum_recip);
    }
    lse = -neg_run + std::log(sum);
  } else {
    // No key and no sink: the documented empty-row result.
    for (int64_t c = 0; c < p.value_dim; ++c) {
      store_from_float(out.data, off + c * out.col_stride, p.dtype, 0.0f);
    }
    neg_max = kInf;
    sum_recip = kInf;
    lse = -kInf;
  }
  if (p.neg_max.data) *p.neg_max.at(b, i) = neg_max;
  if (p.sum_recip.data) *p.sum_recip.at(b, i) = sum_recip;
  if (p.lse.data) *p.lse.at(b, i) = lse;
}

}  // namespace

void run_work_item(const Problem& p, const simd::Ops& ops, int64_t kv_b, int64_t q_block) {
  Scratch& sc = thread_scratch();
  const int64_t row0 = q_block * p.tiles.q_block;
  const int64_t rows = std::min(p.tiles.q_block, p.seqlen_q - row0);
  const int64_t group = p.group, d = p.head_dim;
  const int64_t section = section_length(p, kv_b);
  const int64_t ldk = simd::leading_dim(section), lds = ldk;
  const int64_t ldv = simd::padded(p.value_dim), ldo = ldv;

  ensure(sc.intervals, rows);
  for (int64_t r = 0; r < rows; ++r) sc.intervals[r] = row_interval(p, kv_b, row0 + r);
  plan_block(p, kv_b, sc.intervals.data(), rows, &sc.plan);

  ensure(sc.q, rows * d);
  ensure(sc.k, d * ldk);
  ensure(sc.v, (section + simd::kPadFloats) * ldv);
  ensure(sc.s, rows * lds);
  ensure(sc.o, group * rows * ldo);
  ensure(sc.state, group * 3 * rows);

  // Initial state: the sink is a column of logit sink[b] with no value, so it seeds the max and
  // contributes exp(sink - sink) = 1 to the sum (the kernel appends it in section 0).
  for (int64_t h = 0; h < group; ++h) {
    const int64_t b = kv_b * group + h;
    float* neg_run = &sc.state[(h * 3 + 0) * rows];
    float* sum = &sc.state[(h * 3 + 1) * rows];
    const float sink = p.sink ? p.sink[b * p.sink_stride] : 0.0f;
    std::fill(neg_run, neg_run + rows, p.sink ? -sink : kInf);
    std::fill(sum, sum + rows, p.sink ? 1.0f : 0.0f);
    std::fill(&sc.o[h * rows * ldo], &sc.o[(h + 1) * rows * ldo], 0.0f);
  }

  const bool round_p = p.dtype == DType::kBFloat16;
  for (const SectionWork& sec : sc.plan.sections) {
    const TileWork* tiles = sc.plan.tiles.data() + sec.first_tile;
    const int64_t num_tiles = sec.end_tile - sec.first_tile;
    for (int64_t t = 0; t < num_tiles; ++t) {
      pack_kv(p, kv_b, tiles[t].begin, tiles[t].end, sec.begin, sc.k.data(), ldk, sc.v.data(), ldv);
    }
    for (int64_t h = 0; h < group; ++h) {
      const int64_t b = kv_b * group + h;
      float* neg_run = &sc.state[(h * 3 + 0) * rows];
      float* sum = &sc.state[(h * 3 + 1) * rows];
      float* alpha = &sc.state[(h * 3 + 2) * rows];
      float* o = &sc.o[h * rows * ldo];
      pack_q(p, b, row0, rows, sc.q.data());

      // MM1 and the element-wise mask of straddling tiles.
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t off = tiles[t].begin - sec.begin;
        ops.qk(sc.q.data(), d, rows, sc.k.data() + off, ldk, tiles[t].end - tiles[t].begin, d,
               p.scale, sc.s.data() + off, lds);
        if (!tiles[t].masked) continue;
        for (int64_t r = 0; r < rows; ++r) {
          float* srow = sc.s.data() + r * lds;
          const RowInterval iv = sc.intervals[r];
          for (int64_t j = tiles[t].begin; j < std::min(iv.lo, tiles[t].end); ++j) {
            srow[j - sec.begin] = -kInf;
          }
          for (int64_t j = std::max(iv.hi, tiles[t].begin); j < tiles[t].end; ++j) {
            srow[j - sec.begin] = -kInf;
          }
        }
      }

      // Section max, the negated running max, alpha, and the fused exp-and-sum.
      for (int64_t r = 0; r < rows; ++r) {
        float* srow = sc.s.data() + r * lds;
        float row_max = -kInf;
        for (int64_t t = 0; t < num_tiles; ++t) {
          row_max = std::max(row_max, ops.row_max(srow + (tiles[t].begin - sec.begin),
                                                  tiles[t].end - tiles[t].begin));
        }
        const float neg_new = std::min(neg_run[r], -row_max);
        alpha[r] = neg_run[r] == kInf ? 0.0f : std::exp(neg_new - neg_run[r]);
        // A row with nothing unmasked yet keeps bias 0 so that exp(-inf + 0) = 0, not NaN.
        const float bias = neg_new == kInf ? 0.0f : neg_new;
        float section_sum = 0.0f;
        for (int64_t t = 0; t < num_tiles; ++t) {
          section_sum += ops.exp_sum(srow + (tiles[t].begin - sec.begin),
                                     tiles[t].end - tiles[t].begin, bias, round_p);
        }
        sum[r] = alpha[r] * sum[r] + section_sum;
        neg_run[r] = neg_new;
      }

      // MM2, with alpha folded into the first tile of the section.
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t off = tiles[t].begin - sec.begin;
        ops.pv(sc.s.data() + off, lds, rows, tiles[t].end - tiles[t].begin, sc.v.data() + off * ldv,
               ldv, ldv, t == 0 ? alpha : nullptr, o, ldo);
      }
    }
  }

  for (int64_t h = 0; h < group; ++h) {
    const int64_t b = kv_b * group + h;
    const float* neg_run = &sc.state[(h * 3 + 0) * rows];
    const float* sum = &sc.state[(h * 3 + 1) * rows];
    for (int64_t r = 0; r < rows; ++r) {
      write_row(p, b, row0 + r, &sc.o[(h * rows + r) * ldo], neg_run[r], sum[r]);
    }
  }
}

}  // namespace flashcte::internal
