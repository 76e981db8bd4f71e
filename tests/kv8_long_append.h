// The machinery of Kv8LongAppend (kv8_long_append_test.cc): flash_attn_with_kvcache appending
// into 8-bit caches of two sequences of 2500 and 9000 tokens, left-padded, dense (FlashAttention's
// layout, with cache_batch_idx) or in pages; the rotary tables; the appended rows' codes and
// scales checked against the test's own encoder written from the spec (quantize_kv in kvcache.h);
// the call; and the float64 oracle of the appended caches.
#ifndef FLASHCTE_TESTS_KV8_LONG_APPEND_H_
#define FLASHCTE_TESTS_KV8_LONG_APPEND_H_

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "flashcte/decode.h"
#include "flashcte/kvcache.h"
#include "src/reference/reference.h"
#include "tests/kv8_formats.h"
#include "tests/kv8_long_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
// Internal linkage, as in a test file: these names (Outcome, within, max_abs, kD, ...) differ
// from other tests' (test_util.h's Outcome among them).
namespace {

// ---------------------------------------------------------------------------------------------
// flash_attn_with_kvcache appending into 8-bit caches.

// Two sequences with 2500 and 9000 cached tokens, left-padded by 700 and 1500 (so sequence 1
// attends [1500, 9000 + new): its first decode chunk starts mid-chunk, seven boundaries follow),
// in rows 2 and 0 of a dense cache of three rows (row 1 belongs to no sequence) or in pages.
constexpr int64_t kABatch = 2, kARows = 3, kAHeads = 4, kASlots = 9024, kRotaryDim = 48;
const std::vector<int32_t> kASeqlens = {2500, 9000}, kALeftpad = {700, 1500}, kABatchIdx = {2, 0};

// One 8-bit cache of the append, FlashAttention's dense (batch_cache, seqlen_cache, kv_heads,
// channels). Sequence b's row holds codes in its slots [leftpad, seqlen); every other slot holds
// poison (per-token scale NaN): the slots before leftpad must not be read, the append writes
// [seqlen, seqlen + new), and nothing else may change.
struct AppendCache {
  DType format;
  Granularity granularity;
  int64_t channels;
  std::vector<uint8_t> codes;
  std::vector<float> scale;  // (1,), (kKvHeads,) or (kARows, kASlots, kKvHeads)

  AppendCache(DType f, Granularity g, int64_t c, uint32_t seed)
      : format(f), granularity(g), channels(c) {
    const std::vector<uint8_t> pool = code_pool(f, 0.0, code_sd(f), seed);
    std::mt19937 rng(seed + 1);
    std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
    codes.assign(static_cast<size_t>(kARows * kASlots * kKvHeads * c), kPoison);
    // Shared scales near 2^-6: new values up to 2 in magnitude then take codes up to ~128 (int8
    // saturates a few, fp8 none); the planted 40 saturates int8 and e4m3.
    if (g == kPerToken) {
      scale.assign(static_cast<size_t>(kARows * kASlots * kKvHeads), kNaN);
    } else {
      for (int64_t i = 0; i < (g == kPerHead ? kKvHeads : 1); ++i)
        scale.push_back(short_scale(-6, rng));
    }
    for (int64_t b = 0; b < kABatch; ++b) {
      for (int64_t j = kALeftpad[b]; j < kASeqlens[b]; ++j) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          const size_t s = slot(kABatchIdx[b], j, h);
          for (int64_t x = 0; x < c; ++x) codes[s * c + x] = pool[pick(rng)];
          if (g == kPerToken) scale[s] = short_scale(-6, rng);
        }
      }
    }
  }
  size_t slot(int64_t row, int64_t j, int64_t h) const {
    return static_cast<size_t>((row * kASlots + j) * kKvHeads + h);
  }
  float slot_scale(int64_t row, int64_t j, int64_t h) const {
    if (granularity == kPerToken) return scale[slot(row, j, h)];
    return scale[granularity == kPerHead ? h : 0];
  }
  double value(int64_t row, int64_t j, int64_t h, int64_t x) const {
    return codebook(format).value(codes[slot(row, j, h) * channels + x]) * slot_scale(row, j, h);
  }
  MutableTensorView view() {
    return MutableTensorView::contiguous(codes.data(), format,
                                         {kARows, kASlots, kKvHeads, channels});
  }
  MutableTensorView scale_view() {
    if (granularity == kPerToken) {
      return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                           {kARows, kASlots, kKvHeads});
    }
    return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                         {static_cast<int64_t>(scale.size())});
  }
};

