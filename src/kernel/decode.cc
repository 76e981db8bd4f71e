// The decode recurrence over one chunk of one (sequence, KV head) pair:
//
//   Q resident: the group's query heads x the T new tokens, one row each (row r = t * group + h,
//     so the rows of one token, which share their slot range, are consecutive), in float32;
//   for each block of kBlockSlots cache slots of the chunk:
//     S = scale * Q.K^T on the K rows in place (Ops::decode_qk), softcap;
//     per run of tokens with the same slot range in the block: row max, the online softmax in
//       SoftmaxState (softmax_state.h), P = exp(S - max) (Ops::exp_sum, rounded to bfloat16 for
//       bfloat16 inputs as in attention_cte), O = alpha O + P.V on the V rows in place
//       (Ops::decode_pv);
//   then either out = O / l (a pair with one chunk) or the unnormalized state parked for the
//   merge, which folds the chunks in order with SoftmaxState::merge.
//
// One call of run() computes a chunk of one pair or of several KV heads of a sequence (where the
// cache holds a slot's heads side by side: decode_schedule.cc), each with its own scratch, block
// by block with the heads in turn, so a block's stretch of memory is read in one go.
//
// bfloat16 inputs run on the native vdpbf16ps kernels where simd::native_ops_for says so (the
// policy attention_cte follows: AMD Zen 4/5 yes, Intel widens), with Q also packed as bfloat16;
// so does a bfloat16 q against 8-bit caches: fp8 codes convert exactly to bfloat16, and int8 ones
// run on integer dot products with Q and P quantized to int16 (decode_native-inl.h).
//
// A row only ever reads the scores, and P.V only the V rows, of the slots it attends: slots past
// a token's position (the later new tokens of a chunk) or before its window may hold anything,
// NaN included, without reaching its output. K and V are read where they are, converted in
// registers: a dense cache's rows by their stride, a paged cache's through a table of row
// addresses per chunk (KvSource::fill_rows), both through the same kernel code
// (simd/decode_rows.h), so their results are bitwise equal. A cache whose
// channel stride is not 1 is gathered one block at a time (in its own dtype, never widened)
// before the same kernels.
#include "src/kernel/decode.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "src/core/convert.h"
#include "src/core/kv8.h"
#include "src/core/math.h"
#include "src/kernel/output.h"
#include "src/kernel/scratch.h"
#include "src/kernel/softmax_state.h"
#include "src/simd/native_ops.h"

