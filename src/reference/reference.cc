// The oracle: shared/spec/SEMANTICS.md in float64, one score row at a time. Deliberately slow and
// plain: no tiling, no online softmax, no SIMD, and no code shared with the kernel, so that a bug
// in the kernel's argument handling or masking cannot be mirrored here.
#include "src/reference/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace flashcte::reference {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

bool is_float_type(DType t) {
  return t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16;
}

// A rank-3 tensor read as logical (batch, row, column) through element strides.
struct Reader3 {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t batch_stride = 0, row_stride = 0, col_stride = 0;
  double at(int64_t b, int64_t r, int64_t c) const {
    return load_element(data, dtype, b * batch_stride + r * row_stride + c * col_stride);
  }
};

// `t` read with logical axes (axis0, row_axis, col_axis).
Reader3 reader(const TensorView& t, int row_axis, int col_axis) {
  return {t.data, t.dtype, t.strides[0], t.strides[row_axis], t.strides[col_axis]};
}

// Everything the row loop needs, with the transposes undone and defaults resolved.
struct Problem {
  int64_t bs = 0, bs_kv = 0, sq = 0, skv = 0, d = 0, dv = 0, s_prior = 0;
  Reader3 q, k, v, k_prior, v_prior;  // q: (b, i, c); k, v and priors: (kv_b, j, c)
  std::vector<int64_t> prior_used;    // per KV batch
  bool has_sink = false;
  std::vector<double> sink;  // per query batch
  double scale = 1;
  bool causal = true;
  int64_t window = 0;
  int64_t cp_offset = 0, cp_stride = 1;
  bool packing = false;
  std::vector<double> bound_min, bound_max;  // per query row; float32 bounds are read as is
  // FlashAttention-family extensions (Options, after the Neuron arguments).
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  int64_t q_shift = 0;                          // Skv - Sq with bottom_right
  double softcap = 0;
  std::vector<double> alibi;  // per query batch, empty without ALiBi
  TensorView key_bias;        // (bs, L) float32, absent without

  int64_t q_pos(int64_t i) const { return cp_offset + i * cp_stride + q_shift; }
  int64_t kv_pos(int64_t kb, int64_t j) const { return j - prior_used[kb]; }

  // Key / value element of the concatenation concat(k_prior[:used], k).
  double key(int64_t kb, int64_t j, int64_t c) const {
    const int64_t used = prior_used[kb];
    return j < used ? k_prior.at(kb, j, c) : k.at(kb, j - used, c);
  }
  double value(int64_t kb, int64_t j, int64_t c) const {
    const int64_t used = prior_used[kb];
    return j < used ? v_prior.at(kb, j, c) : v.at(kb, j - used, c);
  }
  // SEMANTICS step 3.
  bool masked(int64_t kb, int64_t i, int64_t j) const {
    const int64_t diff = kv_pos(kb, j) - q_pos(i);
    if (causal && diff > 0) return true;
    if (window > 0 && diff <= -window) return true;
    if (window_left >= 0 && diff < -window_left) return true;
    if (window_right >= 0 && diff > window_right) return true;
    if (packing && (j < bound_min[i] || j >= bound_max[i])) return true;
    return false;
  }
};

// The score modifiers on a scaled score, in the documented order: softcap, ALiBi, key bias.
template <typename T>
T modified_score(const Problem& p, int64_t b, int64_t kb, int64_t i, int64_t j, T score) {
  if (p.softcap > 0) score = static_cast<T>(p.softcap * std::tanh(score / p.softcap));
  if (!p.alibi.empty()) {
    score +=
        static_cast<T>(-p.alibi[b] * std::abs(static_cast<double>(p.q_pos(i) - p.kv_pos(kb, j))));
  }
  if (p.key_bias.present()) {
    const TensorView& t = p.key_bias;
    score += static_cast<const float*>(t.data)[b * t.strides[0] + j * t.strides[1]];
  }
  return score;
}

Status error(const std::string& message) { return Status::Error("reference: " + message); }

