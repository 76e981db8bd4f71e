// Packing: the Q rows, K and V tiles of a work item from the caller's tensors (any dtype, any
// strides) into the micro-kernels' layouts (src/simd/ops.h, native_ops.h).
#include "src/kernel/pack.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "src/core/convert.h"

namespace flashcte::internal {
namespace {

// Rows pack_matrix converts at a time when it transposes them.
constexpr int64_t kRowBlock = 16;

// Copies the rows x cols matrix src(r, c) = base[r * row_stride + c * col_stride] (dtype) into
// dst[r * dst_row + c * dst_col] as float32. Runs along whichever source axis is contiguous go
// through the vector converter; the scatter into dst is then one scalar store per element.
// With `row_table`, row r starts at row_table[r] instead (base and row_stride unused): a paged
// prior's rows, gathered across its pages so that a transposing store still writes kRowBlock
// floats at a time when the pages are short (packed one page at a time, a 1024-token causal fp32
// prefill over pages of 1 slot took 38.9 ms against 29.2 dense on the Zen 5 EPYC, 2 threads).
void pack_matrix(const simd::Ops& ops, const void* base, DType dtype, int64_t row_stride,
                 int64_t col_stride, int64_t rows, int64_t cols, float* dst, int64_t dst_row,
                 int64_t dst_col, std::vector<float>& tmp,
                 const unsigned char* const* row_table = nullptr) {
  const char* bytes = static_cast<const char*>(base);
  const int64_t size = dtype_size(dtype);
  if (col_stride == 1 || row_stride != 1 || row_table != nullptr) {
    // Contiguous (or neither) along columns: convert row by row, kRowBlock rows at a time so a
    // transposing store (K: dst_row 1) writes kRowBlock consecutive floats, not one per line.
    if (tmp.size() < static_cast<size_t>(kRowBlock * cols)) tmp.resize(kRowBlock * cols);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int64_t n = std::min(kRowBlock, rows - r0);
      for (int64_t r = r0; r < r0 + n; ++r) {
        const char* src =
            row_table ? reinterpret_cast<const char*>(row_table[r]) : bytes + r * row_stride * size;
        float* row = dst_col == 1 ? dst + r * dst_row : &tmp[(r - r0) * cols];
        if (col_stride == 1) {
          ops.to_float(src, dtype, cols, row);
        } else {
          load_row_as_float(src, 0, col_stride, dtype, row, cols);
        }
      }
      if (dst_col == 1) continue;
      for (int64_t c = 0; c < cols; ++c) {
        float* out = dst + c * dst_col + r0 * dst_row;
        for (int64_t r = 0; r < n; ++r) out[r * dst_row] = tmp[r * cols + c];
      }
    }
    return;
  }
  // Contiguous along rows: convert column by column.
  if (tmp.size() < static_cast<size_t>(rows)) tmp.resize(rows);
  for (int64_t c = 0; c < cols; ++c) {
    const char* src = bytes + c * col_stride * size;
    float* out = dst + c * dst_col;
    if (dst_row == 1) {
      ops.to_float(src, dtype, rows, out);
      continue;
    }
    ops.to_float(src, dtype, rows, tmp.data());
    for (int64_t r = 0; r < rows; ++r) out[r * dst_row] = tmp[r];
  }
}

const void* element(const View3& t, DType dtype, int64_t b, int64_t row) {
  return static_cast<const char*>(t.data) +
         (b * t.batch_stride + row * t.row_stride) * dtype_size(dtype);
}

// The scales of prior keys [begin, end) of KV batch kv_b: one per KV batch or one per slot.
void prior_scales(const Problem& problem, const std::vector<float>& per_batch,
                  const KvSource& per_slot, int64_t kv_b, int64_t begin, int64_t end,
                  float* scales) {
  for (int64_t j = begin; j < end; ++j) {
    scales[j - begin] = per_slot.data != nullptr
                            ? *reinterpret_cast<const float*>(problem.prior_row(per_slot, kv_b, j))
                            : per_batch[static_cast<size_t>(kv_b)];
  }
}

// An 8-bit prior's packed codes of keys [begin, end) (key j at dst + (j - begin) * key_step,
// its channels channel_step apart) times their scales: one per KV batch or one per slot. The
// product is float32's rounding of code x scale, the dequantized cache's value.
void scale_prior_keys(const Problem& problem, const std::vector<float>& per_batch,
                      const KvSource& per_slot, int64_t kv_b, int64_t begin, int64_t end,
                      float* dst, int64_t key_step, int64_t channel_step, int64_t channels,
                      std::vector<float>& scales) {
  const int64_t n = end - begin;
  ensure(scales, static_cast<size_t>(n));
  prior_scales(problem, per_batch, per_slot, kv_b, begin, end, scales.data());
  if (key_step == 1) {  // K, transposed: a channel's keys are contiguous
    for (int64_t c = 0; c < channels; ++c) {
      float* row = dst + c * channel_step;
      for (int64_t j = 0; j < n; ++j) row[j] *= scales[j];
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    float* row = dst + j * key_step;
    for (int64_t c = 0; c < channels; ++c) row[c * channel_step] *= scales[j];
  }
}

// The packed codes of an 8-bit prior's keys [begin, end) (pack_kv's layout from `base`; V unless
// null) times their scales (read into `scales`): the dequantized cache's values. A prior in the
// problem's dtype is left as it is.
void dequantize_prior(const Problem& problem, int64_t kv_b, int64_t begin, int64_t end,
                      int64_t base, float* k, int64_t ldk, float* v, int64_t ldv,
                      std::vector<float>& scales) {
  if (problem.k_prior.dtype != problem.dtype) {
    scale_prior_keys(problem, problem.k_prior_scale, problem.k_prior_token_scale, kv_b, begin, end,
                     k + (begin - base), 1, ldk, problem.head_dim, scales);
  }
  if (v != nullptr && problem.v_prior.dtype != problem.dtype) {
    scale_prior_keys(problem, problem.v_prior_scale, problem.v_prior_token_scale, kv_b, begin, end,
                     v + (begin - base) * ldv, ldv, 1, problem.value_dim, scales);
  }
}

}  // namespace

// Packs keys [begin, end) of KV batch kv_b's concatenated axis: K transposed into
// k[c * ldk + (j - base)], V (unless null) into v[(j - base) * ldv + c]. An 8-bit prior's values
// are its codes times their scales, or with `codes_only` its codes alone.
void pack_kv(const Problem& problem, const simd::Ops& ops, int64_t kv_b, int64_t begin, int64_t end,
             int64_t base, float* k, int64_t ldk, float* v, int64_t ldv, Scratch& scratch,
             bool codes_only) {
  std::vector<float>& tmp = scratch.convert;
  const int64_t prior = problem.prior_used[kv_b];
  // The prior part [begin, min(end, prior)): a dense prior as one strided matrix, a paged one with
  // its rows' addresses gathered across the pages; then the new part [max(begin, prior), end).
  const KvSource& kp = problem.k_prior;
  const KvSource& vp = problem.v_prior;
  if (const int64_t prior_end = std::min(end, prior); begin < prior_end) {
    const int64_t n = prior_end - begin;
    if (kp.paged()) {
      std::vector<const unsigned char*>& rows = scratch.prior_rows;
      ensure(rows, static_cast<size_t>(n));
      for (int64_t j = begin; j < prior_end; ++j) rows[j - begin] = problem.prior_row(kp, kv_b, j);
      pack_matrix(ops, nullptr, kp.dtype, 0, kp.strides[3], n, problem.head_dim, k + (begin - base),
                  1, ldk, tmp, rows.data());
      if (v != nullptr) {
        for (int64_t j = begin; j < prior_end; ++j) {
          rows[j - begin] = problem.prior_row(vp, kv_b, j);
        }
        pack_matrix(ops, nullptr, vp.dtype, 0, vp.strides[3], n, problem.value_dim,
                    v + (begin - base) * ldv, ldv, 1, tmp, rows.data());
      }
    } else {
      pack_matrix(ops, problem.prior_row(kp, kv_b, begin), kp.dtype, kp.strides[2], kp.strides[3],
                  n, problem.head_dim, k + (begin - base), 1, ldk, tmp);
      if (v != nullptr) {
        pack_matrix(ops, problem.prior_row(vp, kv_b, begin), vp.dtype, vp.strides[2], vp.strides[3],
                    n, problem.value_dim, v + (begin - base) * ldv, ldv, 1, tmp);
      }
    }
    if (!codes_only) {
      dequantize_prior(problem, kv_b, begin, prior_end, base, k, ldk, v, ldv, scratch.prior_scales);
    }
  }
  if (const int64_t j0 = std::max(begin, prior); j0 < end) {
    const View3& kt = problem.k;
    const View3& vt = problem.v;
    pack_matrix(ops, element(kt, problem.dtype, kv_b, j0 - prior), problem.dtype, kt.row_stride,
                kt.col_stride, end - j0, problem.head_dim, k + (j0 - base), 1, ldk, tmp);
    if (v != nullptr) {
      pack_matrix(ops, element(vt, problem.dtype, kv_b, j0 - prior), problem.dtype, vt.row_stride,
                  vt.col_stride, end - j0, problem.value_dim, v + (j0 - base) * ldv, ldv, 1, tmp);
    }
  }
  // MM2 runs over the padded width: keep the padding zero (stale values could be NaN).
  for (int64_t j = begin; v != nullptr && j < end; ++j) {
    std::fill(v + (j - base) * ldv + problem.value_dim, v + (j - base + 1) * ldv, 0.0f);
  }
}

// Packs query rows [row0, row0 + rows) of batch b, multiplied by scale: (scale * q) . k differs
// from scale * (q . k) by one float32 rounding, and MM1's epilogue stays a plain store. With q2,
// also the unscaled rows as bfloat16 for the native path, whose MM1 scales its scores instead
// (a scaled bfloat16 Q would round every element once more). Returns whether q2's rows hold a
// subnormal, which the native kernels would flush.
bool pack_q(const Problem& problem, const simd::Ops& ops, int64_t b, int64_t row0, int64_t rows,
            float* q, uint16_t* q2, std::vector<float>& tmp) {
  const int64_t d = problem.head_dim, d2 = pair_dim(d);
  pack_matrix(ops, element(problem.q, problem.dtype, b, row0), problem.dtype, problem.q.row_stride,
              problem.q.col_stride, rows, d, q, d, 1, tmp);
  const bool subnormal = q2 && (ops.classify(q, rows * d) & simd::kSubnormal) != 0;
  for (int64_t r = 0; q2 && r < rows; ++r) {
    ops.narrow_bf16(q + r * d, d, q2 + r * d2);
    if (d2 != d) q2[r * d2 + d] = 0;
  }
  if (problem.scale != 1.0f) {
    for (int64_t i = 0; i < rows * d; ++i) q[i] *= problem.scale;
  }
  return subnormal;
}

// The section's packed float32 K and V again as bfloat16 pairs (simd/native_ops.h), exactly (they
// hold bfloat16 inputs). K pairs run along d, V pairs along the keys: a V pair that straddles the
// edge of a run of packed tiles takes zeros for the key outside it, so every pair MM2 can read is
// finite where its P is zero.
void pack_pairs(const Problem& problem, const simd::Ops& ops, const TileWork* tiles,
                int64_t num_tiles, int64_t sec_begin, const float* k, int64_t ldk, const float* v,
                int64_t ldv, uint32_t* k2, uint32_t* v2) {
  const int64_t d = problem.head_dim, pairs = pair_dim(d) / 2,
                dv_pad = simd::padded(problem.value_dim);
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t a = tiles[t].begin - sec_begin, n = tiles[t].end - tiles[t].begin;
    for (int64_t x = 0; x < pairs; ++x) {
      const float* odd_row = 2 * x + 1 < d ? k + (2 * x + 1) * ldk + a : nullptr;
      ops.interleave_bf16(k + 2 * x * ldk + a, odd_row, n, k2 + x * ldk + a);
    }
  }
  for_each_run(tiles, num_tiles, sec_begin, [&](int64_t a, int64_t b) {
    for (int64_t j = a / 2; 2 * j < b; ++j) {
      const float* even_row = 2 * j >= a ? v + 2 * j * ldv : nullptr;
      const float* odd_row = 2 * j + 1 < b ? v + (2 * j + 1) * ldv : nullptr;
      ops.interleave_bf16(even_row, odd_row, dv_pad, v2 + j * ldv);
    }
  });
}

