// 8-bit KV caches at long contexts (issue 41, item 4). Sequences of 2501, 2520 and 9001 slots
// cross two to eight of the decode kernel's 1024-slot chunk boundaries (each chunk parks a
// partial softmax state and merge() folds them in order, src/kernel/decode.h). Every 8-bit
// format (int8, float8_e4m3fn, float8_e5m2) x scale granularity (per tensor, per KV head, per
// token), dense and in pages of 1, 16 and 256 slots laid out HND (vLLM's (num_blocks, kv_heads,
// block, d)) and NHD (FlashAttention's (num_blocks, block, kv_heads, d)), on 1 and 3 threads:
//   Kv8LongDecode  decode_attention
//   Kv8LongVarlen  flash_attn_varlen_kvcache, the call under Python's paged_attention (whose
//                  kv_layout is a permutation of the pages' strides, as here): a mixed batch of
//                  two decoding sequences and a 20-query prefill chunk
//   Kv8LongAppend  flash_attn_with_kvcache appending new tokens into 8-bit caches, with rotary,
//                  cache_leftpad and cache_batch_idx (dense) or pages
// K and V always differ in format and granularity: K (format f, granularity g) with V (format
// f + 1, granularity g + 1), mod 3, so each of the nine format x granularity pairs is a K cache
// once and a V cache once.
//
// The oracle is the float64 reference (src/reference) on the dequantized cache: each element
// decoded by the test, reference::load_element of its code times its scale. The scales the test
// picks have 16-bit significands, so that product is exact in float32 (the reference's input
// dtype) and the oracle sees the exact dequantized values. Paged results must be bitwise the
// dense ones, and 3 threads bitwise 1 thread (decode.h and kvcache.h promise both).
//
// The append's codes and scales are checked against the test's own encoder, written from the
// spec in kvcache.h (quantize_kv): a per-token scale is the row's largest finite |value| over the
// format's largest value (127, 448, 57344), 1 for a zero row; each element becomes value / scale,
// divided in double, rounded to nearest even and saturated. Its rounding is the oracle's
// reference::round_to_dtype and its codes come from a table of all 256 codes decoded by
// reference::load_element; nothing of the library's encoder (quantize_kv, src/core/kv8.h) is used.
//
// Cost (Release, the shared 2-core AMD EPYC Zen 4): the whole file 5-6 s CPU idle (see each test),
// 17-23 s with two other builds running.
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
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int kThreadCounts[] = {1, 3};
constexpr int64_t kBlocks[] = {1, 16, 256};
const DType kFormats[] = {DType::kInt8, DType::kFloat8E4M3, DType::kFloat8E5M2};
enum Granularity { kPerTensor, kPerHead, kPerToken };
const char* const kGranularityNames[] = {"per tensor", "per KV head", "per token"};

// The code of slots no call may read: NaN in the fp8 formats; 127 in int8, which a NaN per-token
// scale makes NaN too and a shared scale a value far off the rest.
constexpr uint8_t kPoison = 0x7F;