// The append's sequences in pages of `block` slots, the kvcache's logical (num_blocks,
// page_block_size, kv_heads, channels), laid out NHD or HND. Each sequence's pages sit at
// shuffled places of the pool; its table entries for pages wholly before leftpad or past
// seqlen + new name a spare poison page (which nothing may read or write).
struct AppendTable {
  int64_t block, max_pages, num_blocks = 0;
  int32_t spare = 0;
  std::vector<int32_t> table;  // (kABatch, max_pages)

  AppendTable(int64_t block_size, int64_t tokens) : block(block_size) {
    max_pages = (kASlots + block - 1) / block;
    std::vector<std::pair<int64_t, int64_t>> used;  // (b, page index)
    for (int64_t b = 0; b < kABatch; ++b) {
      for (int64_t i = kALeftpad[b] / block; i * block < kASeqlens[b] + tokens; ++i)
        used.emplace_back(b, i);
    }
    num_blocks = static_cast<int64_t>(used.size()) + 1;
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(static_cast<uint32_t>(block + tokens)));
    spare = ids.back();
    table.assign(static_cast<size_t>(kABatch * max_pages), spare);
    for (size_t u = 0; u < used.size(); ++u) {
      table[static_cast<size_t>(used[u].first * max_pages + used[u].second)] = ids[u];
    }
  }
  TensorView view() const {
    return TensorView::contiguous(table.data(), DType::kInt32, {kABatch, max_pages});
  }
};

struct AppendPool {
  const AppendTable& t;
  bool hnd;
  DType format;
  Granularity granularity;
  int64_t channels;
  std::vector<uint8_t> codes;
  std::vector<float> scale;

  // The pages of `dense`'s sequences (its rows kABatchIdx), everything else poison.
  AppendPool(const AppendTable& table, bool hnd_layout, const AppendCache& dense)
      : t(table),
        hnd(hnd_layout),
        format(dense.format),
        granularity(dense.granularity),
        channels(dense.channels) {
    const int64_t c = channels;
    codes.assign(static_cast<size_t>(t.num_blocks * t.block * kKvHeads * c), kPoison);
    if (granularity == kPerToken) {
      scale.assign(static_cast<size_t>(t.num_blocks * t.block * kKvHeads), kNaN);
    } else {
      scale = dense.scale;
    }
    for (int64_t b = 0; b < kABatch; ++b) {
      for (int64_t i = 0; i < t.max_pages; ++i) {
        const int32_t page = t.table[static_cast<size_t>(b * t.max_pages + i)];
        if (page == t.spare) continue;
        for (int64_t r = 0; r < t.block && i * t.block + r < kASlots; ++r) {
          for (int64_t h = 0; h < kKvHeads; ++h) {
            const size_t from = dense.slot(kABatchIdx[b], i * t.block + r, h);
            const int64_t to = row(page, r, h);
            std::memcpy(&codes[static_cast<size_t>(to * c)], &dense.codes[from * c],
                        static_cast<size_t>(c));
            if (granularity == kPerToken) scale[static_cast<size_t>(to)] = dense.scale[from];
          }
        }
      }
    }
  }
  int64_t row(int64_t page, int64_t r, int64_t h) const {
    return hnd ? (page * kKvHeads + h) * t.block + r : (page * t.block + r) * kKvHeads + h;
  }
  MutableTensorView view() {
    const int64_t c = channels, bl = t.block;
    return {codes.data(),
            format,
            4,
            {t.num_blocks, bl, kKvHeads, c},
            hnd ? std::array<int64_t, 4>{kKvHeads * bl * c, c, bl * c, 1}
                : std::array<int64_t, 4>{bl * kKvHeads * c, kKvHeads * c, c, 1}};
  }
  MutableTensorView scale_view() {
    if (granularity != kPerToken) {
      return MutableTensorView::contiguous(scale.data(), DType::kFloat32,
                                           {static_cast<int64_t>(scale.size())});
    }
    const int64_t bl = t.block;
    return {scale.data(),
            DType::kFloat32,
            3,
            {t.num_blocks, bl, kKvHeads, 0},
            hnd ? std::array<int64_t, 4>{kKvHeads * bl, 1, bl, 0}
                : std::array<int64_t, 4>{bl * kKvHeads, kKvHeads, 1, 0}};
  }
};