// A (Sq, 1) or (Sq,) packing bound.
Status read_bound(const char* name, const TensorView& t, int64_t sq, std::vector<double>* out) {
  if (!(t.rank == 1 || (t.rank == 2 && t.shape[1] == 1)) || t.shape[0] != sq) {
    return error(std::string(name) + " must be (Sq, 1) or (Sq,)");
  }
  if (t.dtype != DType::kInt32 && t.dtype != DType::kInt64 && t.dtype != DType::kFloat32) {
    return error(std::string(name) + " must be int32, int64 or float32");
  }
  out->resize(sq);
  for (int64_t i = 0; i < sq; ++i) {
    const int64_t off = i * t.strides[0];
    if (t.dtype == DType::kInt32) {
      (*out)[i] = static_cast<const int32_t*>(t.data)[off];
    } else if (t.dtype == DType::kInt64) {
      (*out)[i] = static_cast<double>(static_cast<const int64_t*>(t.data)[off]);
    } else {
      (*out)[i] = static_cast<const float*>(t.data)[off];
    }
  }
  return Status::Ok();
}

// Prefix caching: the priors' layouts and the used lengths.
Status parse_prior(const Options& o, int k_row, int k_col, Problem* p) {
  p->prior_used.assign(p->bs_kv, 0);
  if (o.k_prior.present() || o.v_prior.present()) {
    const TensorView& kp = o.k_prior;
    const TensorView& vp = o.v_prior;
    if (kp.rank != 3 || vp.rank != 3) return error("k_prior and v_prior must have rank 3");
    if (!is_float_type(kp.dtype) || !is_float_type(vp.dtype)) {
      return error("k_prior and v_prior must be float32, bfloat16 or float16");
    }
    p->s_prior = kp.shape[k_row];
    if (kp.shape[0] != p->bs_kv || kp.shape[k_col] != p->d || vp.shape[0] != p->bs_kv ||
        vp.shape[1] != p->s_prior || vp.shape[2] != p->dv) {
      return error("k_prior / v_prior shapes disagree with k / v");
    }
    p->k_prior = reader(kp, k_row, k_col);
    p->v_prior = reader(vp, 1, 2);
    const auto& used = o.prior_used_len;
    if (!used.empty() && used.size() != 1 && static_cast<int64_t>(used.size()) != p->bs_kv) {
      return error("prior_used_len must hold 0, 1 or bs_kv values");
    }
    for (int64_t b = 0; b < p->bs_kv; ++b) {
      const int64_t u = used.empty() ? p->s_prior : used.size() == 1 ? used[0] : used[b];
      if (u < 0 || u > p->s_prior) return error("prior_used_len outside [0, S_prior]");
      p->prior_used[b] = u;
    }
  } else if (!o.prior_used_len.empty()) {
    return error("prior_used_len without k_prior / v_prior");
  }
  return Status::Ok();
}

// FlashAttention-style windows and the score modifiers.
Status parse_modifiers(const Options& o, Problem* p) {
  p->window_left = o.window_left;
  p->window_right = o.window_right;
  if (o.bottom_right) p->q_shift = p->skv - p->sq;
  p->softcap = o.softcap;
  if (o.alibi_slopes.present()) {
    const TensorView& t = o.alibi_slopes;
    if (t.dtype != DType::kFloat32 || t.shape[0] != p->bs) return error("alibi_slopes: (bs,)");
    for (int64_t b = 0; b < p->bs; ++b) {
      p->alibi.push_back(load_element(t.data, DType::kFloat32, b * t.strides[0]));
    }
  }
  if (o.key_bias.present()) {
    if (o.key_bias.dtype != DType::kFloat32 || o.key_bias.rank != 2) {
      return error("key_bias: (bs, L) float32");
    }
    p->key_bias = o.key_bias;
  }
  return Status::Ok();
}

