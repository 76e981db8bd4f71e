// The online-softmax state of the flash recurrence, per query row, and its named operations.
// Every place that updates (neg_max, sum, O) goes through this type: the section recurrence
// (section.cc), the KV-split merge (attention.cc), the decode kernel and the merge of finished
// results, merge_attn_states (src/dispatch/merge_api.cc).
//
// Per row, after the keys seen so far, with scores S_j and values V_j:
//   neg_max  m = -max_j S_j               negated, as on Neuron: exp(S + m) needs no subtract
//   sum      l = sum_j exp(S_j + m)
//   O          = sum_j exp(S_j + m) V_j    unnormalized, dv floats
// A sink is one more score (the sink logit) whose value is zero: seed() starts from it.
//
// rescale  a new block of scores with row max x: m' = min(m, -x), alpha = exp(m' - m);
//          the block's P = exp(S + m') (the returned bias), l = alpha l + sum(P) (add_to_sum),
//          O = alpha O + P.V (MM2 reads alpha(), folded into its first tile)
// merge    a partial state (m_b, l_b, O_b) of other keys: m' = min(m, m_b),
//          alpha = exp(m' - m), beta = exp(m' - m_b), l = alpha l + beta l_b, O likewise
// finish   out = O * (1 / l): one reciprocal per row; lse = -m + log(l)
// normalized state  what finish() leaves, (out, lse), is the state (m = -lse, l = 1, O = out):
//          exp(S_j - lse) sums to 1 over its keys. merge_normalized() merges it through merge(),
//          so merging finished results (merge_attn_states, include/flashcte/merge.h) is the same
//          recurrence as the kernel's KV-split merge; lse = -inf is the empty state (l = 0).
// An empty state (no key, no sink) has m = +inf and l = 0; alpha is then 0, so whatever O held
// is dropped, and finish() gives the documented empty row (out 0, lse -inf).
//
// Cost: rescale and add_to_sum are O(1) per row and block, merge and finish O(dv) per row; the
// block they follow costs O(keys x (d + dv)) per row. Bytes per FLOP: finish reads and writes the
// 4 dv bytes of O once per row against the 2 (d + dv) FLOP of each of its keys, so it is
// negligible past a few dozen keys; merge is the same per KV split.
#ifndef FLASHCTE_SRC_KERNEL_SOFTMAX_STATE_H_
#define FLASHCTE_SRC_KERNEL_SOFTMAX_STATE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace flashcte::internal {

// A view of `rows` rows of state: neg_max[rows], sum[rows], alpha[rows] and O [rows][ldo]
// (value_dim floats used per row). The storage belongs to the caller (per-thread scratch).
class SoftmaxState {
 public:
  // What finish() leaves for a row besides its normalized O.
  struct Stats {
    float neg_max, sum_recip, lse;
  };

  SoftmaxState(float* neg_max, float* sum, float* alpha, float* o, int64_t ldo, int64_t rows,
               int64_t value_dim)
      : neg_max_(neg_max),
        sum_(sum),
        alpha_(alpha),
        o_(o),
        ldo_(ldo),
        rows_(rows),
        value_dim_(value_dim) {}

  int64_t rows() const { return rows_; }
  float* o(int64_t r) const { return o_ + r * ldo_; }
  float* o() const { return o_; }
  int64_t ldo() const { return ldo_; }
  // The factor of each row's O and sum set by the last rescale(), for MM2 to fold in.
  float* alpha() const { return alpha_; }
  float neg_max(int64_t r) const { return neg_max_[r]; }
  float sum(int64_t r) const { return sum_[r]; }

  // Every row starts from the sink: a score of logit `sink` with no value, so the max is the
  // sink and it contributes exp(sink - sink) = 1 to the sum. A sink of -inf is no sink. O is
  // cleared over the whole row stride (MM2 writes its padding columns too).
  void seed(float sink) {
    std::fill(neg_max_, neg_max_ + rows_, -sink);
    std::fill(sum_, sum_ + rows_, sink == -kInf ? 0.0f : 1.0f);
    std::fill(o_, o_ + rows_ * ldo_, 0.0f);
  }