// The largest finite value of a format, the divisor of a per-token scale (kvcache.h).
double format_max(DType format) {
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

const Codebook& codebook(DType format) {
  static const Codebook books[] = {Codebook(DType::kInt8), Codebook(DType::kFloat8E4M3),
                                   Codebook(DType::kFloat8E5M2)};
  return books[format == DType::kInt8 ? 0 : format == DType::kFloat8E4M3 ? 1 : 2];
}

// A scale with a 16-bit significand in [2^e, 2^(e + 1)): code x scale is exact in float32 (int8's
// 7 significant bits + 16 <= 24).
float short_scale(int e, std::mt19937& rng) {
  std::uniform_int_distribution<int> significand(1 << 15, (1 << 16) - 1);
  return static_cast<float>(std::ldexp(significand(rng), e - 15));
}

// 2^16 codes drawn from normal values (mean and sd in code units) through the test's encoder; a
// cache samples its codes from them (encoding every element of a 9001-slot cache would cost
// more than the calls under test).
std::vector<uint8_t> code_pool(DType format, double mean, double sd, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(mean, sd);
  std::vector<uint8_t> pool(size_t{1} << 16);
  for (uint8_t& code : pool) code = codebook(format).encode(normal(rng));
  return pool;
}

// Code magnitudes: K codes centred on 0, V codes with a positive mean, so that the outputs
// (weighted means of V rows) stay near max|V| / 2 and a tolerance relative to them is tight.
double code_sd(DType format) { return format == DType::kInt8 ? 40.0 : 100.0; }

template <class View>
View swap_axes_1_2(View t) {
  std::swap(t.shape[1], t.shape[2]);
  std::swap(t.strides[1], t.strides[2]);
  return t;
}

// Query values that float32, bfloat16 and float16 all hold exactly (8 significant bits,
// magnitudes in [2^-6, 3] or 0): one float64 reference serves q in every dtype.
double query_value(std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  const double r = reference::round_to_dtype(u(rng), DType::kBFloat16);
  return std::fabs(r) < 0x1p-6 ? 0.0 : r;
}

// Every element of got within tol of want, NaN-aware (abs_error): an element the kernel left at
// its NaN sentinel, or wrote as NaN or Inf, fails where the reference is finite.
::testing::AssertionResult within(const std::string& what, const std::vector<double>& got,
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

double max_abs(const std::vector<double>& x) {
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
double out_tolerance(DType dtype, double top, double top_v) {
  if (dtype == DType::kFloat32) return 1e-5 * top;
  return unit_roundoff(dtype) * (top + top_v) + 1e-5 * top;
}
double lse_tolerance(const std::vector<double>& lse) {
  return 1e-5 * std::max(1.0, max_abs(lse)) + 1e-5;
}

// The float64 oracle for one sequence: query rows q (q_heads, rows, d) in row-major order, row r
// seeing key slots [0, hi[r]) of key(h, j, x) / value(h, j, x) (kv_heads KV heads, GQA); appends
// out (q_heads, rows, dv) and lse (q_heads, rows) to *out / *lse.
template <class Key, class Value>
void reference_rows(const std::vector<double>& q, int64_t q_heads, int64_t rows, int64_t d,
                    const std::vector<int64_t>& hi, int64_t kv_heads, int64_t dv, const Key& key,
                    const Value& value, std::vector<double>* out, std::vector<double>* lse) {
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
std::vector<double> decoded(const std::vector<unsigned char>& bytes, DType dtype) {
  std::vector<double> v(bytes.size() / static_cast<size_t>(dtype_size(dtype)));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = reference::load_element(bytes.data(), dtype, static_cast<int64_t>(i));
  }
  return v;
}
std::vector<double> widened(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// Bitwise equality of two buffers (NaN scales of poisoned slots included), naming the first
// element that differs (EXPECT_EQ would print megabytes of cache).
template <class T>
::testing::AssertionResult same_bits(const std::vector<T>& got, const std::vector<T>& want) {
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

std::string describe(const LongCache& k, const LongCache& v) {
  return std::string("k ") + dtype_name(k.format) + " " + kGranularityNames[k.granularity] +
         ", v " + dtype_name(v.format) + " " + kGranularityNames[v.granularity];
}

// ---------------------------------------------------------------------------------------------
// decode_attention.

// kT query tokens per sequence at these positions, (kSeqs, kT): the last two slots of sequence 0;
// a slot in the middle and the last of sequence 1 (nine chunks); slot 1023, the first chunk's
// last, and the last slot of sequence 2. Query t sees slots [0, position].
constexpr int64_t kT = 2;
const std::vector<int64_t> kPositions = {2499, 2500, 5000, 9000, 1023, 2519};

// Query values (kSeqs, kQHeads, kT, kD), in q's dtype.
Tensor4 decode_queries(DType dtype, const std::vector<double>& values) {
  Tensor4 q(dtype, {kSeqs, kQHeads, kT, kD});
  size_t i = 0;
  for (int64_t b = 0; b < kSeqs; ++b) {
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t t = 0; t < kT; ++t) {
        for (int64_t x = 0; x < kD; ++x) q.set(b, h, t, x, values[i++]);
      }
    }
  }
  return q;
}

Outcome decode(const Tensor4& q, const TensorView& k, const TensorView& v, const TensorView& ks,
               const TensorView& vs, const TensorView& table, int threads) {
  Tensor4 out(q.view().dtype, {kSeqs, kQHeads, kT, kDv});
  out.fill_nan();
  Outcome r;
  r.lse = nan_floats(kSeqs * kQHeads * kT);
  DecodeOptions o;
  o.scale = static_cast<float>(1.0 / std::sqrt(double{kD}));
  o.k_scale = ks;
  o.v_scale = vs;
  o.block_table = table;
  o.num_threads = threads;
  DecodeOutputs outputs;
  outputs.out = out.mutable_view();
  outputs.lse = MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kSeqs, kQHeads, kT});
  r.status = decode_attention(q.view(), k, v,
                              TensorView::contiguous(kPositions.data(), DType::kInt64, {kSeqs, kT}),
                              outputs, o);
  r.out = out.bytes();
  return r;
}

// The oracle for every decode query: out (kSeqs, kQHeads, kT, kDv) and lse (kSeqs, kQHeads, kT),
// the layouts of the call's outputs.
void decode_reference(const std::vector<double>& q, const LongCache& kc, const LongCache& vc,
                      std::vector<double>* out, std::vector<double>* lse) {
  for (int64_t b = 0; b < kSeqs; ++b) {
    const std::vector<double> qb(q.begin() + b * kQHeads * kT * kD,
                                 q.begin() + (b + 1) * kQHeads * kT * kD);
    std::vector<int64_t> hi;
    for (int64_t t = 0; t < kT; ++t) hi.push_back(kPositions[static_cast<size_t>(b * kT + t)] + 1);
    reference_rows(
        qb, kQHeads, kT, kD, hi, kKvHeads, kDv,
        [&](int64_t h, int64_t j, int64_t x) { return kc.value(b, h, j, x); },
        [&](int64_t h, int64_t j, int64_t x) { return vc.value(b, h, j, x); }, out, lse);
  }
}

// The checks every format x granularity pair gets in one q dtype: `run(pages, threads)` (pages
// null for the dense caches) on 1 thread against the oracle, on 3 threads bitwise that, and on
// every page layout and thread count bitwise the dense result.
template <class Run>
void expect_dense_and_paged(const Run& run, const std::vector<LongPages>& pages, DType dtype,
                            const std::vector<double>& want_out,
                            const std::vector<double>& want_lse, double top, double top_v) {
  const Outcome dense = run(nullptr, 1);
  ASSERT_TRUE(dense.status.ok) << dense.status.message;
  EXPECT_TRUE(within("out", decoded(dense.out, dtype), want_out, out_tolerance(dtype, top, top_v)));
  EXPECT_TRUE(within("lse", widened(dense.lse), want_lse, lse_tolerance(want_lse)));
  const Outcome threads = run(nullptr, 3);
  ASSERT_TRUE(threads.status.ok) << threads.status.message;
  EXPECT_TRUE(same_bits(threads.out, dense.out)) << "3 threads";
  EXPECT_TRUE(same_bits(threads.lse, dense.lse)) << "3 threads";
  for (const LongPages& p : pages) {
    for (int n : kThreadCounts) {
      SCOPED_TRACE(p.describe() + ", " + std::to_string(n) + " threads");
      const Outcome paged = run(&p, n);
      ASSERT_TRUE(paged.status.ok) << paged.status.message;
      EXPECT_TRUE(same_bits(paged.out, dense.out));
      EXPECT_TRUE(same_bits(paged.lse, dense.lse));
    }
  }
}

// One format x granularity pair: the oracle once, then q in each dtype on the dense caches (1
// thread against the oracle, 3 threads bitwise it) and in six page layouts x 2 thread counts
// (bitwise the dense result). Measured: 1.3 s for the nine pairs.
TEST(Kv8LongDecode, EveryFormatGranularityLayoutBlockSizeAndThreadCount) {
  std::mt19937 rng(1);
  std::vector<double> q(static_cast<size_t>(kSeqs * kQHeads * kT * kD));
  for (double& x : q) x = query_value(rng);
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      const LongCache kc(kFormats[f], static_cast<Granularity>(g), kD, false, 10 + 3 * f + g);
      const LongCache vc(kFormats[(f + 1) % 3], static_cast<Granularity>((g + 1) % 3), kDv, true,
                         20 + 3 * f + g);
      SCOPED_TRACE(describe(kc, vc));
      std::vector<double> want_out, want_lse;
      decode_reference(q, kc, vc, &want_out, &want_lse);
      const double top = max_abs(want_out), top_v = vc.max_abs_value();
      std::vector<LongPages> pages;
      for (bool hnd : {true, false}) {
        for (int64_t block : kBlocks) pages.emplace_back(kc, vc, block, hnd, -1);
      }
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        SCOPED_TRACE(std::string("q ") + dtype_name(dtype));
        const Tensor4 qt = decode_queries(dtype, q);
        const auto run = [&](const LongPages* p, int threads) {
          return p ? decode(qt, p->decode_view(p->k), p->decode_view(p->v), p->decode_scale(p->k),
                            p->decode_scale(p->v), p->table_view(), threads)
                   : decode(qt, kc.decode_view(), vc.decode_view(), kc.decode_scale(),
                            vc.decode_scale(), {}, threads);
        };
        expect_dense_and_paged(run, pages, dtype, want_out, want_lse, top, top_v);
      }
    }
  }
}