// Rotary tables (kASlots, kRotaryDim / 2) float32, FlashAttention's: angle pos x 10000^(-2i/rd).
struct Rotary {
  std::vector<float> cos, sin;
  Rotary() {
    for (int64_t pos = 0; pos < kASlots; ++pos) {
      for (int64_t i = 0; i < kRotaryDim / 2; ++i) {
        const double angle = static_cast<double>(pos) *
                             std::pow(10000.0, -2.0 * static_cast<double>(i) / kRotaryDim);
        cos.push_back(static_cast<float>(std::cos(angle)));
        sin.push_back(static_cast<float>(std::sin(angle)));
      }
    }
  }
  double c(int64_t pos, int64_t i) const {
    return cos[static_cast<size_t>(pos * kRotaryDim / 2 + i)];
  }
  double s(int64_t pos, int64_t i) const {
    return sin[static_cast<size_t>(pos * kRotaryDim / 2 + i)];
  }
};

// A row turned by rotary at `pos` (the first kRotaryDim channels; pairs (2i, 2i + 1) when
// interleaved, else (i, i + kRotaryDim / 2)), as the interval each channel's float32 result may
// take. The library turns in float32 (r0 = x0 c - x1 s, r1 = x0 s + x1 c, contracted to an FMA or
// not): two products and a sum, each rounded once, so |r_f32 - r| <= (2u + u^2)(|x0 c| + |x1 s|)
// with u = 2^-24; r here is float64 (exact products, one rounding of 2^-53 |r|, added). Channels
// that do not turn are the input exactly (lo == hi).
struct RowInterval {
  std::vector<double> lo, hi;
};
inline RowInterval turned(std::vector<double> x, bool rotates, int64_t pos, bool interleaved,
                          const Rotary& rotary) {
  RowInterval r{x, x};
  if (!rotates) return r;
  constexpr double u = 0x1p-24;
  for (int64_t i = 0; i < kRotaryDim / 2; ++i) {
    const size_t a = static_cast<size_t>(interleaved ? 2 * i : i);
    const size_t b = static_cast<size_t>(interleaved ? 2 * i + 1 : i + kRotaryDim / 2);
    const double c = rotary.c(pos, i), s = rotary.s(pos, i);
    const double r0 = x[a] * c - x[b] * s, r1 = x[a] * s + x[b] * c;
    const double e0 =
        (2 * u + u * u) * (std::fabs(x[a] * c) + std::fabs(x[b] * s)) + 0x1p-53 * std::fabs(r0);
    const double e1 =
        (2 * u + u * u) * (std::fabs(x[a] * s) + std::fabs(x[b] * c)) + 0x1p-53 * std::fabs(r1);
    r.lo[a] = r0 - e0;
    r.hi[a] = r0 + e0;
    r.lo[b] = r1 - e1;
    r.hi[b] = r1 + e1;
  }
  return r;
}

// One appended row's codes (and per-token scale) against the spec, with the test's encoder.
// Per token: the scale must be fl32(max|value| / format max) (1 for a zero row) for some float32
// row inside the intervals: one value where nothing turned, else between the ends' scales. The
// codes: each element's value / scale (in double) rounded to the format, with the scale written;
// where the interval's ends round to one code (all channels that do not turn, and nearly all that
// do) that code bit for bit, else a code between the two ends' codes (the float32 rotation may
// land on either side of a rounding boundary: a difference of one code). *ambiguous counts those.
inline ::testing::AssertionResult check_row(DType format, const RowInterval& want,
                                            const uint8_t* got, bool per_token, float scale,
                                            float written_scale, int64_t* ambiguous) {
  const Codebook& book = codebook(format);
  if (per_token) {
    double a_lo = 0, a_hi = 0;  // the range of max_x |value_x| (all values finite here)
    for (size_t x = 0; x < want.lo.size(); ++x) {
      const double lo = want.lo[x], hi = want.hi[x];
      a_lo = std::max(a_lo, lo > 0 ? lo : hi < 0 ? -hi : 0.0);
      a_hi = std::max(a_hi, std::max(std::fabs(lo), std::fabs(hi)));
    }
    const float s_lo = a_hi == 0 ? 1.0f : static_cast<float>(a_lo / format_max(format));
    const float s_hi = a_hi == 0 ? 1.0f : static_cast<float>(a_hi / format_max(format));
    if (!(s_lo > 0) || !(written_scale >= s_lo && written_scale <= s_hi)) {
      return ::testing::AssertionFailure()
             << "per-token scale " << written_scale << ", want " << s_lo
             << (s_lo == s_hi ? "" : " .. " + std::to_string(s_hi));
    }
    scale = written_scale;
  }
  for (size_t x = 0; x < want.lo.size(); ++x) {
    const uint8_t lo = book.encode(want.lo[x] / scale), hi = book.encode(want.hi[x] / scale);
    if (lo == hi) {
      if (got[x] != lo) {
        return ::testing::AssertionFailure()
               << "channel " << x << ": code " << int{got[x]} << " (" << book.value(got[x])
               << "), want " << int{lo} << " (" << book.value(lo) << ") for " << want.lo[x]
               << " / scale " << scale;
      }
      continue;
    }
    ++*ambiguous;
    const double v = book.value(got[x]);
    if (!(v >= book.value(lo) && v <= book.value(hi))) {
      return ::testing::AssertionFailure()
             << "channel " << x << ": code " << int{got[x]} << " (" << v << "), want between "
             << book.value(lo) << " and " << book.value(hi) << " for [" << want.lo[x] << ", "
             << want.hi[x] << "] / scale " << scale;
    }
  }
  return ::testing::AssertionSuccess();
}