namespace flashcte::internal {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Chunk boundaries: every multiple of this many slots (a constant, so the split of a problem
// never depends on the thread count). Zen 4 EPYC, 2 threads, 32/8 heads, d = 128, bf16, 4096
// cached tokens (32 chunks of one call): 512 slots 19.1, 1024 23.0, 2048 23.0 GB/s (medians of 5
// interleaved cold runs, a loaded machine); 1024 keeps the chunks (8 KV heads x 4 per 4096
// tokens) plentiful for more threads, and a chunk still streams 256 KiB of K and of V per head
// against a merge of rows x (dv + 2) floats.
constexpr int64_t kChunkSlots = 1024;
// Slots per block: the scores of a block (rows x 64 floats) and its K and V rows (64 x 256 bytes
// each for bfloat16 at d = 128, 32 KiB of float32) stay in L1 / L2 between QK, the softmax and PV.
// Chosen, not measured against other sizes.
constexpr int64_t kBlockSlots = 64;
// The kernels prefetch ahead of their reads only, so every chunk would start its K and V streams
// on demand misses; this much of each is requested into L2 when a chunk starts. Same setup as
// kChunkSlots: 20.0 GB/s without, 23.0 with 8 KiB.
constexpr int64_t kStartPrefetchBytes = 8192;

// The geometry of one pair's rows in scratch, whether it runs on the native bfloat16 kernels
// (vdpbf16ps: bfloat16 inputs where simd::native_ops_for says so, as attention_cte), and how far
// ahead the kernels prefetch its K and V (further where an item reads several heads in turn).
struct PairShape {
  int64_t b, kv_head, rows, ldq, ldq2, lds, ldo, prefetch_bytes;
  const simd::NativeOps* native;  // the native kernels, or null
};

struct DecodeScratch {
  PairShape shape{};         // of the pair this scratch computes
  LineAligned<float> q;      // [rows][ldq] float32, zero past d
  LineAligned<uint16_t> q2;  // [rows][ldq2] bfloat16, zero past d (the native bfloat16 path)
  LineAligned<float> s;      // [rows][lds] scores, then probabilities
  LineAligned<float> o;      // [rows][ldo] accumulators
  LineAligned<float> neg_max, sum, alpha;
  std::vector<const void*> k_rows, v_rows;        // the chunk's row addresses (unit stride)
  std::vector<unsigned char> gather_k, gather_v;  // a block of K / V rows when not unit stride
  std::vector<const void*> gather_k_rows, gather_v_rows;
  std::vector<float> token_scale;  // a block's per-token scales
  std::vector<float> merged;       // one output row, merged from a pair's chunks
};

// This thread's scratch for `heads` pairs computed together (one per pair).
std::vector<DecodeScratch>& decode_scratch(int64_t heads) {
  static thread_local std::vector<DecodeScratch> scratch;
  if (scratch.size() < static_cast<size_t>(heads)) scratch.resize(static_cast<size_t>(heads));
  return scratch;
}

// Pair `pair` computed in an item of `heads` pairs.
PairShape pair_shape(const DecodeProblem& p, const simd::Ops& ops, int64_t pair, int64_t heads) {
  // A bfloat16 q against caches the native kernels read as they are: bfloat16, or 8-bit codes
  // (fp8 values are bfloat16 values; int8 runs on the integer kernels).
  const auto native_cache = [](DType t) { return t == DType::kBFloat16 || kv8::is_8bit(t); };
  const simd::NativeOps* native =
      p.dtype == DType::kBFloat16 && native_cache(p.k.dtype) && native_cache(p.v.dtype)
          ? simd::native_ops_for(ops)
          : nullptr;
  return {pair / p.kv_heads,
          pair % p.kv_heads,
          p.rows(),
          simd::padded(p.head_dim),
          round_up(p.head_dim, 32),
          simd::leading_dim(kBlockSlots),
          simd::padded(p.value_dim),
          heads > 1 ? simd::kDecodeHeadsTogetherPrefetchBytes : simd::kDecodePrefetchBytes,
          native};
}

void ensure_scratch(const PairShape& ps, DecodeScratch& sc) {
  ensure(sc.q, ps.rows * ps.ldq);
  if (ps.native) ensure(sc.q2, ps.rows * ps.ldq2);
  ensure(sc.s, ps.rows * ps.lds);
  ensure(sc.o, ps.rows * ps.ldo);
  for (LineAligned<float>* row_state : {&sc.neg_max, &sc.sum, &sc.alpha}) {
    ensure(*row_state, ps.rows);
  }
}

SoftmaxState pair_state(const DecodeProblem& p, const PairShape& ps, DecodeScratch& sc) {
  return SoftmaxState(sc.neg_max.data(), sc.sum.data(), sc.alpha.data(), sc.o.data(), ps.ldo,
                      ps.rows, p.value_dim);
}

// Query head of row r of the pair, and its token.
int64_t row_head(const DecodeProblem& p, const PairShape& ps, int64_t r) {
  return ps.kv_head * p.group + r % p.group;
}
int64_t row_token(const DecodeProblem& p, int64_t r) { return r / p.group; }

float sink_logit(const DecodeProblem& p, int64_t head) {
  return p.sink ? p.sink[head * p.sink_stride] : -kInf;
}

// Q rows of the pair in float32, zero past d (decode_qk reads whole vectors), and as bfloat16
// for the native kernels (exact: the inputs are bfloat16).
void pack_q(const DecodeProblem& p, const simd::Ops& ops, const PairShape& ps, float* q,
            uint16_t* q2) {
  const int64_t d = p.head_dim, elem = dtype_size(p.dtype);
  const auto& st = p.q_strides;
  for (int64_t r = 0; r < ps.rows; ++r) {
    const int64_t offset = ps.b * st[0] + row_head(p, ps, r) * st[1] + row_token(p, r) * st[2];
    float* dst = q + r * ps.ldq;
    if (st[3] == 1) {
      ops.to_float(static_cast<const unsigned char*>(p.q) + offset * elem, p.dtype, d, dst);
    } else {
      load_row_as_float(p.q, offset, st[3], p.dtype, dst, d);
    }
    std::fill(dst + d, dst + ps.ldq, 0.0f);
    if (!ps.native) continue;
    ops.narrow_bf16(dst, d, q2 + r * ps.ldq2);
    std::fill(q2 + r * ps.ldq2 + d, q2 + (r + 1) * ps.ldq2, uint16_t{0});
  }
}

// Fills the chunk's row tables of the paged caches read in place (unit channel stride); a dense
// cache's rows are addressed by their stride instead.
void fill_chunk_rows(const DecodeProblem& p, const PairShape& ps, const SlotRange& slots,
                     DecodeScratch& sc) {
  const size_t n = static_cast<size_t>(slots.hi - slots.lo);
  for (auto [src, rows] : {std::pair{&p.k, &sc.k_rows}, std::pair{&p.v, &sc.v_rows}}) {
    if (!src->paged() || src->strides[3] != 1) continue;
    if (rows->size() < n) rows->resize(n);
    src->fill_rows(ps.b, ps.kv_head, slots.lo, slots.hi, rows->data());
  }
}

// Rows [lo, hi) of the chunk `slots` of a cache, with the rest of the chunk to prefetch: read in
// place when the channel stride is 1 (by stride in a dense cache, through the chunk's table in a
// paged one), else gathered into `buffer` in their dtype, `channels` apart.
simd::DecodeRows block_rows(const KvSource& src, const PairShape& ps, const SlotRange& slots,
                            const std::vector<const void*>& chunk_rows, int64_t channels,
                            int64_t lo, int64_t hi, std::vector<unsigned char>& buffer,
                            std::vector<const void*>& buffer_rows) {
  if (src.strides[3] == 1) {
    if (src.paged())
      return simd::DecodeRows::of_table(chunk_rows.data() + (lo - slots.lo), slots.hi - lo,
                                        ps.prefetch_bytes);
    return simd::DecodeRows::strided(src.row(ps.b, ps.kv_head, lo),
                                     src.strides[2] * src.element_bytes(), slots.hi - lo,
                                     ps.prefetch_bytes);
  }
  const int64_t elem = src.element_bytes(), n = hi - lo;
  ensure(buffer, static_cast<size_t>(n * channels * elem));
  if (buffer_rows.size() < static_cast<size_t>(n)) buffer_rows.resize(static_cast<size_t>(n));
  for (int64_t j = lo; j < hi; ++j) {
    const unsigned char* row = src.row(ps.b, ps.kv_head, j);
    unsigned char* dst = &buffer[static_cast<size_t>((j - lo) * channels * elem)];
    for (int64_t x = 0; x < channels; ++x) {
      std::memcpy(dst + x * elem, row + x * src.strides[3] * elem, static_cast<size_t>(elem));
    }
    buffer_rows[j - lo] = dst;
  }
  return simd::DecodeRows::of_table(buffer_rows.data(), n, ps.prefetch_bytes);
}

// Multiplies columns [0, n) of rows [r0, r1) of `s` (lds apart) by the per-token scales of slots
// [lo, lo + n) of the pair: a per-token-scaled 8-bit cache's K scales on the scores, or its V
// scales on the probabilities.
void scale_columns(const simd::Ops& ops, const KvSource& scales, const PairShape& ps, int64_t lo,
                   int64_t n, float* s, int64_t lds, int64_t r0, int64_t r1,
                   std::vector<float>& buffer) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    buffer[i] = *reinterpret_cast<const float*>(scales.row(ps.b, ps.kv_head, lo + i));
  }
  for (int64_t r = r0; r < r1; ++r) ops.mul(s + r * lds, buffer.data(), n);
}