// Every SIMD target this CPU runs (each has its own kernels and summation order, so each is held
// to the oracle, not to another target): the three formats, each once as K and once as V, with
// float32 and bfloat16 q; dense against the oracle, NHD pages of 16 on 3 threads bitwise dense.
// Measured: 0.6 s on five targets.
TEST(Kv8LongDecode, EverySimdTarget) {
  std::mt19937 rng(2);
  std::vector<double> q(static_cast<size_t>(kSeqs * kQHeads * kT * kD));
  for (double& x : q) x = query_value(rng);
  for (int f = 0; f < 3; ++f) {
    const LongCache kc(kFormats[f], static_cast<Granularity>(f), kD, false, 30 + f);
    const LongCache vc(kFormats[(f + 1) % 3], static_cast<Granularity>((f + 2) % 3), kDv, true,
                       40 + f);
    SCOPED_TRACE(describe(kc, vc));
    std::vector<double> want_out, want_lse;
    decode_reference(q, kc, vc, &want_out, &want_lse);
    const double top = max_abs(want_out), top_v = vc.max_abs_value();
    const LongPages p(kc, vc, 16, false, -1);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Tensor4 qt = decode_queries(dtype, q);
      for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
        hwy::SetSupportedTargetsForTest(target);
        SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", q " + dtype_name(dtype));
        const Outcome dense = decode(qt, kc.decode_view(), vc.decode_view(), kc.decode_scale(),
                                     vc.decode_scale(), {}, 1);
        ASSERT_TRUE(dense.status.ok) << dense.status.message;
        EXPECT_TRUE(
            within("out", decoded(dense.out, dtype), want_out, out_tolerance(dtype, top, top_v)));
        EXPECT_TRUE(within("lse", widened(dense.lse), want_lse, lse_tolerance(want_lse)));
        const Outcome paged = decode(qt, p.decode_view(p.k), p.decode_view(p.v),
                                     p.decode_scale(p.k), p.decode_scale(p.v), p.table_view(), 3);
        ASSERT_TRUE(paged.status.ok) << paged.status.message;
        EXPECT_TRUE(same_bits(paged.out, dense.out));
        EXPECT_TRUE(same_bits(paged.lse, dense.lse));
      }
      hwy::SetSupportedTargetsForTest(0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// flash_attn_varlen_kvcache (Python's paged_attention).

// A mixed batch over the same caches: one query for sequence 0, three for sequence 1 (both on
// the decode kernel), twenty for sequence 2 (more than kDecodeMaxQueries: attention_cte with the
// cache as its 8-bit prior). Each sequence's queries are its last tokens, bottom-right causal.
const std::vector<int32_t> kCuSeqlensQ = {0, 1, 4, 24};
constexpr int64_t kTotalQ = 24;

Outcome varlen(const HostTensor& q, const TensorView& k, const TensorView& v, const TensorView& ks,
               const TensorView& vs, const TensorView& table, int threads) {
  HostTensor out(q.dtype(), {kTotalQ, kQHeads, kDv});
  out.fill_sentinel();
  Outcome r;
  r.lse = nan_floats(kQHeads * kTotalQ);
  const std::vector<int32_t> used(kLen.begin(), kLen.end());
  VarlenKvCacheOptions o;
  o.cu_seqlens_q = TensorView::contiguous(kCuSeqlensQ.data(), DType::kInt32, {kSeqs + 1});
  o.seqused_k = TensorView::contiguous(used.data(), DType::kInt32, {kSeqs});
  o.block_table = table;
  o.k_scale = ks;
  o.v_scale = vs;
  o.causal = true;
  o.num_threads = threads;
  r.status = flash_attn_varlen_kvcache(
      q.view(), k, v, out.mutable_view(),
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {kQHeads, kTotalQ}), o);
  r.out = out.bytes();
  return r;
}