// The new tokens: q (batch, new, heads, d), k (batch, new, kv_heads, d), v (..., dv), values
// that bfloat16 holds exactly, so that float32 and bfloat16 calls append the same values. Planted:
// a 40 in a K channel that does not turn (int8 and e4m3 saturate under a shared scale; under a
// per-token scale it sets the scale), a V row of zeros (per-token scale 1), a -0.
struct NewTokens {
  int64_t tokens;
  std::vector<double> q, k, v;
  NewTokens(int64_t n, uint32_t seed) : tokens(n) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-2.0, 2.0);
    const auto draw = [&](std::vector<double>* t, int64_t heads, int64_t c) {
      t->resize(static_cast<size_t>(kABatch * n * heads * c));
      for (double& x : *t) x = reference::round_to_dtype(u(rng), DType::kBFloat16);
    };
    draw(&q, kAHeads, kD);
    draw(&k, kKvHeads, kD);
    draw(&v, kKvHeads, kDv);
    k[static_cast<size_t>(((0 * n + 0) * kKvHeads + 1) * kD + 60)] = 40.0;
    std::fill_n(v.begin() + ((1 * n + n - 1) * kKvHeads + 1) * kDv, kDv, 0.0);
    v[static_cast<size_t>(3)] = -0.0;
  }
  static std::vector<double> row(const std::vector<double>& t, int64_t n, int64_t heads, int64_t c,
                                 int64_t b, int64_t i, int64_t h) {
    const auto at = t.begin() + ((b * n + i) * heads + h) * c;
    return {at, at + c};
  }
  Tensor4 tensor(DType dtype, const std::vector<double>& t, int64_t heads, int64_t c) const {
    Tensor4 r(dtype, {kABatch, tokens, heads, c});
    size_t at = 0;
    for (int64_t b = 0; b < kABatch; ++b) {
      for (int64_t i = 0; i < tokens; ++i) {
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t x = 0; x < c; ++x) r.set(b, i, h, x, t[at++]);
        }
      }
    }
    return r;
  }
};

struct AppendSetup {
  bool causal, interleaved;
  const Rotary& rotary;
  const Tensor4 &q, &k, &v;
};

inline Outcome append(const AppendSetup& s, MutableTensorView k_cache, MutableTensorView v_cache,
                      MutableTensorView k_scale, MutableTensorView v_scale, const TensorView& table,
                      int threads) {
  const int64_t tokens = s.q.view().shape[1];
  Tensor4 out(s.q.view().dtype, {kABatch, tokens, kAHeads, kDv});
  out.fill_nan();
  Outcome r;
  r.lse = nan_floats(kABatch * kAHeads * tokens);
  KvCacheOptions o;
  o.k = s.k.view();
  o.v = s.v.view();
  o.rotary_cos =
      TensorView::contiguous(s.rotary.cos.data(), DType::kFloat32, {kASlots, kRotaryDim / 2});
  o.rotary_sin =
      TensorView::contiguous(s.rotary.sin.data(), DType::kFloat32, {kASlots, kRotaryDim / 2});
  o.rotary_interleaved = s.interleaved;
  o.cache_seqlens = TensorView::contiguous(kASeqlens.data(), DType::kInt32, {kABatch});
  o.cache_leftpad = TensorView::contiguous(kALeftpad.data(), DType::kInt32, {kABatch});
  if (table.present()) {
    o.block_table = table;
  } else {
    o.cache_batch_idx = TensorView::contiguous(kABatchIdx.data(), DType::kInt32, {kABatch});
  }
  o.k_scale = k_scale;
  o.v_scale = v_scale;
  o.causal = s.causal;
  o.num_threads = threads;
  r.status = flash_attn_with_kvcache(
      s.q.view(), k_cache, v_cache, out.mutable_view(),
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kABatch, kAHeads, tokens}), o);
  r.out = out.bytes();
  return r;
}

