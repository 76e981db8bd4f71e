// Per-thread scratch of the attention kernel: the packed blocks, scores, accumulators and plans
// of one work item, kept across calls so that the hot path allocates nothing once warm. Before a
// call writes its first row, every thread of it sizes its scratch for the call's largest item
// (AttentionKernel::reserve_scratch): a call short of memory fails before it has written
// anything.
#ifndef FLASHCTE_SRC_KERNEL_SCRATCH_H_
#define FLASHCTE_SRC_KERNEL_SCRATCH_H_

#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "src/core/math.h"
#include "src/kernel/plan.h"

namespace flashcte::internal {

// Elements on 64-byte cache lines. The micro-kernels load 64-byte rows of K, V, S and O (leading
// dimensions are multiples of 16 floats); from std::vector, whose large blocks start 16 bytes
// into a page, every such row straddled two lines.
template <class T>
class LineAligned {
 public:
  T* data() { return data_.get(); }
  T& operator[](size_t i) { return data_.get()[i]; }
  // At least n elements; the contents are not kept when it grows. Throws std::bad_alloc.
  void ensure(size_t n) {
    if (n <= size_) return;
    const auto bytes = static_cast<size_t>(round_up(static_cast<int64_t>(n * sizeof(T)), kLine));
    data_.reset(static_cast<T*>(::operator new(bytes, kAlign)));
    size_ = n;
  }

 private:
  static constexpr int64_t kLine = 64;
  static constexpr std::align_val_t kAlign{kLine};
  struct Free {
    void operator()(T* p) const { ::operator delete(p, kAlign); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0;
};

template <class T>
void ensure(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}
template <class T>
void ensure(LineAligned<T>& v, size_t n) {
  v.ensure(n);
}

struct Scratch {
  LineAligned<float> q;  // [group][q_block][d]  scaled
  LineAligned<float> k;  // [d][ldk]             one section of K, transposed
  LineAligned<float> v;  // [section][ldv]       one section of V
  LineAligned<float> s;  // [sub-block][lds]     scores / probabilities of one head
  LineAligned<float> o;  // [group][q_block][ldo]
  // The softmax state's rows (SoftmaxState): [group][q_block] each.
  LineAligned<float> neg_max, sum, alpha;
  // The native bfloat16 path (simd/native_ops.h): the same blocks as bfloat16 pairs.
  LineAligned<uint16_t> q2;  // [group][q_block][d2]  unscaled
  LineAligned<uint32_t> k2;  // [d2 / 2][ldk]
  LineAligned<uint32_t> v2;  // [section / 2 + 1][ldv]
  LineAligned<uint16_t> p2;  // [sub-block][lds]
  // An 8-bit prior on the native path: each section column's K and V scale (1 past the prior).
  std::vector<float> k_col_scale, v_col_scale;
  std::vector<float> convert;  // rows or columns being converted (pack.h)
  // A paged or 8-bit prior's rows of one tile: their addresses and their scales.
  std::vector<const unsigned char*> prior_rows;
  std::vector<float> prior_scales;
  std::vector<float> merged;  // one output row, merged from a split item's partial states
  std::vector<RowInterval> intervals;
  BlockPlan plan;                    // the whole work item: what gets packed
  std::vector<BlockPlan> sub_plans;  // each sub-block: what it computes
  std::vector<size_t> sub_cursor;    // next section of each sub-block
};

// This thread's scratch.
Scratch& thread_scratch();

}  // namespace flashcte::internal

#endif  // FLASHCTE_SRC_KERNEL_SCRATCH_H_