// The oracle in the call's layouts: out (total_q, heads, dv), lse (heads, total_q).
void varlen_reference(const std::vector<double>& q, const LongCache& kc, const LongCache& vc,
                      std::vector<double>* out, std::vector<double>* lse) {
  out->assign(static_cast<size_t>(kTotalQ * kQHeads * kDv), 0);
  lse->assign(static_cast<size_t>(kQHeads * kTotalQ), 0);
  for (int64_t b = 0; b < kSeqs; ++b) {
    const int64_t first = kCuSeqlensQ[b], rows = kCuSeqlensQ[b + 1] - first;
    std::vector<double> qb;  // (heads, rows, d)
    std::vector<int64_t> hi;
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t x = 0; x < kD; ++x) {
          qb.push_back(q[static_cast<size_t>(((first + r) * kQHeads + h) * kD + x)]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) hi.push_back(kLen[b] - rows + r + 1);
    std::vector<double> o, l;
    reference_rows(
        qb, kQHeads, rows, kD, hi, kKvHeads, kDv,
        [&](int64_t h, int64_t j, int64_t x) { return kc.value(b, h, j, x); },
        [&](int64_t h, int64_t j, int64_t x) { return vc.value(b, h, j, x); }, &o, &l);
    for (int64_t h = 0; h < kQHeads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t x = 0; x < kDv; ++x) {
          (*out)[static_cast<size_t>(((first + r) * kQHeads + h) * kDv + x)] =
              o[static_cast<size_t>((h * rows + r) * kDv + x)];
        }
        (*lse)[static_cast<size_t>(h * kTotalQ + first + r)] = l[static_cast<size_t>(h * rows + r)];
      }
    }
  }
}