bool can_pack_pairs_directly(const Problem& problem) {
  if (problem.dtype != DType::kBFloat16) return false;
  // K with the keys of a channel contiguous (the Neuron (d, Skv) layout), V with the channels of
  // a key contiguous ((Skv, dv)); the prior part, when there is one, alike (a paged prior keeps
  // a key's channels together, so it takes the float32 path).
  return problem.k.row_stride == 1 && problem.v.col_stride == 1 &&
         (!problem.has_prior() ||
          (!problem.prior_is_kv8() && !problem.k_prior.paged() && problem.k_prior.strides[2] == 1 &&
           problem.v_prior.strides[3] == 1));
}

bool pack_pairs_directly(const Problem& problem, const simd::Ops& ops, int64_t kv_b,
                         const TileWork* tiles, int64_t num_tiles, int64_t sec_begin, int64_t ldk,
                         int64_t ldv, uint32_t* k2, uint32_t* v2) {
  const int64_t d = problem.head_dim, pairs = pair_dim(d) / 2, dv = problem.value_dim;
  const int64_t dv_pad = simd::padded(dv), prior = problem.prior_used[kv_b];
  const int64_t size = dtype_size(problem.dtype);
  // Element (key j, channel c) of the concatenated axis (prior part, then new), as bfloat16 bits.
  auto at = [&](const KvSource& prior_part, const View3& new_part, int64_t j, int64_t c) {
    if (j < prior) {
      return reinterpret_cast<const uint16_t*>(problem.prior_row(prior_part, kv_b, j) +
                                               c * prior_part.strides[3] * size);
    }
    return reinterpret_cast<const uint16_t*>(static_cast<const char*>(new_part.data) +
                                             (kv_b * new_part.batch_stride +
                                              (j - prior) * new_part.row_stride +
                                              c * new_part.col_stride) *
                                                 size);
  };
  bool unusual = false;
  // K2[x][j] = (K[j][2x], K[j][2x + 1]): two channel rows, contiguous over the keys, paired;
  // each tile in its prior and its new part.
  for (int64_t t = 0; t < num_tiles; ++t) {
    for (int part = 0; part < 2; ++part) {
      const int64_t j0 = part == 0 ? tiles[t].begin : std::max(tiles[t].begin, prior);
      const int64_t j1 = part == 0 ? std::min(tiles[t].end, prior) : tiles[t].end;
      for (int64_t x = 0; x < pairs && j0 < j1; ++x) {
        const uint16_t* odd =
            2 * x + 1 < d ? at(problem.k_prior, problem.k, j0, 2 * x + 1) : nullptr;
        unusual |= ops.pair_bf16(at(problem.k_prior, problem.k, j0, 2 * x), odd, j1 - j0,
                                 k2 + x * ldk + (j0 - sec_begin));
      }
    }
  }
  // V2[j][c] = (V[2j][c], V[2j + 1][c]): two key rows paired, zeros for a key outside its run
  // (as pack_pairs) and for the padding columns.
  for_each_run(tiles, num_tiles, sec_begin, [&](int64_t a, int64_t b) {
    for (int64_t j = a / 2; 2 * j < b; ++j) {
      const uint16_t* even =
          2 * j >= a ? at(problem.v_prior, problem.v, sec_begin + 2 * j, 0) : nullptr;
      const uint16_t* odd =
          2 * j + 1 < b ? at(problem.v_prior, problem.v, sec_begin + 2 * j + 1, 0) : nullptr;
      unusual |= ops.pair_bf16(even, odd, dv, v2 + j * ldv);
      std::fill(v2 + j * ldv + dv, v2 + j * ldv + dv_pad, 0u);
    }
  });
  return unusual;
}

