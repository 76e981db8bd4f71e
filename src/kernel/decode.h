// The decode kernel as the schedule sees it (include/flashcte/decode.h): the validated problem,
// cut into (sequence, KV head) pairs whose query rows (every query head of the KV head's group,
// times the T new tokens) are computed together, so each cached K and V row is read once per
// call. A pair's key range is cut into chunks whose boundaries are multiples of chunk_length(),
// a constant of the kernel: they depend on the problem only, never on the thread count. A pair
// with one chunk is computed and written in one go; a pair with several parks one partial
// softmax state per chunk, and merge() folds them in chunk order.
#ifndef FLASHCTE_SRC_KERNEL_DECODE_H_
#define FLASHCTE_SRC_KERNEL_DECODE_H_

#include <array>
#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/kv_source.h"
#include "src/simd/ops.h"

namespace flashcte::internal {

// The cache slots [lo, hi) one query row attends (empty when lo >= hi).
struct SlotRange {
  int64_t lo = 0, hi = 0;
};

// The validated, normalized form of one decode call (filled by the dispatch layer from
// decode_attention's positions and window, or from flash_attn_with_kvcache's lengths, causal
// alignment, window and left padding). Strides are in elements; axes are (batch, head, token or
// slot, channel).
struct DecodeProblem {
  DType dtype = DType::kFloat32;  // of q and out (and of the caches, unless they are 8-bit)
  int64_t batch = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t group = 1;     // q_heads / kv_heads
  int64_t tokens = 0;    // T, new tokens per sequence
  int64_t max_len = 0;   // cache slots per sequence (paged: pages per sequence x block size)
  int64_t head_dim = 0;  // d
  int64_t value_dim = 0;
  const void* q = nullptr;
  std::array<int64_t, 4> q_strides{};
  KvSource k, v;  // dense or paged; slots [0, max_len) of each sequence
  // 8-bit caches: element c of KV head h stands for c * k_scale[h] (v_scale[h]); empty for the
  // float caches and with per-token scales. QK folds k_scale into the score scale and the output
  // row takes v_scale, so the kernels read the raw codes.
  std::vector<float> k_scale, v_scale;
  // Per-token scales (data == null: none): float32 sources laid out as the caches without their
  // channel axis (same sequences, heads, slots and pages; strides[3] unused). Slot j's K scale
  // multiplies its scores, its V scale its probabilities before P.V.
  KvSource k_token_scale, v_token_scale;
  void* out = nullptr;
  std::array<int64_t, 4> out_strides{};
  float* lse = nullptr;  // null: not requested
  std::array<int64_t, 3> lse_strides{};
  std::vector<SlotRange> slots;  // [batch][tokens]: the slots token t of sequence b attends
  const float* sink = nullptr;   // per query head, or null
  int64_t sink_stride = 0;
  float scale = 1.0f;
  float softcap = 0.0f;
  // ALiBi: score -= slope(b, head) * |j - diagonal[b][t]| for slot j, after softcap.
  const float* alibi = nullptr;  // slope(b, h) = alibi[b * alibi_strides[0] + h * [1]], or null
  std::array<int64_t, 2> alibi_strides{};
  std::vector<int64_t> diagonal;  // [batch][tokens], with alibi
  int threads = 0;

  SlotRange row_slots(int64_t b, int64_t t) const { return slots[b * tokens + t]; }
  int64_t rows() const { return group * tokens; }
};

class DecodeKernel {
 public:
  explicit DecodeKernel(const DecodeProblem& problem);  // must outlive the kernel

  const DecodeProblem& problem() const { return problem_; }
  // Pairs are numbered b * kv_heads + kv_head.
  int64_t num_pairs() const { return problem_.batch * problem_.kv_heads; }
  // The slots token t of sequence b attends, and their union over the tokens of b.
  SlotRange row_slots(int64_t b, int64_t t) const { return problem_.row_slots(b, t); }
  SlotRange sequence_slots(int64_t b) const { return sequence_slots_[b]; }
  // Chunk boundaries are the multiples of this many slots.
  int64_t chunk_length() const;
  // The chunks of sequence b (the same for each of its KV heads); chunk c covers slots
  // [first_chunk(b) + c) * chunk_length(), ...) clipped to sequence_slots(b).
  int64_t num_chunks(int64_t b) const;
  SlotRange chunk_slots(int64_t b, int64_t chunk) const;

  // Computes chunk `chunk` of the pairs [pair, pair + heads) (KV heads of one sequence), block
  // by block with the heads one after another in each block. With `partial` null (only when the
  // sequence has one chunk) the rows are finished and written; otherwise each pair's unnormalized
  // state of the chunk goes to its partial (partial_floats() floats) for merge(): the first
  // pair's at `partial`, the next ones num_chunks() partials apart (pair by pair, chunk by
  // chunk). Uses this thread's scratch.
  void run(int64_t pair, int64_t heads, int64_t chunk, float* partial) const;
  int64_t partial_floats() const;
  // Sizes this thread's scratch for every item of up to `heads` pairs and every merge, so that
  // run() and merge() allocate nothing: called by each thread of a call before any of them writes
  // a row.
  void reserve_scratch(int64_t heads) const;
  // Folds the num_chunks partials of `pair` (stored consecutively) in chunk order, from the
  // sink, and writes the rows.
  void merge(int64_t pair, const float* partials) const;

 private:
  const DecodeProblem& problem_;
  const simd::Ops& ops_;
  std::vector<SlotRange> sequence_slots_;
};

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_DECODE_H_