// The append's codes and scales in a dense cache after the call, against the spec; then that
// nothing else changed (the cache as it was, with the checked slots taken from the call).
inline void check_appended(const AppendCache& before, const AppendCache& after, const NewTokens& in,
                           bool is_k, bool interleaved, const Rotary& rotary, int64_t* ambiguous) {
  AppendCache expected = before;
  const int64_t c = after.channels;
  for (int64_t b = 0; b < kABatch; ++b) {
    for (int64_t i = 0; i < in.tokens; ++i) {
      for (int64_t h = 0; h < kKvHeads; ++h) {
        const int64_t pos = kASeqlens[b] + i;
        const RowInterval want =
            turned(NewTokens::row(is_k ? in.k : in.v, in.tokens, kKvHeads, c, b, i, h), is_k, pos,
                   interleaved, rotary);
        const size_t slot = after.slot(kABatchIdx[b], pos, h);
        const bool per_token = after.granularity == kPerToken;
        ASSERT_TRUE(check_row(after.format, want, &after.codes[slot * c], per_token,
                              per_token ? 0.0f : after.slot_scale(0, 0, h),
                              per_token ? after.scale[slot] : 0.0f, ambiguous))
            << (is_k ? "k" : "v") << " of sequence " << b << ", new token " << i << ", head " << h;
        std::memcpy(&expected.codes[slot * c], &after.codes[slot * c], static_cast<size_t>(c));
        if (per_token) expected.scale[slot] = after.scale[slot];
      }
    }
  }
  EXPECT_TRUE(same_bits(after.codes, expected.codes))
      << (is_k ? "k" : "v") << ": codes outside the new slots";
  EXPECT_TRUE(same_bits(after.scale, expected.scale))
      << (is_k ? "k" : "v") << ": scales outside the new slots";
}

// The oracle over the caches after the append: per sequence, its slots [leftpad, seqlen + new)
// dequantized (a per-token scale the append wrote has 24 significant bits, so code x scale rounds
// to float32 by at most 2^-24 relative: far inside the tolerance), queries turned in float64 at
// cache_seqlens + i (causal) or all at cache_seqlens (the library's float32 turn differs by
// 2^-23 relative at most, moving a score by ~1e-6 at these magnitudes: inside the tolerance).
inline void append_reference(const NewTokens& in, bool causal, bool interleaved,
                             const Rotary& rotary, const AppendCache& kc, const AppendCache& vc,
                             std::vector<double>* out, std::vector<double>* lse) {
  const int64_t n = in.tokens;
  out->assign(static_cast<size_t>(kABatch * n * kAHeads * kDv), 0);
  lse->assign(static_cast<size_t>(kABatch * kAHeads * n), 0);
  for (int64_t b = 0; b < kABatch; ++b) {
    const int64_t lo = kALeftpad[b], keys = kASeqlens[b] + n - lo, row = kABatchIdx[b];
    std::vector<double> q;  // (heads, n, d)
    for (int64_t h = 0; h < kAHeads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        const RowInterval t = turned(NewTokens::row(in.q, n, kAHeads, kD, b, i, h), true,
                                     kASeqlens[b] + (causal ? i : 0), interleaved, rotary);
        for (int64_t x = 0; x < kD; ++x) q.push_back((t.lo[x] + t.hi[x]) / 2);
      }
    }
    std::vector<int64_t> hi;
    for (int64_t i = 0; i < n; ++i) hi.push_back(causal ? keys - n + i + 1 : keys);
    std::vector<double> o, l;
    reference_rows(
        q, kAHeads, n, kD, hi, kKvHeads, kDv,
        [&](int64_t h, int64_t j, int64_t x) { return kc.value(row, lo + j, h, x); },
        [&](int64_t h, int64_t j, int64_t x) { return vc.value(row, lo + j, h, x); }, &o, &l);
    for (int64_t h = 0; h < kAHeads; ++h) {
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t x = 0; x < kDv; ++x) {
          (*out)[static_cast<size_t>(((b * n + i) * kAHeads + h) * kDv + x)] =
              o[static_cast<size_t>((h * n + i) * kDv + x)];
        }
        (*lse)[static_cast<size_t>((b * kAHeads + h) * n + i)] = l[static_cast<size_t>(h * n + i)];
      }
    }
  }
}

}  // namespace
}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_KV8_LONG_APPEND_H_
