// The machinery of the 8-bit long-context tests (kv8_long_test.cc, kv8_long_append.h; the design
// in kv8_long_test.cc's file comment): the formats' codebooks and code pools, the oracle's rows
// and tolerances, the sequences of 2501, 9001 and 2520 slots as 8-bit caches (LongCache) and as
// pages of every block size and layout (LongPages).
#ifndef FLASHCTE_TESTS_KV8_LONG_CASES_H_
#define FLASHCTE_TESTS_KV8_LONG_CASES_H_

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
#include "tests/test_util.h"

namespace flashcte::test {
// Internal linkage, as in a test file: these names (Outcome, within, max_abs, kD, ...) differ
// from other tests' (test_util.h's Outcome among them).
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int kThreadCounts[] = {1, 3};
constexpr int64_t kBlocks[] = {1, 16, 256};
const char* const kGranularityNames[] = {"per tensor", "per KV head", "per token"};

// The code of slots no call may read: NaN in the fp8 formats; 127 in int8, which a NaN per-token
// scale makes NaN too and a shared scale a value far off the rest.
constexpr uint8_t kPoison = 0x7F;

// The largest finite value of a format, the divisor of a per-token scale (kvcache.h).
inline double format_max(DType format) {
  return format == DType::kInt8 ? 127.0 : format == DType::kFloat8E4M3 ? 448.0 : 57344.0;
}

// The test's 8-bit encoder, sharing nothing with the library's: values rounded by the oracle's
// reference::round_to_dtype (nearest, ties to even, saturating at the format's largest value),
// codes found by value in a table of all 256 codes decoded by reference::load_element.
class Codebook {
 public:
  explicit Codebook(DType format) : format_(format) {
    for (int c = 0; c < 256; ++c) {
      const auto code = static_cast<uint8_t>(c);
      const double v = value(code);
      if (v != 0 && !std::isnan(v)) by_value_.emplace(v, code);
    }
  }
  double value(uint8_t code) const { return reference::load_element(&code, format_, 0); }
  // The code of x (not NaN) rounded to the format; a zero keeps its sign where the format has
  // one (fp8).
  uint8_t encode(double x) const {
    const double r = reference::round_to_dtype(x, format_);
    if (r == 0) return std::signbit(r) && format_ != DType::kInt8 ? 0x80 : 0x00;
    return by_value_.at(r);
  }

 private:
  DType format_;
  std::unordered_map<double, uint8_t> by_value_;
};

inline const Codebook& codebook(DType format) {
  static const Codebook books[] = {Codebook(DType::kInt8), Codebook(DType::kFloat8E4M3),
                                   Codebook(DType::kFloat8E5M2)};
  return books[format == DType::kInt8 ? 0 : format == DType::kFloat8E4M3 ? 1 : 2];
}

// A scale with a 16-bit significand in [2^e, 2^(e + 1)): code x scale is exact in float32 (int8's
// 7 significant bits + 16 <= 24).
inline float short_scale(int e, std::mt19937& rng) {
  std::uniform_int_distribution<int> significand(1 << 15, (1 << 16) - 1);
  return static_cast<float>(std::ldexp(significand(rng), e - 15));
}

// 2^16 codes drawn from normal values (mean and sd in code units) through the test's encoder; a
// cache samples its codes from them (encoding every element of a 9001-slot cache would cost
// more than the calls under test).
inline std::vector<uint8_t> code_pool(DType format, double mean, double sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(mean, sd);
  std::vector<uint8_t> pool(size_t{1} << 16);
  for (uint8_t& code : pool) code = codebook(format).encode(normal(rng));
  return pool;
}

// Code magnitudes: K codes centred on 0, V codes with a positive mean, so that the outputs
// (weighted means of V rows) stay near max|V| / 2 and a tolerance relative to them is tight.
inline double code_sd(DType format) { return format == DType::kInt8 ? 40.0 : 100.0; }

template <class View>
View swap_axes_1_2(View t) {
  std::swap(t.shape[1], t.shape[2]);
  std::swap(t.strides[1], t.strides[2]);
  return t;
}

// Query values that float32, bfloat16 and float16 all hold exactly (8 significant bits,
// magnitudes in [2^-6, 3] or 0): one float64 reference serves q in every dtype.
inline double query_value(std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  const double r = reference::round_to_dtype(u(rng), DType::kBFloat16);
  return std::fabs(r) < 0x1p-6 ? 0.0 : r;
}

// Every element of got within tol of want, NaN-aware (abs_error): an element the kernel left at
// its NaN sentinel, or wrote as NaN or Inf, fails where the reference is finite.
inline ::testing::AssertionResult within(const std::string& what, const std::vector<double>& got,
                                         const std::vector<double>& want, double tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " values, reference " << want.size();
  }
  if (!std::isfinite(tol)) return ::testing::AssertionFailure() << what << ": tolerance " << tol;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = abs_error(got[i], want[i]);
    if (!(e <= tol)) {
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", reference "
                                           << want[i] << ", tolerance " << tol;
    }
    worst = std::max(worst, e);
  }
  return ::testing::AssertionSuccess() << what << ": worst error " << worst << " of " << tol;
}

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::fabs(v));
  return m;
}