// Keys [begin, end) of float32 V, in place, where its rows already have MM2's layout (channels
// contiguous, no padding columns: W3 of simd/ops.h) and the keys lie in one part (prior or new)
// of the concatenated axis; null otherwise. In place against the copy, Zen 4 EPYC (AVX3), 2
// threads, fp32 MHA S=4096, medians of interleaved process pairs: d=128 non-causal 1.025 (10
// pairs), causal 1.009 (6), d=64 1.016 (6); the copy's reads from L3 mostly moved into MM2's.
// K keeps its copy: K in place too gained nothing more at Skv=4000 (0.999 against V alone, 6
// pairs) and less at 4096 (1.016 against the copy, 8 pairs), whose 16 KiB channel stride maps a
// K panel onto a few cache sets.
// Only rows that lie back to back (row stride dv) are read in place: FlashAttention's (batch, S,
// heads, dv) layout puts a head's rows heads * dv apart (4 KiB at 8 x 128 floats), and MM2 over
// rows 4 KiB apart ran slower than over the copy (AMD EPYC Zen 5, AVX3, 2 threads, a 2048-query
// chunk over an 8192-token prior, 32/8 heads, d = 128: the same rows copied from 16-slot pages
// 1.35x faster, 5 rounds, bench/paged_prefill.py).
const float* v_in_place(const Problem& problem, int64_t kv_b, int64_t begin, int64_t end,
                        int64_t* ldv) {
  const int64_t dv = problem.value_dim, prior = problem.prior_used[kv_b];
  if (problem.dtype != DType::kFloat32 || simd::padded(dv) != dv) return nullptr;
  if (begin < prior && end > prior) return nullptr;
  const float* rows = nullptr;
  if (begin < prior) {  // in the prior: within one run of its rows (one page of a paged prior)
    const KvSource& v = problem.v_prior;
    if (v.dtype != DType::kFloat32 || v.strides[3] != 1 || v.strides[2] != dv ||
        v.run_end(begin, end) != end)
      return nullptr;
    rows = reinterpret_cast<const float*>(problem.prior_row(v, kv_b, begin));
  } else {
    const View3& v = problem.v;
    if (v.col_stride != 1 || v.row_stride != dv) return nullptr;
    rows = static_cast<const float*>(element(v, problem.dtype, kv_b, begin - prior));
  }
  // Rows that start past a cache line (numpy's large arrays start 16 bytes past one) would make
  // every vector load of MM2 a split load: copied instead. AMD EPYC Zen 4 (AVX3), 2 threads, fp32
  // non-causal, 8 heads, S = 4096, d = 128, 21 interleaved rounds (bench/alignment.py): read in
  // place 16 bytes past a line 1.076x and 4 bytes past 1.041x the aligned call's time; copied:
  // see docs/benchmarks/README.md, "Alignment".
  if (reinterpret_cast<uintptr_t>(rows) % 64 != 0) return nullptr;
  *ldv = dv;
  return rows;
}

