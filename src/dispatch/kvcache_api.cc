// flash_attn_with_kvcache (include/flashcte/kvcache.h): validate everything, turn the queries
// (rotary), save the cache slots the append overwrites, append the new keys (rotary) and values
// through the caches' K/V sources, then attend the updated cache: a few queries per sequence on
// the decode kernel, longer chunks (prefill, chunked prefill) on attention_cte with the cache as
// its prior, read from the pages in place. Should the kernel fail (memory), the saved slots go
// back, so a failed call leaves the caches as they were.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashcte/kvcache.h"
#include "src/core/convert.h"
#include "src/core/kv8.h"
#include "src/dispatch/kvcache.h"
#include "src/dispatch/step.h"
#include "src/kernel/decode.h"

namespace flashcte::internal {
namespace {

// Rotates x[0, rotary_dim) in place by the angles of row `pos` of cos / sin: pairs (2i, 2i + 1)
// when interleaved, else (i, i + rotary_dim / 2), as FlashAttention's apply_rotary_emb; float32
// arithmetic, as its kernel.
void rotate(const KvAppend& a, int64_t pos, float* x) {
  const int64_t half = a.rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c =
        load_as_float(a.cos.data, pos * a.cos.strides[0] + i * a.cos.strides[1], a.cos.dtype);
    const float s =
        load_as_float(a.sin.data, pos * a.sin.strides[0] + i * a.sin.strides[1], a.sin.dtype);
    float& x0 = x[a.interleaved ? 2 * i : i];
    float& x1 = x[a.interleaved ? 2 * i + 1 : i + half];
    const float r0 = x0 * c - x1 * s, r1 = x0 * s + x1 * c;
    x0 = r0;
    x1 = r1;
  }
}

// q turned at its positions, as a (batch, heads, seqlen_q, d) tensor of q's dtype that replaces
// q in the problem (the caller's q is not written).
std::vector<unsigned char> rotated_q(const KvAppend& a, DecodeProblem* p) {
  const int64_t d = p->head_dim, elem = dtype_size(p->dtype);
  std::vector<unsigned char> out(static_cast<size_t>(p->batch * p->q_heads * p->tokens * d * elem));
  std::vector<float> row(static_cast<size_t>(d));
  const auto& st = p->q_strides;
  for (int64_t b = 0; b < p->batch; ++b) {
    for (int64_t h = 0; h < p->q_heads; ++h) {
      for (int64_t i = 0; i < p->tokens; ++i) {
        load_row_as_float(p->q, b * st[0] + h * st[1] + i * st[2], st[3], p->dtype, row.data(), d);
        rotate(a, a.start[b] + (a.q_per_token ? i : 0), row.data());
        store_row_from_float(out.data(), ((b * p->q_heads + h) * p->tokens + i) * d, 1, p->dtype,
                             row.data(), d);
      }
    }
  }
  p->q = out.data();
  p->q_strides = {p->q_heads * p->tokens * d, p->tokens * d, d, 1};
  return out;
}

// One row the append writes: where (its cache source and, for an 8-bit cache, its scales) and
// what (the new tensor's row of sequence b, token i, KV head h).
struct NewRow {
  const KvSource& cache;
  const KvSource& token_scale;       // per-token scales (data null otherwise)
  const std::vector<float>& scales;  // per KV head (8-bit caches without per-token scales)
  const TensorView& source;
  int64_t channels, b, i, h, slot;
  bool rotates;