// The slots of the block [j0, j1) row range `slots` leaves, relative to j0 (empty: lo >= hi).
SlotRange clip(const SlotRange& slots, int64_t j0, int64_t j1) {
  return {std::max(slots.lo, j0) - j0, std::min(slots.hi, j1) - j0};
}

// One block of slots [j0, j1) of the chunk `slots` for every row of the pair.
void attend_block(const DecodeKernel& kernel, const simd::Ops& ops, const PairShape& ps,
                  const SlotRange& slots, int64_t j0, int64_t j1, DecodeScratch& sc,
                  SoftmaxState& state) {
  const DecodeProblem& p = kernel.problem();
  // The union of the tokens' ranges in the block: QK computes it for every row.
  SlotRange all{j1 - j0, 0};
  for (int64_t t = 0; t < p.tokens; ++t) {
    const SlotRange c = clip(kernel.row_slots(ps.b, t), j0, j1);
    if (c.lo < c.hi) all = {std::min(all.lo, c.lo), std::max(all.hi, c.hi)};
  }
  if (all.lo >= all.hi) return;
  const simd::DecodeRows k = block_rows(p.k, ps, slots, sc.k_rows, p.head_dim, j0 + all.lo,
                                        j0 + all.hi, sc.gather_k, sc.gather_k_rows);
  const float scale = p.k_scale.empty() ? p.scale : p.scale * p.k_scale[ps.kv_head];
  if (ps.native) {
    ps.native->decode_qk(sc.q2.data(), ps.ldq2, ps.rows, k, p.k.dtype, all.hi - all.lo, p.head_dim,
                         scale, sc.s.data(), ps.lds);
  } else {
    ops.decode_qk(sc.q.data(), ps.ldq, ps.rows, k, p.k.dtype, all.hi - all.lo, p.head_dim, scale,
                  sc.s.data(), ps.lds);
  }
  if (p.k_token_scale.data) {
    scale_columns(ops, p.k_token_scale, ps, j0 + all.lo, all.hi - all.lo, sc.s.data(), ps.lds, 0,
                  ps.rows, sc.token_scale);
  }

  // bfloat16 inputs round P to bfloat16 before P.V, as attention_cte; an 8-bit V keeps it float
  // here (the native kernel packs P, times a per-token scale, once per 64 keys: rounded to
  // bfloat16 for an fp8 V, quantized to int16 for an int8 V).
  const bool round_p = p.v.dtype == DType::kBFloat16;
  for (int64_t t0 = 0; t0 < p.tokens;) {
    // A run of tokens [t0, t1) with the same range in the block: their rows are consecutive.
    const SlotRange c = clip(kernel.row_slots(ps.b, t0), j0, j1);
    int64_t t1 = t0 + 1;
    while (t1 < p.tokens) {
      const SlotRange next = clip(kernel.row_slots(ps.b, t1), j0, j1);
      if (next.lo != c.lo || next.hi != c.hi) break;
      ++t1;
    }
    const int64_t r0 = t0 * p.group, r1 = t1 * p.group;
    t0 = t1;
    if (c.lo >= c.hi) continue;  // nothing attended: the state stays as it is
    const int64_t col = c.lo - all.lo, n = c.hi - c.lo;
    for (int64_t r = r0; r < r1; ++r) {
      float* srow = sc.s.data() + r * ps.lds + col;
      if (p.softcap > 0.0f) ops.softcap(srow, n, p.softcap);
      if (p.alibi) {
        const int64_t head = row_head(p, ps, r);
        const float slope = p.alibi[ps.b * p.alibi_strides[0] + head * p.alibi_strides[1]];
        const int64_t first = j0 + c.lo;  // the slot of srow[0]
        const int64_t diagonal = p.diagonal[ps.b * p.tokens + row_token(p, r)];
        ops.alibi(srow, n, slope, static_cast<float>(first - diagonal));
      }
      const float bias = state.rescale(r, ops.row_max(srow, n));
      state.add_to_sum(r, ops.exp_sum(srow, n, bias, round_p));
    }
    const simd::DecodeRows v = block_rows(p.v, ps, slots, sc.v_rows, p.value_dim, j0 + c.lo,
                                          j0 + c.hi, sc.gather_v, sc.gather_v_rows);
    float* prow = sc.s.data() + r0 * ps.lds + col;
    if (p.v_token_scale.data) {
      scale_columns(ops, p.v_token_scale, ps, j0 + c.lo, n, prow, ps.lds, 0, r1 - r0,
                    sc.token_scale);
    }
    if (ps.native) {
      ps.native->decode_pv(prow, ps.lds, r1 - r0, n, v, p.v.dtype, p.value_dim, state.alpha() + r0,
                           state.o(r0), ps.ldo);
    } else {
      ops.decode_pv(prow, ps.lds, r1 - r0, n, v, p.v.dtype, p.value_dim, state.alpha() + r0,
                    state.o(r0), ps.ldo);
    }
  }
}