PackedSection pack_section(const Problem& problem, const simd::Ops& ops, const simd::NativeOps* dot,
                           int64_t kv_b, const SectionWork& section, int64_t ldk, int64_t ldv,
                           Scratch& scratch) {
  const TileWork* tiles = scratch.plan.tiles.data() + section.first_tile;
  const int64_t num_tiles = section.end_tile - section.first_tile;
  // An 8-bit prior's dequantized values (code x scale) are not bfloat16 values in general, but
  // its codes are: the native path packs the codes and scales the scores and P instead.
  const int64_t prior = problem.prior_used[kv_b];
  const bool kv8 = problem.prior_is_kv8() && section.begin < prior;
  PackedSection packed;
  packed.begin = section.begin;
  packed.ldk = ldk;
  packed.ldv = ldv;
  if (dot && can_pack_pairs_directly(problem) &&
      !pack_pairs_directly(problem, ops, kv_b, tiles, num_tiles, section.begin, ldk, ldv,
                           scratch.k2.data(), scratch.v2.data())) {
    packed.dot = dot;
    packed.k2 = scratch.k2.data();
    packed.v2 = scratch.v2.data();
    return packed;
  }
  // float32 only, so never on the native path, which pairs V from scratch.v.
  const float* v_tensor =
      v_in_place(problem, kv_b, section.begin, tiles[num_tiles - 1].end, &packed.ldv);
  packed.k = scratch.k.data();
  packed.v = v_tensor ? v_tensor : scratch.v.data();
  bool subnormal = false;
  for (int64_t t = 0; t < num_tiles; ++t) {
    pack_kv(problem, ops, kv_b, tiles[t].begin, tiles[t].end, section.begin, scratch.k.data(), ldk,
            v_tensor ? nullptr : scratch.v.data(), ldv, scratch, kv8 && dot != nullptr);
    // v_nonfinite matters on masked tiles only (section.cc); the native path's check reads all.
    if (!dot && !tiles[t].masked) continue;
    const int64_t off = tiles[t].begin - section.begin, n = tiles[t].end - tiles[t].begin;
    unsigned v_classes = 0;
    for (int64_t j = off; j < off + n; ++j) {
      v_classes |= ops.classify(packed.v + j * packed.ldv, problem.value_dim);
    }
    packed.v_nonfinite |= (v_classes & simd::kNonFinite) != 0;
    if (!dot) continue;
    subnormal |= (v_classes & simd::kSubnormal) != 0;
    for (int64_t x = 0; x < problem.head_dim; ++x) {
      subnormal |= (ops.classify(scratch.k.data() + x * ldk + off, n) & simd::kSubnormal) != 0;
    }
  }
  const int64_t width = tiles[num_tiles - 1].end - section.begin;
  const int64_t prior_end = std::min(prior, section.begin + width);
  if (!dot || packed.v_nonfinite || subnormal) {
    if (dot && kv8) {  // packed as codes for the native path: dequantize for the float32 one
      // Tile by tile: the keys between tiles were not packed (what pack_kv leaves without
      // codes_only).
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t end = std::min(tiles[t].end, prior_end);
        if (tiles[t].begin < end) {
          dequantize_prior(problem, kv_b, tiles[t].begin, end, section.begin, scratch.k.data(), ldk,
                           scratch.v.data(), ldv, scratch.prior_scales);
        }
      }
    }
    return packed;
  }
  pack_pairs(problem, ops, tiles, num_tiles, section.begin, scratch.k.data(), ldk, scratch.v.data(),
             ldv, scratch.k2.data(), scratch.v2.data());
  packed.dot = dot;
  packed.k2 = scratch.k2.data();
  packed.v2 = scratch.v2.data();
  if (kv8) {
    // Column j's scales: the prior's for keys before prior_end, 1 after.
    for (auto [src, per_batch, per_slot, scales, field] :
         {std::tuple{&problem.k_prior, &problem.k_prior_scale, &problem.k_prior_token_scale,
                     &scratch.k_col_scale, &packed.k_scale},
          std::tuple{&problem.v_prior, &problem.v_prior_scale, &problem.v_prior_token_scale,
                     &scratch.v_col_scale, &packed.v_scale}}) {
      if (src->dtype == problem.dtype) continue;  // this one is not 8-bit
      scales->assign(static_cast<size_t>(width), 1.0f);
      prior_scales(problem, *per_batch, *per_slot, kv_b, section.begin, prior_end, scales->data());
      *field = scales->data();
    }
  }
  return packed;
}

void reserve_pack_buffers(const Problem& problem, int64_t rows, int64_t keys, int64_t section,
                          bool native, Scratch& scratch) {
  const int64_t widest = std::max(problem.head_dim, problem.value_dim);
  ensure(scratch.convert, static_cast<size_t>(std::max({kRowBlock * widest, rows, keys})));
  if (problem.k_prior.paged()) ensure(scratch.prior_rows, static_cast<size_t>(keys));
  if (!problem.prior_is_kv8()) return;
  ensure(scratch.prior_scales, static_cast<size_t>(keys));
  if (!native) return;
  for (std::vector<float>* scales : {&scratch.k_col_scale, &scratch.v_col_scale}) {
    ensure(*scales, static_cast<size_t>(section));
  }
}

}  // namespace flashcte::internal