  int64_t offset() const { return cache.offset(b, h, slot); }
  // The new row as float32, turned where it rotates.
  void load(const KvAppend& a, float* row) const {
    load_row_as_float(source.data,
                      b * source.strides[0] + i * source.strides[1] + h * source.strides[2],
                      source.strides[3], source.dtype, row, channels);
    if (rotates) rotate(a, slot, row);
  }
};

// Calls f(NewRow) for every row the append writes, K rows first.
template <class F>
void for_each_new_row(const DecodeProblem& p, const KvAppend& a, const F& f) {
  for (auto [src, token_scale, scales, t, channels] :
       {std::tuple{&p.k, &p.k_token_scale, &p.k_scale, &a.k, p.head_dim},
        std::tuple{&p.v, &p.v_token_scale, &p.v_scale, &a.v, p.value_dim}}) {
    for (int64_t b = 0; b < p.batch; ++b) {
      for (int64_t i = 0; i < a.tokens; ++i) {
        for (int64_t h = 0; h < p.kv_heads; ++h) {
          f(NewRow{*src, *token_scale, *scales, *t, channels, b, i, h, a.start[b] + i,
                   a.rotary_dim > 0 && t == &a.k});
        }
      }
    }
  }
}

// Calls f(address, bytes) for every run of the caller's memory the append writes: each row's
// elements (a row at a time where its channels are back to back, the usual layouts, else element
// by element) and its per-token scale.
template <class F>
void for_each_written_run(const DecodeProblem& p, const KvAppend& a, const F& f) {
  for_each_new_row(p, a, [&](const NewRow& r) {
    const int64_t elem = r.cache.element_bytes(), step = r.cache.strides[3] * elem;
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the caller's writable cache
    auto* e = static_cast<unsigned char*>(const_cast<void*>(r.cache.data)) + r.offset() * elem;
    const int64_t run = r.cache.strides[3] == 1 ? r.channels : 1;
    for (int64_t x = 0; x < r.channels; x += run, e += step * run) f(e, run * elem);
    if (r.token_scale.data != nullptr) {
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the caller's writable scales
      f(const_cast<unsigned char*>(r.token_scale.row(r.b, r.h, r.slot)), int64_t{sizeof(float)});
    }
  });
}

// The bytes the append overwrites and where they were, to put back on failure (without the
// request, which the router consumes).
class SavedSlots {
 public:
  SavedSlots(const DecodeProblem& p, const KvAppend& a) {
    for_each_written_run(p, a, [&](unsigned char* e, int64_t bytes) {
      runs_.emplace_back(e, bytes);
      bytes_.insert(bytes_.end(), e, e + bytes);
    });
  }
  void restore() const {
    size_t at = 0;
    for (const auto& [e, bytes] : runs_) {
      std::memcpy(e, &bytes_[at], static_cast<size_t>(bytes));
      at += static_cast<size_t>(bytes);
    }
  }

 private:
  std::vector<std::pair<unsigned char*, int64_t>> runs_;
  std::vector<unsigned char> bytes_;
};

// An int8 cache holds no NaN: the first new row that would put one there, as an error naming the
// element, before anything is written.
Status check_int8_rows(const DecodeProblem& p, const KvAppend& a) {
  if (p.k.dtype != DType::kInt8 && p.v.dtype != DType::kInt8) return Status::Ok();
  std::vector<float> row(static_cast<size_t>(std::max(p.head_dim, p.value_dim)));
  Status status = Status::Ok();
  for_each_new_row(p, a, [&](const NewRow& r) {
    if (!status.ok || r.cache.dtype != DType::kInt8) return;
    r.load(a, row.data());
    for (int64_t x = 0; x < r.channels; ++x) {
      if (std::isnan(row[x])) {
        status = Status::Error(std::string(&r.source == &a.k ? "k" : "v") + ": element (" +
                               std::to_string(r.b) + ", " + std::to_string(r.i) + ", " +
                               std::to_string(r.h) + ", " + std::to_string(x) +
                               ") is NaN, which the int8 cache cannot hold");
        return;
      }
    }
  });
  return status;
}

// Writes k (turned) and v into their slots. Values of a float cache's dtype round-trip float32
// exactly, so v is copied bit for bit (a NaN's payload aside) and k rounds once after turning.
// An 8-bit cache takes the row quantized with its KV head's scale or, per token, with a scale
// from the row's own largest magnitude, written beside it (quantize_kv's rule).
void append(const DecodeProblem& p, const KvAppend& a) {
  std::vector<float> row(static_cast<size_t>(std::max(p.head_dim, p.value_dim)));
  for_each_new_row(p, a, [&](const NewRow& r) {
    r.load(a, row.data());
    // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the caller's writable cache
    void* cache = const_cast<void*>(r.cache.data);
    if (!kv8::is_8bit(r.cache.dtype)) {
      store_row_from_float(cache, r.offset(), r.cache.strides[3], r.cache.dtype, row.data(),
                           r.channels);
      return;
    }
    float scale = 0;
    if (r.token_scale.data != nullptr) {
      scale = kv8::row_scale(r.cache.dtype, row.data(), r.channels);
      // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): the caller's writable scales
      *reinterpret_cast<float*>(const_cast<unsigned char*>(r.token_scale.row(r.b, r.h, r.slot))) =
          scale;
    } else {
      scale = r.scales[static_cast<size_t>(r.h)];
    }
    kv8::encode_row(r.cache.dtype, row.data(), r.channels, scale,
                    static_cast<uint8_t*>(cache) + r.offset(), r.cache.strides[3]);
  });
}

// Sequence b's slots of a cache source (the caches' or their per-token scales') as a source of one
// sequence, its sequence 0: its row of the page table, or its row of a dense cache
// (cache_batch_idx's, held as a table of one page per sequence, or b).
KvSource sequence_source(const KvSource& s, bool paged, int64_t b) {
  if (s.data == nullptr) return s;  // an absent source (no per-token scales) stays absent
  KvSource one = s;
  if (paged) {
    const auto first = s.table.begin() + b * s.pages_per_sequence;
    one.table.assign(first, first + s.pages_per_sequence);
    return one;
  }
  // A sequence that reads no slot has no row in the table (-1): any row serves.
  const int64_t row = s.paged() ? std::max<int64_t>(s.table[static_cast<size_t>(b)], 0) : b;
  one.data = static_cast<const unsigned char*>(s.data) + row * s.strides[0] * s.element_bytes();
  one.block_size = 0;
  one.pages_per_sequence = 0;
  one.table.clear();
  return one;
}

// Where row `first` of sequence b is in a (batch, head, token, channel) view of elements of
// `elem` bytes.
template <class T>
T* sequence_rows(T* data, const std::array<int64_t, 4>& strides, int64_t elem, int64_t b,
                 int64_t first) {
  using Byte = std::conditional_t<std::is_const_v<T>, const unsigned char, unsigned char>;
  return static_cast<Byte*>(data) + (b * strides[0] + first * strides[2]) * elem;
}

}  // namespace