// Tolerances. out with float32 q: the suite's rule, 1e-5 max|exact| (test_util.cc's compare();
// decode_test.cc holds 4096-slot caches to it); float32 scores, softmax and P.V over exactly
// dequantized values stay orders of magnitude inside it at 9001 slots (measured: the worst
// error is ~1e-7 max|exact|). bfloat16 / float16 q (decode_kv8_test.cc's rule, u the dtype's unit
// roundoff): the output rounds once to q's dtype (u max|exact|), and a half-precision
// implementation rounds each P (times its per-token V scale) to the dtype, u of each P and so u
// max|V| at most over a row; the float32 rule on top. lse, every dtype: float32 scores and sums,
// 1e-5 L + 1e-5 with L = max(1, max|lse|) (compare()'s rule for float32 statistics).
inline double out_tolerance(DType dtype, double top, double top_v) {
  if (dtype == DType::kFloat32) return 1e-5 * top;
  return unit_roundoff(dtype) * (top + top_v) + 1e-5 * top;
}
inline double lse_tolerance(const std::vector<double>& lse) {
  return 1e-5 * std::max(1.0, max_abs(lse)) + 1e-5;
}

// The float64 oracle for one sequence: query rows q (q_heads, rows, d) in row-major order, row r
// seeing key slots [0, hi[r]) of key(h, j, x) / value(h, j, x) (kv_heads KV heads, GQA); appends
// out (q_heads, rows, dv) and lse (q_heads, rows) to *out / *lse.
template <class Key, class Value>
inline void reference_rows(const std::vector<double>& q, int64_t q_heads, int64_t rows, int64_t d,
                           const std::vector<int64_t>& hi, int64_t kv_heads, int64_t dv,
                           const Key& key, const Value& value, std::vector<double>* out,
                           std::vector<double>* lse) {
  const int64_t keys = *std::max_element(hi.begin(), hi.end());
  HostTensor qt(DType::kFloat32, {q_heads, rows, d});
  HostTensor kt(DType::kFloat32, {kv_heads, keys, d}), vt(DType::kFloat32, {kv_heads, keys, dv});
  for (int64_t h = 0; h < q_heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t x = 0; x < d; ++x)
        qt.set(h, r, x, q[static_cast<size_t>((h * rows + r) * d + x)]);
    }
  }
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t j = 0; j < keys; ++j) {
      for (int64_t x = 0; x < d; ++x) kt.set(h, j, x, key(h, j, x));
      for (int64_t x = 0; x < dv; ++x) vt.set(h, j, x, value(h, j, x));
    }
  }
  const std::vector<int64_t> lo(hi.size(), 0);
  Options o;
  o.tp_k = true;
  o.causal_mask = false;
  o.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  o.bound_min = TensorView::contiguous(lo.data(), DType::kInt64, {rows});
  o.bound_max = TensorView::contiguous(hi.data(), DType::kInt64, {rows});
  reference::Result exact;
  const Status s = reference::attention(qt.view(), kt.view(), vt.view(), o, &exact);
  ASSERT_TRUE(s.ok) << s.message;
  for (int64_t h = 0; h < q_heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t x = 0; x < dv; ++x) out->push_back(exact.out_at(h, r, x));
      lse->push_back(exact.lse[static_cast<size_t>(h * rows + r)]);
    }
  }
}