// The first kStartPrefetchBytes of the chunk's K and V streams, into L2: the kernels prefetch
// only ahead of where they read, so each chunk would start on demand misses.
void prefetch_start(const DecodeProblem& p, const PairShape& ps, const SlotRange& slots,
                    DecodeScratch& sc) {
  for (auto [src, rows, channels] :
       {std::tuple{&p.k, &sc.k_rows, p.head_dim}, std::tuple{&p.v, &sc.v_rows, p.value_dim}}) {
    if (src->strides[3] != 1) continue;
    const int64_t row_bytes = channels * src->element_bytes();
    const int64_t n =
        std::min(slots.hi - slots.lo, std::max<int64_t>(1, kStartPrefetchBytes / row_bytes));
    const simd::DecodeRows in_place = block_rows(*src, ps, slots, *rows, channels, slots.lo,
                                                 slots.lo + n, sc.gather_k, sc.gather_k_rows);
    for (int64_t j = 0; j < n; ++j) {
      const auto* row = static_cast<const char*>(in_place.address(j));
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
    }
  }
}

// Normalizes row r of `state` and writes it as (b, head, token) of out and lse.
void write_row(const DecodeProblem& p, const simd::Ops& ops, int64_t b, int64_t head, int64_t t,
               SoftmaxState& state, int64_t r) {
  const SoftmaxState::Stats stats = state.finish(r);
  if (!p.v_scale.empty()) {  // an 8-bit V: the rows summed its codes
    const float scale = p.v_scale[head / p.group];
    float* o = state.o(r);
    for (int64_t x = 0; x < p.value_dim; ++x) o[x] *= scale;
  }
  const auto& st = p.out_strides;
  store_output_row(ops, p.out, b * st[0] + head * st[1] + t * st[2], st[3], p.dtype, state.o(r),
                   p.value_dim);
  if (p.lse) {
    p.lse[b * p.lse_strides[0] + head * p.lse_strides[1] + t * p.lse_strides[2]] = stats.lse;
  }
}

}  // namespace