// Undoes the layouts and checks only what the row loop needs to stay in bounds.
Status parse(const TensorView& q, const TensorView& k, const TensorView& v, const Options& o,
             Problem* p) {
  if (q.rank != 3 || k.rank != 3 || v.rank != 3) return error("q, k and v must have rank 3");
  if (!is_float_type(q.dtype) || !is_float_type(k.dtype) || !is_float_type(v.dtype)) {
    return error("q, k and v must be float32, bfloat16 or float16");
  }
  const int q_row = o.tp_q ? 1 : 2, q_col = o.tp_q ? 2 : 1;
  const int k_row = o.tp_k ? 1 : 2, k_col = o.tp_k ? 2 : 1;
  p->bs = q.shape[0];
  p->sq = q.shape[q_row];
  p->d = q.shape[q_col];
  p->bs_kv = k.shape[0];
  p->skv = k.shape[k_row];
  p->dv = v.shape[2];
  if (k.shape[k_col] != p->d) return error("k's head dim differs from q's");
  if (v.shape[0] != p->bs_kv || v.shape[1] != p->skv) return error("v must be (bs_kv, Skv, dv)");
  if (p->bs_kv <= 0 ? p->bs != 0 : p->bs % p->bs_kv != 0) {
    return error("bs must be a multiple of bs_kv");
  }
  p->q = reader(q, q_row, q_col);
  p->k = reader(k, k_row, k_col);
  p->v = reader(v, 1, 2);

  if (Status s = parse_prior(o, k_row, k_col, p); !s.ok) return s;

  if (o.sink.present()) {
    const TensorView& s = o.sink;
    if (s.dtype != DType::kFloat32 || !(s.rank == 1 || (s.rank == 2 && s.shape[1] == 1)) ||
        s.shape[0] != p->bs) {
      return error("sink must be float32 (bs, 1)");
    }
    p->has_sink = true;
    for (int64_t b = 0; b < p->bs; ++b) {
      p->sink.push_back(load_element(s.data, DType::kFloat32, b * s.strides[0]));
    }
  }

  p->scale = o.scale;
  p->causal = o.causal_mask;
  p->window = o.sliding_window;
  p->cp_offset = o.cp_offset.value_or(0);
  if (o.cp_strided_q_slicing) {
    if (!o.global_cp_deg) return error("cp_strided_q_slicing needs global_cp_deg");
    p->cp_stride = *o.global_cp_deg;
  }

  if (Status s = parse_modifiers(o, p); !s.ok) return s;

  if (o.bound_min.present() != o.bound_max.present()) {
    return error("bound_min and bound_max come together");
  }
  if (o.bound_min.present()) {
    p->packing = true;
    Status s = read_bound("bound_min", o.bound_min, p->sq, &p->bound_min);
    if (!s.ok) return s;
    s = read_bound("bound_max", o.bound_max, p->sq, &p->bound_max);
    if (!s.ok) return s;
  }
  return Status::Ok();
}

// Writes the statistics of row r of batch b, and zeroes its output, for a row with nothing to
// attend to (no unmasked key and no sink).
void write_empty_row(Result* res, int64_t b, int64_t r) {
  const int64_t row = b * res->seqlen_q + r;
  res->neg_max[row] = kInf;
  res->sum_recip[row] = kInf;
  res->lse[row] = -kInf;
  std::fill_n(res->out.begin() + row * res->value_dim, res->value_dim, 0.0);
}

void init_result(const Problem& p, int64_t rows, Result* res) {
  res->batch = p.bs;
  res->seqlen_q = rows;
  res->value_dim = p.dv;
  res->out.assign(p.bs * rows * p.dv, 0.0);
  res->neg_max.assign(p.bs * rows, 0.0);
  res->sum_recip.assign(p.bs * rows, 0.0);
  res->lse.assign(p.bs * rows, 0.0);
}

Status check_rows(const Problem& p, const std::vector<int64_t>& rows) {
  for (int64_t i : rows) {
    if (i < 0 || i >= p.sq) return error("row " + std::to_string(i) + " outside [0, Sq)");
  }
  return Status::Ok();
}

// SEMANTICS steps 2-7 in float64, one materialized score row per query row.
void compute_exact(const Problem& p, const std::vector<int64_t>& rows, Result* res) {
  init_result(p, rows.size(), res);
  const int64_t group = p.bs_kv > 0 ? p.bs / p.bs_kv : 1;  // bs_kv == 0 only when bs == 0
  std::vector<double> scores;
  for (int64_t b = 0; b < p.bs; ++b) {
    const int64_t kb = b / group;
    const int64_t total = p.prior_used[kb] + p.skv;
    for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
      const int64_t i = rows[r];
      scores.assign(total, -kInf);
      double max = p.has_sink ? p.sink[b] : -kInf;
      for (int64_t j = 0; j < total; ++j) {
        if (p.masked(kb, i, j)) continue;
        double dot = 0;
        for (int64_t c = 0; c < p.d; ++c) dot += p.q.at(b, i, c) * p.key(kb, j, c);
        scores[j] = modified_score(p, b, kb, i, j, p.scale * dot);
        max = std::max(max, scores[j]);
      }
      if (max == -kInf) {
        write_empty_row(res, b, r);
        continue;
      }
      double sum = p.has_sink ? std::exp(p.sink[b] - max) : 0.0;
      for (int64_t j = 0; j < total; ++j) {
        if (scores[j] != -kInf) sum += std::exp(scores[j] - max);
      }
      const int64_t row = b * res->seqlen_q + r;
      double* out = &res->out[row * p.dv];
      for (int64_t j = 0; j < total; ++j) {
        if (scores[j] == -kInf) continue;
        const double weight = std::exp(scores[j] - max) / sum;
        for (int64_t c = 0; c < p.dv; ++c) out[c] += weight * p.value(kb, j, c);
      }
      res->neg_max[row] = -max;
      res->sum_recip[row] = 1.0 / sum;
      res->lse[row] = max + std::log(sum);
    }
  }
}