// Every element of a contiguous output buffer, decoded exactly.
inline std::vector<double> decoded(const std::vector<unsigned char>& bytes, DType dtype) {
  std::vector<double> v(bytes.size() / static_cast<size_t>(dtype_size(dtype)));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = reference::load_element(bytes.data(), dtype, static_cast<int64_t>(i));
  }
  return v;
}
inline std::vector<double> widened(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// Bitwise equality of two buffers (NaN scales of poisoned slots included), naming the first
// element that differs (EXPECT_EQ would print megabytes of cache).
template <class T>
inline ::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " elements, want " << want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure() << "element " << i << " of " << got.size() << " is "
                                           << +got[i] << ", want " << +want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// What one call produced.
struct Outcome {
  Status status;
  std::vector<unsigned char> out;
  std::vector<float> lse;
};

// ---------------------------------------------------------------------------------------------
// Long caches read in place (decode_attention, flash_attn_varlen_kvcache).

constexpr int64_t kSeqs = 3, kQHeads = 8, kKvHeads = 2, kD = 72, kDv = 40, kMaxLen = 9001;
// Sequence lengths: two to three chunks, nine chunks (its last one slot long), and three.
constexpr std::array<int64_t, kSeqs> kLen = {2501, 9001, 2520};

// One long 8-bit cache: (kSeqs, kKvHeads, kMaxLen, channels) codes and their scales, (1,),
// (kKvHeads,) or per token (kSeqs, kKvHeads, kMaxLen). Slots past a sequence's length hold poison
// (per-token scale NaN).
struct LongCache {
  DType format;
  Granularity granularity;
  int64_t channels;
  std::vector<uint8_t> codes;
  std::vector<float> scale;

  LongCache(DType f, Granularity g, int64_t c, bool values, uint32_t seed)
      : format(f), granularity(g), channels(c) {
    const double sd = code_sd(f);
    const std::vector<uint8_t> pool = code_pool(f, values ? 0.6 * sd : 0.0, sd, seed);
    std::mt19937 rng(seed + 1);
    std::uniform_int_distribution<size_t> pick(0, pool.size() - 1);
    codes.assign(static_cast<size_t>(kSeqs * kKvHeads * kMaxLen * c), kPoison);
    // Dequantized magnitudes ~1: scales near 2^-6 for int8's codes, 2^-7 for fp8's.
    const int e = f == DType::kInt8 ? -6 : -7;
    if (g == kPerToken) {
      scale.assign(static_cast<size_t>(kSeqs * kKvHeads * kMaxLen), kNaN);
    } else {
      for (int64_t i = 0; i < (g == kPerHead ? kKvHeads : 1); ++i)
        scale.push_back(short_scale(e, rng));
    }
    for (int64_t b = 0; b < kSeqs; ++b) {
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < kLen[b]; ++j) {
          for (int64_t x = 0; x < c; ++x) codes[row(b, h, j) * c + x] = pool[pick(rng)];
          if (g == kPerToken) scale[row(b, h, j)] = short_scale(e, rng);
        }
      }
    }
  }
  size_t row(int64_t b, int64_t h, int64_t j) const {
    return static_cast<size_t>((b * kKvHeads + h) * kMaxLen + j);
  }
  float slot_scale(int64_t b, int64_t h, int64_t j) const {
    if (granularity == kPerToken) return scale[row(b, h, j)];
    return scale[granularity == kPerHead ? h : 0];
  }
  // Exact: the code's value times the scale, in double.
  double value(int64_t b, int64_t h, int64_t j, int64_t x) const {
    return codebook(format).value(codes[row(b, h, j) * channels + x]) * slot_scale(b, h, j);
  }
  // The largest |value| any sequence holds.
  double max_abs_value() const {
    double m = 0;
    for (int64_t b = 0; b < kSeqs; ++b) {
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t j = 0; j < kLen[b]; ++j) {
          for (int64_t x = 0; x < channels; ++x) m = std::max(m, std::fabs(value(b, h, j, x)));
        }
      }
    }
    return m;
  }
  // decode_attention's (batch, kv_heads, max_len, channels).
  TensorView decode_view() const {
    return TensorView::contiguous(codes.data(), format, {kSeqs, kKvHeads, kMaxLen, channels});
  }
  TensorView decode_scale() const {
    if (granularity == kPerToken) {
      return TensorView::contiguous(scale.data(), DType::kFloat32, {kSeqs, kKvHeads, kMaxLen});
    }
    return TensorView::contiguous(scale.data(), DType::kFloat32,
                                  {static_cast<int64_t>(scale.size())});
  }
  // FlashAttention's (batch, seqlen_cache, kv_heads, channels): the same bytes, strides permuted.
  TensorView kvcache_view() const { return swap_axes_1_2(decode_view()); }
  TensorView kvcache_scale() const {
    return granularity == kPerToken ? swap_axes_1_2(decode_scale()) : decode_scale();
  }
};

// A K and a V LongCache in pages of `block` slots: every sequence's pages at shuffled places of
// one pool under one table for both caches (as engines keep them), slots of a page past its
// sequence's end poison, and one spare poison page that no sequence owns. A page is laid out HND
// ((kv_heads, block, channels), vLLM's) or NHD ((block, kv_heads, channels), FlashAttention's);
// each call takes the pool in its logical shape through permuted strides.
struct LongPages {
  struct Pool {
    const LongCache& cache;
    std::vector<uint8_t> codes;
    std::vector<float> scale;  // per token only
  };
  int64_t block;
  bool hnd;
  int64_t max_pages = 0, num_blocks = 0;
  std::vector<int32_t> table;  // (kSeqs, max_pages)
  Pool k, v;