DecodeKernel::DecodeKernel(const DecodeProblem& problem)
    : problem_(problem), ops_(simd::ops()), sequence_slots_(problem.batch) {
  for (int64_t b = 0; b < problem.batch; ++b) {
    SlotRange all{problem.max_len, 0};
    for (int64_t t = 0; t < problem.tokens; ++t) {
      const SlotRange r = row_slots(b, t);
      if (r.lo < r.hi) all = {std::min(all.lo, r.lo), std::max(all.hi, r.hi)};
    }
    sequence_slots_[b] = all.lo < all.hi ? all : SlotRange{0, 0};
  }
}

int64_t DecodeKernel::chunk_length() const { return kChunkSlots; }

int64_t DecodeKernel::num_chunks(int64_t b) const {
  const SlotRange& s = sequence_slots_[b];
  if (s.lo >= s.hi) return 0;
  return (s.hi - 1) / kChunkSlots - s.lo / kChunkSlots + 1;
}

SlotRange DecodeKernel::chunk_slots(int64_t b, int64_t chunk) const {
  const SlotRange& s = sequence_slots_[b];
  const int64_t begin = (s.lo / kChunkSlots + chunk) * kChunkSlots;
  return {std::max(s.lo, begin), std::min(s.hi, begin + kChunkSlots)};
}

int64_t DecodeKernel::partial_floats() const {
  return problem_.rows() * SoftmaxState::saved_row_floats(problem_.value_dim);
}

void DecodeKernel::reserve_scratch(int64_t heads) const {
  const DecodeProblem& p = problem_;
  if (num_pairs() == 0) return;
  heads = std::max<int64_t>(heads, 1);  // a merge uses the first head's scratch
  std::vector<DecodeScratch>& scratch = decode_scratch(heads);
  // Every pair has the same rows and leading dimensions; a chunk has at most kChunkSlots slots
  // and a block (what gathers and per-token scales hold) at most kBlockSlots.
  const PairShape ps = pair_shape(p, ops_, 0, heads);
  const auto chunk = static_cast<size_t>(std::min(kChunkSlots, p.max_len));
  for (int64_t h = 0; h < heads; ++h) {
    DecodeScratch& sc = scratch[static_cast<size_t>(h)];
    ensure_scratch(ps, sc);
    for (auto [src, rows, gather, gather_rows, channels] :
         {std::tuple{&p.k, &sc.k_rows, &sc.gather_k, &sc.gather_k_rows, p.head_dim},
          std::tuple{&p.v, &sc.v_rows, &sc.gather_v, &sc.gather_v_rows, p.value_dim}}) {
      if (src->strides[3] == 1) {
        if (src->paged()) ensure(*rows, chunk);
        continue;
      }
      ensure(*gather, static_cast<size_t>(kBlockSlots * channels * src->element_bytes()));
      ensure(*gather_rows, static_cast<size_t>(kBlockSlots));
    }
    if (p.k_token_scale.data || p.v_token_scale.data) ensure(sc.token_scale, kBlockSlots);
  }
  ensure(scratch[0].merged, static_cast<size_t>(p.value_dim));
}

