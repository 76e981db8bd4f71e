// The attention_cte algorithm on one work item (shared/spec/attention_cte_kernel.txt):
//
//   for each pass over the heads of the GQA group (all of them, unless their output state
//   outgrows kPassStateBytes: MLA's 128 heads of dv 512):
//     for each softmax section of the KV axis (one tile by default; 8K tokens on Neuron):
//       pack the section's computed K tiles ([d][keys], the k_sb layout) and V tiles once, for
//         every head of the pass ("Q resident, KV streams"; pack.h);
//       for each query sub-block and head of the pass: MM1, max, exp, MM2 (section.h), the
//         online softmax in SoftmaxState (softmax_state.h);
//   out = O * (1 / l): one reciprocal per row, at the end.
//
// bfloat16 inputs run either on float32 blocks (widened at packing, the Ops table's FMA kernels)
// or, where simd::native_ops_for says so, on bfloat16 pairs and vdpbf16ps (simd/native_ops.h), per
// section: a section with a NaN, Inf or subnormal value widens.
//
// Bytes per FLOP: a section's K and V are packed once (4 (d + dv) bytes per key read for float32
// inputs, as much written) and serve the item's q_block rows of every head of the group, 2 (d +
// dv) FLOP per row and key: 4 / (q_block x group) bytes per FLOP, 0.01 at the 384-row blocks of
// MHA. Q and O stay resident per item.
//
// The Neuron kernel keeps O in HBM between sections; here O stays in per-thread scratch
// (G x q_block x dv floats, of which a pass touches at most kPassStateBytes). Its 3-stage software
// pipeline is not reproduced: out-of-order cores and the hardware prefetcher overlap loads and
// arithmetic by themselves.
#include "src/kernel/attention.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "src/core/math.h"
#include "src/kernel/output.h"
#include "src/kernel/pack.h"
#include "src/kernel/plan.h"
#include "src/kernel/scratch.h"
#include "src/kernel/section.h"
#include "src/kernel/softmax_state.h"
#include "src/simd/native_ops.h"