// As Kv8LongDecode's test, through the serving call: every format x granularity pair, float32 and
// bfloat16 q, dense (FlashAttention's (batch, seqlen_cache, kv_heads, d) view of the same bytes)
// against the oracle, 3 threads and the six page layouts x 2 thread counts bitwise dense.
// Measured: 1.4 s.
TEST(Kv8LongVarlen, EveryFormatGranularityLayoutBlockSizeAndThreadCount) {
  std::mt19937 rng(3);
  std::vector<double> q(static_cast<size_t>(kTotalQ * kQHeads * kD));
  for (double& x : q) x = query_value(rng);
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      const LongCache kc(kFormats[f], static_cast<Granularity>(g), kD, false, 50 + 3 * f + g);
      const LongCache vc(kFormats[(f + 1) % 3], static_cast<Granularity>((g + 1) % 3), kDv, true,
                         60 + 3 * f + g);
      SCOPED_TRACE(describe(kc, vc));
      std::vector<double> want_out, want_lse;
      varlen_reference(q, kc, vc, &want_out, &want_lse);
      const double top = max_abs(want_out), top_v = vc.max_abs_value();
      std::vector<LongPages> pages;
      for (bool hnd : {true, false}) {
        for (int64_t block : kBlocks) pages.emplace_back(kc, vc, block, hnd, -2);
      }
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        SCOPED_TRACE(std::string("q ") + dtype_name(dtype));
        HostTensor qt(dtype, {kTotalQ, kQHeads, kD});
        for (int64_t i = 0; i < kTotalQ; ++i) {
          for (int64_t h = 0; h < kQHeads; ++h) {
            for (int64_t x = 0; x < kD; ++x) {
              qt.set(i, h, x, q[static_cast<size_t>((i * kQHeads + h) * kD + x)]);
            }
          }
        }
        const auto run = [&](const LongPages* p, int threads) {
          return p ? varlen(qt, p->kvcache_view(p->k), p->kvcache_view(p->v),
                            p->kvcache_scale(p->k), p->kvcache_scale(p->v), p->table_view(),
                            threads)
                   : varlen(qt, kc.kvcache_view(), vc.kvcache_view(), kc.kvcache_scale(),
                            vc.kvcache_scale(), {}, threads);
        };
        expect_dense_and_paged(run, pages, dtype, want_out, want_lse, top, top_v);
      }
    }
  }
}

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
RowInterval turned(std::vector<double> x, bool rotates, int64_t pos, bool interleaved,
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
::testing::AssertionResult check_row(DType format, const RowInterval& want, const uint8_t* got,
                                     bool per_token, float scale, float written_scale,
                                     int64_t* ambiguous) {
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

Outcome append(const AppendSetup& s, MutableTensorView k_cache, MutableTensorView v_cache,
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
void check_appended(const AppendCache& before, const AppendCache& after, const NewTokens& in,
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
void append_reference(const NewTokens& in, bool causal, bool interleaved, const Rotary& rotary,
                      const AppendCache& kc, const AppendCache& vc, std::vector<double>* out,
                      std::vector<double>* lse) {
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

// Every format x granularity pair, 3 new tokens (the decode kernel) and 20 (attention_cte over
// the cache as its prior), rotary (interleaved and GPT-NeoX, rotary_dim 48 of 72), left padding,
// causal and not; float32 and bfloat16 q, k, v. Dense with cache_batch_idx: the written codes and
// scales against the spec, nothing else written, the float32 attention against the oracle (the
// bfloat16 call must write the same codes: its inputs hold the same values; its turned q rounds
// to bfloat16, which the oracle cannot reproduce exactly, so its output is held to the float32
// call's by the paged and thread checks only), 3 threads bitwise 1. Paged (1, 16, 256 slots; NHD
// and HND; 1 and 3 threads): the output bitwise the dense call's, the pool afterwards exactly the
// dense cache's rows in pages. Measured: 3 s.
TEST(Kv8LongAppend, RotaryLeftpadBatchIdxAndPagesWriteTheSpecsCodes) {
  const Rotary rotary;
  int64_t ambiguous = 0, checked = 0;
  for (int f = 0; f < 3; ++f) {
    for (int g = 0; g < 3; ++g) {
      const AppendCache k0(kFormats[f], static_cast<Granularity>(g), kD, 70 + 3 * f + g);
      const AppendCache v0(kFormats[(f + 1) % 3], static_cast<Granularity>((g + 1) % 3), kDv,
                           80 + 3 * f + g);
      const bool causal = (f + g) % 2 == 0, interleaved = g != 1;
      SCOPED_TRACE(std::string("k ") + dtype_name(k0.format) + " " + kGranularityNames[g] + ", v " +
                   dtype_name(v0.format) + " " + kGranularityNames[(g + 1) % 3] +
                   (causal ? ", causal" : ", not causal") +
                   (interleaved ? ", interleaved" : ", GPT-NeoX rotary"));
      for (int64_t tokens : {3, 20}) {
        SCOPED_TRACE(std::to_string(tokens) + " new tokens");
        const NewTokens in(tokens, static_cast<uint32_t>(90 + 3 * f + g + tokens));
        AppendCache k32 = k0, v32 = v0;  // the float32 call's caches, for the bfloat16 call's
        for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          SCOPED_TRACE(std::string("q, k, v ") + dtype_name(dtype));
          const Tensor4 q = in.tensor(dtype, in.q, kAHeads, kD);
          const Tensor4 k = in.tensor(dtype, in.k, kKvHeads, kD);
          const Tensor4 v = in.tensor(dtype, in.v, kKvHeads, kDv);
          const AppendSetup setup{causal, interleaved, rotary, q, k, v};
          AppendCache kd = k0, vd = v0;
          const Outcome dense =
              append(setup, kd.view(), vd.view(), kd.scale_view(), vd.scale_view(), {}, 1);
          ASSERT_TRUE(dense.status.ok) << dense.status.message;
          if (dtype == DType::kFloat32) {
            check_appended(k0, kd, in, true, interleaved, rotary, &ambiguous);
            check_appended(v0, vd, in, false, interleaved, rotary, &ambiguous);
            checked += kABatch * tokens * kKvHeads * (kD + kDv);
            std::vector<double> want_out, want_lse;
            append_reference(in, causal, interleaved, rotary, kd, vd, &want_out, &want_lse);
            EXPECT_TRUE(
                within("out", decoded(dense.out, dtype), want_out, 1e-5 * max_abs(want_out)));
            EXPECT_TRUE(within("lse", widened(dense.lse), want_lse, lse_tolerance(want_lse)));
            k32 = kd;
            v32 = vd;
          } else {
            EXPECT_TRUE(same_bits(kd.codes, k32.codes)) << "k codes of the bfloat16 call";
            EXPECT_TRUE(same_bits(kd.scale, k32.scale)) << "k scales of the bfloat16 call";
            EXPECT_TRUE(same_bits(vd.codes, v32.codes)) << "v codes of the bfloat16 call";
            EXPECT_TRUE(same_bits(vd.scale, v32.scale)) << "v scales of the bfloat16 call";
          }
          AppendCache kt = k0, vt = v0;
          const Outcome threads =
              append(setup, kt.view(), vt.view(), kt.scale_view(), vt.scale_view(), {}, 3);
          ASSERT_TRUE(threads.status.ok) << threads.status.message;
          EXPECT_TRUE(same_bits(threads.out, dense.out)) << "3 threads";
          EXPECT_TRUE(same_bits(threads.lse, dense.lse)) << "3 threads";
          EXPECT_TRUE(same_bits(kt.codes, kd.codes)) << "3 threads";
          EXPECT_TRUE(same_bits(vt.codes, vd.codes)) << "3 threads";
          EXPECT_TRUE(same_bits(kt.scale, kd.scale)) << "3 threads";
          EXPECT_TRUE(same_bits(vt.scale, vd.scale)) << "3 threads";
          for (int64_t block : kBlocks) {
            const AppendTable table(block, tokens);
            for (bool hnd : {false, true}) {
              // What the pools must hold afterwards: the dense caches' rows after the call.
              const AppendPool k_want(table, hnd, kd), v_want(table, hnd, vd);
              for (int n : kThreadCounts) {
                SCOPED_TRACE("pages of " + std::to_string(block) + (hnd ? " HND, " : " NHD, ") +
                             std::to_string(n) + " threads");
                AppendPool kp(table, hnd, k0), vp(table, hnd, v0);
                const Outcome paged = append(setup, kp.view(), vp.view(), kp.scale_view(),
                                             vp.scale_view(), table.view(), n);
                ASSERT_TRUE(paged.status.ok) << paged.status.message;
                EXPECT_TRUE(same_bits(paged.out, dense.out));
                EXPECT_TRUE(same_bits(paged.lse, dense.lse));
                EXPECT_TRUE(same_bits(kp.codes, k_want.codes));
                EXPECT_TRUE(same_bits(vp.codes, v_want.codes));
                EXPECT_TRUE(same_bits(kp.scale, k_want.scale));
                EXPECT_TRUE(same_bits(vp.scale, v_want.scale));
              }
            }
          }
        }
      }
    }
  }
  // Turned channels whose float32 value may round either way: a handful of the codes checked.
  RecordProperty("ambiguous_codes", std::to_string(ambiguous) + " of " + std::to_string(checked));
  EXPECT_LE(ambiguous * 1000, checked) << "the intervals are too wide to check the codes";
}

}  // namespace
}  // namespace flashcte::test
