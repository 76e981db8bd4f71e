#include "src/schedule/region.h"

#include <algorithm>

#include "src/schedule/decode_schedule.h"
#include "src/schedule/schedule.h"

namespace flashcte::internal {
namespace {

// Cost units: estimated nanoseconds on one thread, from the rates of a Zen 5 EPYC (2 threads,
// d = 128): attention_cte's prefill 197 (float32) to 311 (bfloat16) GFLOP/s per thread, the decode
// kernel's streaming 15-25 GB/s per thread. They only order the items (the hand-out is dynamic),
// so one figure between the two dtypes serves.
constexpr double kPrefillFlopsPerNs = 250.0;
constexpr double kDecodeBytesPerNs = 20.0;

// One item of one kernel: a prefill work item or a decode chunk.
struct RegionItem {
  bool decode = false;
  size_t kernel = 0;
  size_t index = 0;  // into that kernel's item list
  double ns = 0;     // estimated time
};

// One prefill kernel and its work: its items and their partial states.
struct PrefillWork {
  AttentionKernel kernel;
  std::vector<WorkItem> items;
  int64_t splits = 1;
  std::vector<float> partials;
};

// One decode kernel and its work: its chunks, their partial states and the pairs to merge.
struct DecodeWork {
  DecodeKernel kernel;
  std::vector<DecodeItem> items;
  std::vector<float> partials;
  std::vector<DecodeItem> merges;
  int64_t max_heads = 1;  // the most pairs an item computes together
};

PrefillWork prefill_work(const Problem& problem) {
  PrefillWork w{AttentionKernel(problem), {}, 1, {}};
  const AttentionKernel& kernel = w.kernel;
  w.items = make_work_items(kernel);
  w.splits = kv_splits(kernel);
  if (w.splits > 1) {
    w.partials.resize(static_cast<size_t>(kernel.num_items() * w.splits * kernel.partial_floats()));
  }
  return w;
}

DecodeWork decode_work(const DecodeProblem& problem) {
  DecodeWork w{DecodeKernel(problem), {}, {}, {}, 1};
  const DecodeKernel& kernel = w.kernel;
  int64_t partials = 0;
  w.items = make_decode_items(kernel, &partials);
  for (const DecodeItem& it : w.items) w.max_heads = std::max(w.max_heads, it.heads);
  w.partials.resize(static_cast<size_t>(partials * kernel.partial_floats()));
  for (const DecodeItem& it : w.items) {
    if (it.chunk != 0 || it.partial < 0) continue;
    const int64_t chunks = kernel.num_chunks(it.pair / kernel.problem().kv_heads);
    for (int64_t h = 0; h < it.heads; ++h) {
      w.merges.push_back({it.pair + h, 1, 0, it.partial + h * chunks});
    }
  }
  // A pair none of whose rows attends a slot has no chunk: the merge of its no partials writes
  // its rows (0, or the sink's share).
  const int64_t kv_heads = kernel.problem().kv_heads;
  for (int64_t pair = 0; pair < kernel.num_pairs(); ++pair) {
    if (kernel.num_chunks(pair / kv_heads) == 0) w.merges.push_back({pair, 1, 0, 0});
  }
  return w;
}

double prefill_ns(const AttentionKernel& kernel, const WorkItem& it) {
  const Problem& p = kernel.problem();
  return it.cost * 2.0 * static_cast<double>(p.head_dim + p.value_dim) / kPrefillFlopsPerNs;
}

double decode_ns(const DecodeKernel& kernel, const DecodeItem& it) {
  const DecodeProblem& p = kernel.problem();
  const SlotRange s = kernel.chunk_slots(it.pair / p.kv_heads, it.chunk);
  const auto slots = static_cast<double>(s.hi - s.lo);
  const auto channels = static_cast<double>(p.head_dim + p.value_dim);
  return static_cast<double>(it.heads) *
         (slots * channels * dtype_size(p.dtype) / kDecodeBytesPerNs +
          slots * static_cast<double>(p.rows()) * 2.0 * channels / kPrefillFlopsPerNs);
}

}  // namespace

void run_kernels(const std::vector<Problem>& prefill, const std::vector<DecodeProblem>& decode,
                 int threads, ThreadProfile* profile) {
  std::vector<PrefillWork> prefill_works;
  std::vector<DecodeWork> decode_works;
  prefill_works.reserve(prefill.size());
  decode_works.reserve(decode.size());
  std::vector<RegionItem> items;
  // The merges, in kernel order: (decode, kernel, index into its merge list or prefill item).
  std::vector<RegionItem> merges;
  for (size_t k = 0; k < prefill.size(); ++k) {
    prefill_works.push_back(prefill_work(prefill[k]));
    const PrefillWork& w = prefill_works.back();
    for (size_t i = 0; i < w.items.size(); ++i) {
      items.push_back({false, k, i, prefill_ns(w.kernel, w.items[i])});
    }
    if (w.splits > 1) {
      for (int64_t i = 0; i < w.kernel.num_items(); ++i) {
        merges.push_back({false, k, static_cast<size_t>(i), 0});
      }
    }
  }
  for (size_t k = 0; k < decode.size(); ++k) {
    decode_works.push_back(decode_work(decode[k]));
    const DecodeWork& w = decode_works.back();
    for (size_t i = 0; i < w.items.size(); ++i) {
      items.push_back({true, k, i, decode_ns(w.kernel, w.items[i])});
    }
    for (size_t i = 0; i < w.merges.size(); ++i) merges.push_back({true, k, i, 0});
  }
  // Largest first with dynamic hand-out: the longest-processing-time rule, so the long items (a
  // causal triangle's long rows, a long prompt chunk) start first and short ones fill the tail.
  // (std::stable_sort takes a buffer from the heap even for one item: a one-token decode's cost.)
  if (items.size() > 1) {
    std::stable_sort(items.begin(), items.end(),
                     [](const RegionItem& a, const RegionItem& b) { return a.ns > b.ns; });
  }

  const auto run_item = [&](int64_t i) {
    const RegionItem& r = items[static_cast<size_t>(i)];
    if (r.decode) {
      DecodeWork& w = decode_works[r.kernel];
      const DecodeKernel& kernel = w.kernel;
      const DecodeItem& it = w.items[r.index];
      kernel.run(
          it.pair, it.heads, it.chunk,
          it.partial >= 0 ? w.partials.data() + it.partial * kernel.partial_floats() : nullptr);
      return;
    }
    PrefillWork& w = prefill_works[r.kernel];
    const AttentionKernel& kernel = w.kernel;
    const WorkItem& it = w.items[r.index];
    float* partial = nullptr;
    if (w.splits > 1) {
      partial = w.partials.data() + (it.item * w.splits + it.split) * kernel.partial_floats();
    }
    kernel.run(it.item, it.kv_begin, it.kv_end, partial);
  };
  const auto merge = [&](int64_t i) {
    const RegionItem& r = merges[static_cast<size_t>(i)];
    if (r.decode) {
      const DecodeWork& w = decode_works[r.kernel];
      const DecodeKernel& kernel = w.kernel;
      const DecodeItem& m = w.merges[r.index];
      kernel.merge(m.pair, w.partials.data() + m.partial * kernel.partial_floats());
      return;
    }
    const PrefillWork& w = prefill_works[r.kernel];
    const AttentionKernel& kernel = w.kernel;
    const auto item = static_cast<int64_t>(r.index);
    kernel.merge(item, w.partials.data() + item * w.splits * kernel.partial_floats(), w.splits);
  };
  // Each thread sizes its scratch for every kernel's largest item before any row is written, so
  // that a call short of memory fails with out as it was (README: a failed call writes nothing).
  const auto reserve = [&] {
    for (const PrefillWork& w : prefill_works) w.kernel.reserve_scratch();
    for (const DecodeWork& w : decode_works) w.kernel.reserve_scratch(w.max_heads);
  };
  const auto n = static_cast<int64_t>(items.size());
  run_then_merge(resolve_threads(threads, n), reserve, n, run_item,
                 static_cast<int64_t>(merges.size()), merge, profile);
}

}  // namespace flashcte::internal