DecodeProblem decode_problem(const KvCacheRequest& request, int64_t b) {
  const DecodeProblem& p = request.decode;
  const int64_t elem = dtype_size(p.dtype), first = request.first_row(b);
  DecodeProblem one;
  one.dtype = p.dtype;
  one.batch = 1;
  one.q_heads = p.q_heads;
  one.kv_heads = p.kv_heads;
  one.group = p.group;
  one.tokens = request.rows(b);
  one.max_len = p.max_len;
  one.head_dim = p.head_dim;
  one.value_dim = p.value_dim;
  one.q = sequence_rows(p.q, p.q_strides, elem, b, first);
  one.q_strides = p.q_strides;
  one.k = sequence_source(p.k, request.paged, b);
  one.v = sequence_source(p.v, request.paged, b);
  one.k_scale = p.k_scale;
  one.v_scale = p.v_scale;
  one.k_token_scale = sequence_source(p.k_token_scale, request.paged, b);
  one.v_token_scale = sequence_source(p.v_token_scale, request.paged, b);
  one.out = sequence_rows(p.out, p.out_strides, elem, b, first);
  one.out_strides = p.out_strides;
  if (p.lse != nullptr) {
    one.lse = p.lse + b * p.lse_strides[0] + first * p.lse_strides[2];
    one.lse_strides = p.lse_strides;
  }
  const auto rows = p.slots.begin() + request.row_index(b, 0);
  one.slots.assign(rows, rows + one.tokens);
  const auto diagonals = p.diagonal.begin() + request.row_index(b, 0);
  one.diagonal.assign(diagonals, diagonals + one.tokens);
  one.sink = p.sink;
  one.sink_stride = p.sink_stride;
  one.scale = p.scale;
  one.softcap = p.softcap;
  if (p.alibi != nullptr) {
    one.alibi = p.alibi + b * p.alibi_strides[0];
    one.alibi_strides = p.alibi_strides;
  }
  one.threads = p.threads;
  return one;
}