namespace flashcte::internal {

Scratch& thread_scratch() {
  static thread_local Scratch scratch;
  return scratch;
}

namespace {

// Per query row and head, the fixed work besides the pairs (Q packing, the softmax state and the
// write-back), in units of one query-key pair; keeps empty rows from costing nothing. A rough
// figure, not a measurement: it only orders items for the largest-first hand-out.
constexpr double kRowOverheadPairs = 16.0;

// The sink logit of query batch b, -inf for none. A KV split leaves the sink to the merge, which
// seeds its state with it; validation refuses +inf and NaN.
float sink_logit(const Problem& problem, int64_t b, bool kv_split) {
  if (problem.sink == nullptr || kv_split) return -std::numeric_limits<float>::infinity();
  return problem.sink[b * problem.sink_stride];
}

// Normalizes row r of `state` and writes it as output row i of query batch b, with its
// statistics.
void write_row(const Problem& problem, const simd::Ops& ops, int64_t b, int64_t i,
               SoftmaxState& state, int64_t r) {
  const SoftmaxState::Stats stats = state.finish(r);
  const MutView3& out = problem.out;
  store_output_row(ops, out.data, b * out.batch_stride + i * out.row_stride, out.col_stride,
                   problem.dtype, state.o(r), problem.value_dim);
  if (problem.neg_max.data) *problem.neg_max.at(b, i) = stats.neg_max;
  if (problem.sum_recip.data) *problem.sum_recip.at(b, i) = stats.sum_recip;
  if (problem.lse.data) *problem.lse.at(b, i) = stats.lse;
}

// The work item's geometry: its rows, leading dimensions and sub-blocks.
struct ItemShape {
  int64_t kv_batch, row0, rows, section, ldk, ldv, sub_blocks;
  int64_t lds() const { return ldk; }
  int64_t ldo() const { return ldv; }
};

ItemShape item_shape(const Problem& problem, const TileConfig& tiles, int64_t kv_b,
                     int64_t q_block) {
  const QueryBlock block = query_block(problem, tiles, q_block);
  const int64_t section = section_length(problem, tiles, kv_b);
  return {kv_b,
          block.row0,
          block.rows,
          section,
          simd::leading_dim(section),
          simd::odd_cache_lines(simd::padded(problem.value_dim)),
          ceil_div(block.rows, kSubBlockRows)};
}

// Head h's softmax state rows [r0, r0 + rows) in the item's scratch.
SoftmaxState head_state(const Problem& problem, Scratch& scratch, const ItemShape& item, int64_t h,
                        int64_t r0, int64_t rows) {
  const int64_t first = h * item.rows + r0;
  return SoftmaxState(&scratch.neg_max[first], &scratch.sum[first], &scratch.alpha[first],
                      &scratch.o[first * item.ldo()], item.ldo(), rows, problem.value_dim);
}

// The item's plan (what gets packed) and each sub-block's (what it computes), from the rows'
// intervals clipped to the KV range (a KV split sees only its own keys).
void plan_item(const Problem& problem, const TileConfig& tiles, const ItemShape& item,
               int64_t kv_begin, int64_t kv_end, Scratch& scratch) {
  ensure(scratch.intervals, item.rows);
  for (int64_t r = 0; r < item.rows; ++r) {
    RowInterval interval = row_interval(problem, item.kv_batch, item.row0 + r);
    interval.lo = std::max(interval.lo, kv_begin);
    interval.hi = std::max(interval.lo, std::min(interval.hi, kv_end));
    scratch.intervals[r] = interval;
  }
  plan_block(problem, tiles, item.kv_batch, scratch.intervals.data(), item.rows, &scratch.plan);
  if (scratch.sub_plans.size() < static_cast<size_t>(item.sub_blocks)) {
    scratch.sub_plans.resize(item.sub_blocks);
  }
  for (int64_t sb = 0; sb < item.sub_blocks; ++sb) {
    const int64_t r0 = sb * kSubBlockRows;
    plan_block(problem, tiles, item.kv_batch, scratch.intervals.data() + r0,
               std::min(kSubBlockRows, item.rows - r0), &scratch.sub_plans[sb]);
  }
  ensure(scratch.sub_cursor, item.sub_blocks);  // reset by each pass over the heads (run)
}

void ensure_scratch(const Problem& problem, const ItemShape& item, bool native, Scratch& scratch) {
  const int64_t group = problem.group, d = problem.head_dim,
                sub_rows = std::min(kSubBlockRows, item.rows);
  ensure(scratch.q, group * item.rows * d);
  ensure(scratch.k, d * item.ldk);
  ensure(scratch.v, (item.section + simd::kPadFloats) * item.ldv);
  ensure(scratch.s, sub_rows * item.lds());
  ensure(scratch.o, group * item.rows * item.ldo());
  for (LineAligned<float>* row_state : {&scratch.neg_max, &scratch.sum, &scratch.alpha}) {
    ensure(*row_state, group * item.rows);
  }
  if (!native) return;
  const int64_t d2 = pair_dim(d);
  ensure(scratch.q2, group * item.rows * d2);
  ensure(scratch.k2, d2 / 2 * item.ldk);
  ensure(scratch.v2, (item.section / 2 + 1) * item.ldv);
  ensure(scratch.p2, sub_rows * item.lds());
}

// The heads of one pass over the item's KV axis: passes of equal size that keep their output
// state (rows x ldo floats a head) within kPassStateBytes. A pass packs every section again, once
// per rows x heads of its query rows. MLA's 16-128 heads (dv 512) make the state of a 64-row chunk
// 2-16 MiB. AMD EPYC Zen 5, 2 threads, chunks of 64 over 4096 cached, batch 1 and 8
// (bench/mla.py, 2 interleaved rounds), fraction of the fp32 FMA / vdpbf16ps peak, whole group
// -> 4 MiB passes: 128 heads 0.46-0.48 -> 0.61-0.63 fp32, 0.36 -> 0.46 bf16 (x1.23-1.30);
// 64 heads x1.01-1.09; 16 and 32 heads (one pass either way) unchanged. 1 MiB passes ran at
// 0.92-1.04x the speed of 4 MiB ones (median 0.96).
constexpr int64_t kPassStateBytes = int64_t{4} << 20;

int64_t heads_per_pass(const Problem& problem, const ItemShape& item) {
  const int64_t head_bytes = item.rows * item.ldo() * static_cast<int64_t>(sizeof(float));
  const int64_t most = std::max<int64_t>(kPassStateBytes / std::max<int64_t>(head_bytes, 1), 1);
  return ceil_div(problem.group, ceil_div(problem.group, most));  // passes of equal size
}

// Every sub-block of the item and its heads [h0, h1) through one packed section.
void attend_packed_section(const Problem& problem, const simd::Ops& ops, const ItemShape& item,
                           const PackedSection& packed, bool q_pairs, int64_t h0, int64_t h1,
                           Scratch& scratch) {
  const int64_t d = problem.head_dim, d2 = pair_dim(d);
  for (int64_t sb = 0; sb < item.sub_blocks; ++sb) {
    // The sub-block's sections are a subset of the item's, in the same order.
    const BlockPlan& sub_plan = scratch.sub_plans[sb];
    size_t& cursor = scratch.sub_cursor[sb];
    if (cursor >= sub_plan.sections.size() || sub_plan.sections[cursor].begin != packed.begin) {
      continue;
    }
    const SectionWork& sub_section = sub_plan.sections[cursor++];
    const int64_t r0 = sb * kSubBlockRows, rows = std::min(kSubBlockRows, item.rows - r0);
    for (int64_t h = h0; h < h1; ++h) {
      HeadBlock head;
      head.batch = item.kv_batch * problem.group + h;
      head.first_row = item.row0 + r0;
      head.prior = problem.prior_used[item.kv_batch];
      head.q = &scratch.q[(h * item.rows + r0) * d];
      head.q_pairs = q_pairs ? &scratch.q2[(h * item.rows + r0) * d2] : nullptr;
      head.intervals = scratch.intervals.data() + r0;
      SoftmaxState state = head_state(problem, scratch, item, h, r0, rows);
      attend_section(problem, ops, packed, sub_plan.tiles.data() + sub_section.first_tile,
                     sub_section.end_tile - sub_section.first_tile, head,
                     {scratch.s.data(), scratch.p2.data(), item.lds()}, state);
    }
  }
}

}  // namespace

AttentionKernel::AttentionKernel(const Problem& problem)
    : problem_(problem),
      tiles_(resolve_tiles(
          problem,
          problem.dtype == DType::kBFloat16 && simd::native_ops_for(simd::ops()) != nullptr,
          simd::ops().lanes)),
      ops_(simd::ops()) {}

int64_t AttentionKernel::num_items() const {
  return problem_.kv_batch * num_q_blocks(problem_, tiles_);
}

int64_t AttentionKernel::split_granule() const { return section_length(problem_, tiles_, 0); }

int64_t AttentionKernel::partial_rows() const {
  return std::min(tiles_.q_block, problem_.seqlen_q);
}

int64_t AttentionKernel::partial_floats() const {
  return problem_.group * partial_rows() * SoftmaxState::saved_row_floats(problem_.value_dim);
}

double AttentionKernel::cost(int64_t item, int64_t kv_begin, int64_t kv_end) const {
  const int64_t blocks = num_q_blocks(problem_, tiles_);
  const int64_t kv_b = item / blocks;
  const QueryBlock block = query_block(problem_, tiles_, item % blocks);
  double pairs = 0;
  for (int64_t i = block.row0; i < block.row0 + block.rows; ++i) {
    const RowInterval interval = row_interval(problem_, kv_b, i);
    const int64_t lo = std::max(interval.lo, kv_begin), hi = std::min(interval.hi, kv_end);
    pairs += static_cast<double>(std::max<int64_t>(hi - lo, 0)) + kRowOverheadPairs;
  }
  return pairs * static_cast<double>(problem_.group);
}

const simd::NativeOps* AttentionKernel::native_ops() const {
  // bfloat16 inputs run on the native kernels where the policy says so (simd/native_ops.h).
  return problem_.dtype == DType::kBFloat16 ? simd::native_ops_for(ops_) : nullptr;
}

void AttentionKernel::reserve_scratch() const {
  const Problem& problem = problem_;
  if (num_items() == 0) return;
  // Query block 0 has the most rows; the KV batch with the longest section needs the widest
  // blocks, and the most sections and tiles bound every plan.
  int64_t widest = 0, sections = 0, tiles = 0;
  for (int64_t kv_b = 0; kv_b < problem.kv_batch; ++kv_b) {
    const int64_t section = section_length(problem, tiles_, kv_b);
    const int64_t n = ceil_div(problem.kv_total(kv_b), section);
    if (section > section_length(problem, tiles_, widest)) widest = kv_b;
    sections = std::max(sections, n);
    tiles = std::max(tiles, n * ceil_div(section, tiles_.kv_tile));
  }
  Scratch& scratch = thread_scratch();
  const ItemShape item = item_shape(problem, tiles_, widest, 0);
  const bool native = native_ops() != nullptr;
  ensure_scratch(problem, item, native, scratch);
  ensure(scratch.intervals, item.rows);
  ensure(scratch.sub_plans, item.sub_blocks);
  ensure(scratch.sub_cursor, item.sub_blocks);
  scratch.plan.tiles.reserve(tiles);
  scratch.plan.sections.reserve(sections);
  for (BlockPlan& plan : scratch.sub_plans) {
    plan.tiles.reserve(tiles);
    plan.sections.reserve(sections);
  }
  reserve_pack_buffers(problem, item.rows, tiles_.kv_tile, item.section, native, scratch);
  ensure(scratch.merged, problem.value_dim);
}

void AttentionKernel::run(int64_t item_index, int64_t kv_begin, int64_t kv_end,
                          float* partial) const {
  const Problem& problem = problem_;
  Scratch& scratch = thread_scratch();
  const int64_t blocks = num_q_blocks(problem, tiles_);
  const ItemShape item = item_shape(problem, tiles_, item_index / blocks, item_index % blocks);
  plan_item(problem, tiles_, item, kv_begin, kv_end, scratch);
  const simd::NativeOps* dot = native_ops();
  ensure_scratch(problem, item, dot != nullptr, scratch);

  // Q resident: every head's rows packed once; each head's state seeded with its sink (splits
  // leave the sink to the merge).
  const int64_t d = problem.head_dim, d2 = pair_dim(d);
  bool q_subnormal = false;
  for (int64_t h = 0; h < problem.group; ++h) {
    const int64_t b = item.kv_batch * problem.group + h;
    q_subnormal |= pack_q(problem, ops_, b, item.row0, item.rows, &scratch.q[h * item.rows * d],
                          dot ? &scratch.q2[h * item.rows * d2] : nullptr, scratch.convert);
    head_state(problem, scratch, item, h, 0, item.rows)
        .seed(sink_logit(problem, b, partial != nullptr));
  }
  // The native kernels would flush a subnormal query: such items widen.
  const simd::NativeOps* item_dot = q_subnormal ? nullptr : dot;
  // Each head's arithmetic is the same in any pass: packing a section gives the same blocks.
  const int64_t pass = heads_per_pass(problem, item);
  for (int64_t h0 = 0; h0 < problem.group; h0 += pass) {
    std::fill(scratch.sub_cursor.begin(), scratch.sub_cursor.begin() + item.sub_blocks, 0);
    for (const SectionWork& section : scratch.plan.sections) {
      const PackedSection packed = pack_section(problem, ops_, item_dot, item.kv_batch, section,
                                                item.ldk, item.ldv, scratch);
      attend_packed_section(problem, ops_, item, packed, item_dot != nullptr, h0,
                            std::min(problem.group, h0 + pass), scratch);
    }
  }

  const int64_t saved_floats = SoftmaxState::saved_row_floats(problem.value_dim);
  for (int64_t h = 0; h < problem.group; ++h) {
    SoftmaxState state = head_state(problem, scratch, item, h, 0, item.rows);
    for (int64_t r = 0; r < item.rows; ++r) {
      if (partial == nullptr) {
        write_row(problem, ops_, item.kv_batch * problem.group + h, item.row0 + r, state, r);
      } else {
        state.save(r, partial + (h * partial_rows() + r) * saved_floats);
      }
    }
  }
}

void AttentionKernel::merge(int64_t item, const float* partials, int64_t splits) const {
  const Problem& problem = problem_;
  const int64_t blocks = num_q_blocks(problem, tiles_), kv_b = item / blocks;
  const QueryBlock block = query_block(problem, tiles_, item % blocks);
  const int64_t saved_floats = SoftmaxState::saved_row_floats(problem.value_dim);
  std::vector<float>& o = thread_scratch().merged;
  ensure(o, static_cast<size_t>(problem.value_dim));
  float neg_max = 0, sum = 0, alpha = 0;
  SoftmaxState state(&neg_max, &sum, &alpha, o.data(), problem.value_dim, 1, problem.value_dim);
  for (int64_t h = 0; h < problem.group; ++h) {
    const int64_t b = kv_b * problem.group + h;
    for (int64_t r = 0; r < block.rows; ++r) {
      // The same recurrence as across sections, over the splits in order; the sink seeds it.
      state.seed(sink_logit(problem, b, false));
      for (int64_t split = 0; split < splits; ++split) {
        state.merge_saved(
            0, partials + split * partial_floats() + (h * partial_rows() + r) * saved_floats);
      }
      write_row(problem, ops_, b, block.row0 + r, state, 0);
    }
  }
}

void AttentionKernel::describe(PlanSummary* summary) const {
  const Problem& problem = problem_;
  PlanSummary& r = *summary;
  r.tiles = tiles_;
  r.q_blocks = num_q_blocks(problem, tiles_);
  r.kv_tiles = ceil_div(r.seqlen_kv, tiles_.kv_tile);
  r.sections = ceil_div(r.seqlen_kv, problem.kv_batch > 0 ? split_granule() : tiles_.section);
  const double pair_flops = 2.0 * static_cast<double>(problem.head_dim + problem.value_dim);
  for (int64_t kv_b = 0; kv_b < problem.kv_batch; ++kv_b) {
    for (int64_t qb = 0; qb < r.q_blocks; ++qb) {
      const BlockCounts c = count_block(problem, tiles_, kv_b, qb);
      r.tiles_full += c.tiles_full * problem.group;
      r.tiles_masked += c.tiles_masked * problem.group;
      r.tiles_skipped += c.tiles_skipped * problem.group;
      r.flops_done += pair_flops * static_cast<double>(c.pairs_computed * problem.group);
      r.flops_useful += pair_flops * static_cast<double>(c.pairs_useful * problem.group);
      const int64_t rows = query_block(problem, tiles_, qb).rows;
      r.flops_dense +=
          pair_flops * static_cast<double>(rows * problem.kv_total(kv_b) * problem.group);
    }
  }
}

}  // namespace flashcte::internal