void DecodeKernel::run(int64_t pair, int64_t heads, int64_t chunk, float* partial) const {
  const DecodeProblem& p = problem_;
  std::vector<DecodeScratch>& scratch = decode_scratch(heads);
  const int64_t b = pair / p.kv_heads;
  const SlotRange slots = chunk_slots(b, chunk);
  for (int64_t h = 0; h < heads; ++h) {
    DecodeScratch& sc = scratch[static_cast<size_t>(h)];
    sc.shape = pair_shape(p, ops_, pair + h, heads);
    const PairShape& ps = sc.shape;
    ensure_scratch(ps, sc);
    pack_q(p, ops_, ps, sc.q.data(), sc.q2.data());
    // Each row starts from its head's sink; a chunk of a split pair leaves the sink to the merge.
    for (int64_t r = 0; r < ps.rows; ++r) {
      SoftmaxState row(&sc.neg_max[r], &sc.sum[r], &sc.alpha[r], sc.o.data() + r * ps.ldo, ps.ldo,
                       1, p.value_dim);
      row.seed(partial ? -kInf : sink_logit(p, row_head(p, ps, r)));
    }
    fill_chunk_rows(p, ps, slots, sc);
    if (kStartPrefetchBytes > 0) prefetch_start(p, ps, slots, sc);
  }
  // Block by block, the heads one after another within a block: where they lie side by side in
  // a slot, the block's stretch of memory is read in one go (decode_schedule.cc).
  for (int64_t j0 = slots.lo; j0 < slots.hi; j0 += kBlockSlots) {
    for (int64_t h = 0; h < heads; ++h) {
      DecodeScratch& sc = scratch[static_cast<size_t>(h)];
      SoftmaxState state = pair_state(p, sc.shape, sc);
      attend_block(*this, ops_, sc.shape, slots, j0, std::min(j0 + kBlockSlots, slots.hi), sc,
                   state);
    }
  }
  const int64_t saved = SoftmaxState::saved_row_floats(p.value_dim);
  for (int64_t h = 0; h < heads; ++h) {
    DecodeScratch& sc = scratch[static_cast<size_t>(h)];
    const PairShape& ps = sc.shape;
    SoftmaxState state = pair_state(p, ps, sc);
    // The pairs' partials lie pair by pair, each pair's chunks consecutive.
    float* head_partial = partial ? partial + h * num_chunks(b) * partial_floats() : nullptr;
    for (int64_t r = 0; r < ps.rows; ++r) {
      if (head_partial) {
        state.save(r, head_partial + r * saved);
      } else {
        write_row(p, ops_, ps.b, row_head(p, ps, r), row_token(p, r), state, r);
      }
    }
  }
}

void DecodeKernel::merge(int64_t pair, const float* partials) const {
  const DecodeProblem& p = problem_;
  const PairShape ps = pair_shape(p, ops_, pair, 1);
  const int64_t chunks = num_chunks(ps.b), saved = SoftmaxState::saved_row_floats(p.value_dim);
  std::vector<float>& o = decode_scratch(1)[0].merged;
  ensure(o, static_cast<size_t>(p.value_dim));
  float neg_max = 0, sum = 0, alpha = 0;
  SoftmaxState state(&neg_max, &sum, &alpha, o.data(), p.value_dim, 1, p.value_dim);
  for (int64_t r = 0; r < ps.rows; ++r) {
    const int64_t head = row_head(p, ps, r);
    // The recurrence across chunks, in chunk order, from the sink.
    state.seed(sink_logit(p, head));
    for (int64_t c = 0; c < chunks; ++c) {
      state.merge_saved(0, partials + c * partial_floats() + r * saved);
    }
    write_row(p, ops_, ps.b, head, row_token(p, r), state, 0);
  }
}

}  // namespace flashcte::internal