  // unused_entry: the table's entries past a sequence's pages. decode_attention looks only at
  // the entries of the pages it reads (decode.h), so -1 there; elsewhere the spare page (-2 here),
  // which poisons whatever reads it.
  LongPages(const LongCache& kc, const LongCache& vc, int64_t block_size, bool hnd_layout,
            int32_t unused_entry)
      : block(block_size), hnd(hnd_layout), k{kc, {}, {}}, v{vc, {}, {}} {
    max_pages = (kMaxLen + block - 1) / block;
    for (int64_t b = 0; b < kSeqs; ++b) num_blocks += (kLen[b] + block - 1) / block;
    ++num_blocks;  // the spare
    std::vector<int32_t> ids(static_cast<size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(static_cast<uint32_t>(block * 2 + hnd)));
    const int32_t spare = ids.back();
    table.assign(static_cast<size_t>(kSeqs * max_pages), unused_entry == -2 ? spare : unused_entry);
    size_t next = 0;
    for (int64_t b = 0; b < kSeqs; ++b) {
      for (int64_t i = 0; i * block < kLen[b]; ++i)
        table[static_cast<size_t>(b * max_pages + i)] = ids[next++];
    }
    for (Pool* p : {&k, &v}) {
      const int64_t c = p->cache.channels;
      const bool per_token = p->cache.granularity == kPerToken;
      p->codes.assign(static_cast<size_t>(num_blocks * block * kKvHeads * c), kPoison);
      if (per_token) p->scale.assign(static_cast<size_t>(num_blocks * block * kKvHeads), kNaN);
      for (int64_t b = 0; b < kSeqs; ++b) {
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t j = 0; j < kLen[b]; ++j) {
            const int64_t r =
                page_row(table[static_cast<size_t>(b * max_pages + j / block)], h, j % block);
            std::memcpy(&p->codes[static_cast<size_t>(r * c)],
                        &p->cache.codes[p->cache.row(b, h, j) * c], static_cast<size_t>(c));
            if (per_token) p->scale[static_cast<size_t>(r)] = p->cache.scale[p->cache.row(b, h, j)];
          }
        }
      }
    }
  }
  // Row (slot r of KV head h) of a page, in rows of channels.
  int64_t page_row(int64_t page, int64_t h, int64_t r) const {
    return hnd ? (page * kKvHeads + h) * block + r : (page * block + r) * kKvHeads + h;
  }
  // decode_attention's (num_blocks, kv_heads, block, channels), and its per-token scales
  // (num_blocks, kv_heads, block).
  TensorView decode_view(const Pool& p) const {
    const int64_t c = p.cache.channels;
    return {p.codes.data(),
            p.cache.format,
            4,
            {num_blocks, kKvHeads, block, c},
            hnd ? std::array<int64_t, 4>{kKvHeads * block * c, block * c, c, 1}
                : std::array<int64_t, 4>{block * kKvHeads * c, c, kKvHeads * c, 1}};
  }
  TensorView decode_scale(const Pool& p) const {
    if (p.cache.granularity != kPerToken) return p.cache.decode_scale();
    return {p.scale.data(),
            DType::kFloat32,
            3,
            {num_blocks, kKvHeads, block, 0},
            hnd ? std::array<int64_t, 4>{kKvHeads * block, block, 1, 0}
                : std::array<int64_t, 4>{block * kKvHeads, 1, kKvHeads, 0}};
  }
  // The kvcache calls' (num_blocks, page_block_size, kv_heads, channels).
  TensorView kvcache_view(const Pool& p) const { return swap_axes_1_2(decode_view(p)); }
  TensorView kvcache_scale(const Pool& p) const {
    if (p.cache.granularity != kPerToken) return p.cache.kvcache_scale();
    return swap_axes_1_2(decode_scale(p));
  }
  TensorView table_view() const {
    return TensorView::contiguous(table.data(), DType::kInt32, {kSeqs, max_pages});
  }
  std::string describe() const {
    return "pages of " + std::to_string(block) + (hnd ? " HND" : " NHD");
  }
};

inline std::string describe(const LongCache& k, const LongCache& v) {
  return std::string("k ") + dtype_name(k.format) + " " + kGranularityNames[k.granularity] +
         ", v " + dtype_name(v.format) + " " + kGranularityNames[v.granularity];
}

}  // namespace
}  // namespace flashcte::test

#endif  // FLASHCTE_TESTS_KV8_LONG_CASES_H_