  // Row r's next block of scores has maximum `block_max` (-inf: nothing unmasked in it). Moves
  // the running max, sets alpha(r) and returns the bias of the block's exp: P = exp(S + bias).
  // `block_max` may alias alpha()[r].
  float rescale(int64_t r, float block_max) {
    const float neg_new = std::min(neg_max_[r], -block_max);
    alpha_[r] = neg_max_[r] == kInf ? 0.0f : std::exp(neg_new - neg_max_[r]);
    neg_max_[r] = neg_new;
    // A row with nothing unmasked yet keeps bias 0 so that exp(-inf + 0) = 0, not NaN.
    return neg_new == kInf ? 0.0f : neg_new;
  }

  // After rescale(r): l = alpha l + sum(P) of the block.
  void add_to_sum(int64_t r, float block_sum) { sum_[r] = alpha_[r] * sum_[r] + block_sum; }

  // Folds in the state (o_b, neg_max_b, sum_b) of row r over other keys; a partial that saw no
  // key of the row (sum_b == 0) changes nothing.
  void merge(int64_t r, const float* o_b, float neg_max_b, float sum_b) {
    if (sum_b == 0.0f) return;
    const float neg_new = std::min(neg_max_[r], neg_max_b);
    const float alpha = neg_max_[r] == kInf ? 0.0f : std::exp(neg_new - neg_max_[r]);
    const float beta = std::exp(neg_new - neg_max_b);
    float* o = o_ + r * ldo_;
    for (int64_t c = 0; c < value_dim_; ++c) o[c] = alpha * o[c] + beta * o_b[c];
    sum_[r] = alpha * sum_[r] + beta * sum_b;
    neg_max_[r] = neg_new;
  }

  // Folds in row r of a normalized state over other keys, as finish() leaves one: out o_b and
  // lse_b, i.e. the state (neg_max = -lse_b, sum = 1, O = o_b); lse_b = -inf is a state that saw
  // no key (sum 0, o_b unread). A NaN lse_b gives NaN (beta is NaN), as does +inf: neither is a
  // state finish() produces.
  void merge_normalized(int64_t r, const float* o_b, float lse_b) {
    merge(r, o_b, -lse_b, lse_b == -kInf ? 0.0f : 1.0f);
  }

  // A KV split parks its rows as saved rows (O, then neg_max and sum) until the merge.
  static int64_t saved_row_floats(int64_t value_dim) { return value_dim + 2; }
  void save(int64_t r, float* dst) const {
    std::copy(o_ + r * ldo_, o_ + r * ldo_ + value_dim_, dst);
    dst[value_dim_] = neg_max_[r];
    dst[value_dim_ + 1] = sum_[r];
  }
  void merge_saved(int64_t r, const float* saved) {
    merge(r, saved, saved[value_dim_], saved[value_dim_ + 1]);
  }

  // Normalizes row r's O in place and returns its statistics. Empty only when the sum is exactly
  // 0: a NaN sum (a NaN or Inf among the row's scores or values) must come out as NaN, not as an
  // empty row.
  Stats finish(int64_t r) {
    float* o = o_ + r * ldo_;
    if (sum_[r] != 0.0f) {
      const float sum_recip = 1.0f / sum_[r];
      for (int64_t c = 0; c < value_dim_; ++c) o[c] *= sum_recip;
      return {neg_max_[r], sum_recip, -neg_max_[r] + std::log(sum_[r])};
    }
    // No key and no sink: the documented empty-row result.
    std::fill(o, o + value_dim_, 0.0f);
    return {kInf, kInf, -kInf};
  }

 private:
  static constexpr float kInf = std::numeric_limits<float>::infinity();
  float* neg_max_;
  float* sum_;
  float* alpha_;
  float* o_;
  int64_t ldo_;
  int64_t rows_;
  int64_t value_dim_;
};

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_SOFTMAX_STATE_H_