Problem prefill_problem(const KvCacheRequest& request, int64_t b) {
  const DecodeProblem& p = request.decode;
  const int64_t elem = dtype_size(p.dtype), first = request.first_row(b);
  const int64_t tokens = request.rows(b);
  const int64_t seqlen_k = request.append.start[b] + request.append.tokens;
  Problem r;
  r.dtype = p.dtype;
  // The query heads are the batch, grouped over the KV heads (no query head: nothing to plan).
  r.batch = p.q_heads;
  r.kv_batch = p.q_heads > 0 ? p.kv_heads : 0;
  r.group = p.q_heads > 0 ? p.group : 1;
  r.seqlen_q = tokens;
  r.head_dim = p.head_dim;
  r.value_dim = p.value_dim;
  r.q = {sequence_rows(p.q, p.q_strides, elem, b, first), p.q_strides[1], p.q_strides[2],
         p.q_strides[3]};
  // No new keys (Skv = 0): every key is in the prior. The strides are those of an empty
  // (bs_kv, Skv, d) k and v, for the packing's layout choice.
  r.seqlen_kv = 0;
  r.k = {nullptr, p.head_dim, p.head_dim, 1};
  r.v = {nullptr, p.value_dim, p.value_dim, 1};
  // The cache as the prior: KV batch h is head h of the sequence's pages or cache row.
  r.k_prior = sequence_source(p.k, request.paged, b);
  r.v_prior = sequence_source(p.v, request.paged, b);
  r.prior_heads = p.kv_heads;
  r.seqlen_prior = p.max_len;
  r.prior_used.assign(static_cast<size_t>(p.kv_heads), seqlen_k);
  r.k_prior_scale = p.k_scale;
  r.v_prior_scale = p.v_scale;
  r.k_prior_token_scale = sequence_source(p.k_token_scale, request.paged, b);
  r.v_prior_token_scale = sequence_source(p.v_token_scale, request.paged, b);
  r.sink = p.sink;
  r.sink_stride = p.sink_stride;
  r.scale = p.scale;
  r.softcap = p.softcap;
  if (p.alibi != nullptr) {
    r.alibi_slopes = p.alibi + b * p.alibi_strides[0];
    r.alibi_stride = p.alibi_strides[1];
  }
  // FlashAttention's masks: a window about the bottom-right aligned diagonal (query i at
  // seqlen_k - seqlen_q + i, the prior's slots at their own positions), left padding as the
  // first slot every row may see.
  const auto bound = [](int64_t w) {
    return w >= 0 ? std::min(w, Problem::kNoLimit) : Problem::kNoLimit;
  };
  r.window_left = bound(request.window_left);
  r.window_right = bound(request.window_right);
  r.q_pos_offset = -tokens;
  if (!request.leftpad.empty()) {
    r.bound_lo.assign(static_cast<size_t>(tokens), request.leftpad[static_cast<size_t>(b)]);
    r.bound_hi.assign(static_cast<size_t>(tokens), seqlen_k);
  }
  r.out = {sequence_rows(p.out, p.out_strides, elem, b, first), p.out_strides[1], p.out_strides[2],
           p.out_strides[3]};
  if (p.lse != nullptr) {
    r.lse.data = p.lse + b * p.lse_strides[0] + first * p.lse_strides[2];
    r.lse.batch_stride = p.lse_strides[1];
    r.lse.row_stride = p.lse_strides[2];
  }
  r.threads = p.threads;
  return r;
}

}  // namespace flashcte::internal

namespace flashcte {

Status flash_attn_with_kvcache(const TensorView& q, const MutableTensorView& k_cache,
                               const MutableTensorView& v_cache, const MutableTensorView& out,
                               const MutableTensorView& lse, const KvCacheOptions& options) {
  internal::KvCacheRequest request;
  std::optional<internal::SavedSlots> saved;
  try {
    Status s = internal::validate_kvcache(q, k_cache, v_cache, out, lse, options, &request);
    if (!s.ok) return s;
    internal::DecodeProblem& problem = request.decode;
    const internal::KvAppend& append = request.append;
    std::vector<unsigned char> q_turned;
    if (append.rotary_dim > 0) q_turned = internal::rotated_q(append, &problem);
    s = internal::check_int8_rows(problem, append);
    if (!s.ok) return s;
    saved.emplace(problem, append);
    internal::append(problem, append);
    const int threads = problem.threads;
    internal::Step step;
    internal::route(std::move(request), &step);
    internal::run_step(step, threads);
    return Status::Ok();
  } catch (const std::exception& e) {
    if (saved) saved->restore();
    if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
      return Status::Error(
          "memory: allocation of the call's scratch failed; the caches are as they were",
          ErrorKind::kMemory);
    }
    return Status::Error(std::string("internal: ") + e.what(), ErrorKind::kInternal);
  }
}

}  // namespace flashcte