// The same steps as a framework would run them in the input dtype without a flash kernel: float32
// arithmetic with a rounding to the dtype after Q.K^T (scaled), after the softmax and after P.V.
void compute_plain(const Problem& p, DType dtype, const std::vector<int64_t>& rows, Result* res) {
  const auto round = [dtype](float x) { return static_cast<float>(round_to_dtype(x, dtype)); };
  constexpr float kInfF = std::numeric_limits<float>::infinity();
  init_result(p, rows.size(), res);
  const int64_t group = p.bs_kv > 0 ? p.bs / p.bs_kv : 1;  // bs_kv == 0 only when bs == 0
  std::vector<float> scores, probs;
  std::vector<float> acc(p.dv);
  for (int64_t b = 0; b < p.bs; ++b) {
    const int64_t kb = b / group;
    const int64_t total = p.prior_used[kb] + p.skv;
    // In a framework the sink is one more column of the dtype-valued score matrix.
    const float sink = p.has_sink ? round(static_cast<float>(p.sink[b])) : -kInfF;
    for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
      const int64_t i = rows[r];
      scores.assign(total, -kInfF);
      float max = sink;
      for (int64_t j = 0; j < total; ++j) {
        if (p.masked(kb, i, j)) continue;
        float dot = 0;
        for (int64_t c = 0; c < p.d; ++c) {
          dot += static_cast<float>(p.q.at(b, i, c)) * static_cast<float>(p.key(kb, j, c));
        }
        scores[j] = round(modified_score(p, b, kb, i, j, dot * p.scale));
        max = std::max(max, scores[j]);
      }
      if (max == -kInfF) {
        write_empty_row(res, b, r);
        continue;
      }
      probs.assign(total, 0.0f);
      float sum = p.has_sink ? std::exp(sink - max) : 0.0f;
      for (int64_t j = 0; j < total; ++j) {
        if (scores[j] == -kInfF) continue;
        probs[j] = std::exp(scores[j] - max);
        sum += probs[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < total; ++j) {
        if (scores[j] == -kInfF) continue;
        const float weight = round(probs[j] / sum);
        for (int64_t c = 0; c < p.dv; ++c) {
          acc[c] += weight * static_cast<float>(p.value(kb, j, c));
        }
      }
      const int64_t row = b * res->seqlen_q + r;
      for (int64_t c = 0; c < p.dv; ++c) res->out[row * p.dv + c] = round(acc[c]);
      res->neg_max[row] = -max;
      res->sum_recip[row] = 1.0f / sum;
      res->lse[row] = max + std::log(sum);
    }
  }
}

std::vector<int64_t> all_rows(int64_t sq) {
  std::vector<int64_t> rows(sq);
  for (int64_t i = 0; i < sq; ++i) rows[i] = i;
  return rows;
}

}  // namespace

Status attention_rows(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Options& options, const std::vector<int64_t>& rows, Result* result) {
  Problem p;
  Status s = parse(q, k, v, options, &p);
  if (!s.ok) return s;
  if (s = check_rows(p, rows); !s.ok) return s;
  compute_exact(p, rows, result);
  return Status::Ok();
}

Status attention_plain_rows(const TensorView& q, const TensorView& k, const TensorView& v,
                            const Options& options, const std::vector<int64_t>& rows,
                            Result* result) {
  Problem p;
  Status s = parse(q, k, v, options, &p);
  if (!s.ok) return s;
  if (s = check_rows(p, rows); !s.ok) return s;
  compute_plain(p, q.dtype, rows, result);
  return Status::Ok();
}

Status attention(const TensorView& q, const TensorView& k, const TensorView& v,
                 const Options& options, Result* result) {
  const int64_t sq = q.rank == 3 ? q.shape[options.tp_q ? 1 : 2] : 0;
  return attention_rows(q, k, v, options, all_rows(sq), result);
}

Status attention_plain(const TensorView& q, const TensorView& k, const TensorView& v,
                       const Options& options, Result* result) {
  const int64_t sq = q.rank == 3 ? q.shape[options.tp_q ? 1 : 2] : 0;
  return attention_plain_rows(q, k, v, options, all_rows(sq), result);
}

}  // namespace flashcte::reference
