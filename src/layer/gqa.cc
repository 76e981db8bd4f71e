// GQA head sharding (src/layer/gqa.h, shared/spec/LAYER.md section 4).
//
// Every weight transform is expressed as one map from a target head to its source head (or to a
// zero pad head): source_query_head for Q/O and the sinks, source_kv_head for K/V. Padding,
// replication and the rank slicing then reduce to gathering D-row (or D-column) head blocks.
// This is the same function as ON's replicate_kv + maybe_pad_interleaved / maybe_pad_tail + NxD
// slicing, written as indices rather than tensor reshapes.
#include "src/layer/gqa.h"

#include <algorithm>
#include <string>

namespace flashcte::layer {
namespace {

// NxD pad.py get_number_of_extra_heads.
int64_t extra_heads(int64_t n, int64_t tp) { return n % tp == 0 ? 0 : tp - n % tp; }

Status check_size(const char* name, const std::vector<float>& v, int64_t expected,
                  const char* shape, bool optional) {
  if (optional && v.empty()) return Status::Ok();
  if (static_cast<int64_t>(v.size()) != expected) {
    return Status::Error(std::string(name) + ": expected " + shape + " = " +
                         std::to_string(expected) + " floats, got " +
                         std::to_string(static_cast<int64_t>(v.size())));
  }
  return Status::Ok();
}

Status check_weights(const GqaSharding& s, int64_t hidden, int64_t d, const ProjectionWeights& w) {
  if (hidden < 1) return Status::Error("hidden_size: must be >= 1, got " + std::to_string(hidden));
  if (d < 1) return Status::Error("head_dim: must be >= 1, got " + std::to_string(d));
  const int64_t q_rows = s.num_heads * d, kv_rows = s.num_kv_heads * d;
  const struct {
    const char* name;
    const std::vector<float>& v;
    int64_t size;
    const char* shape;
    bool optional;
  } checks[] = {
      {"q_proj", w.q_proj, q_rows * hidden, "(num_heads*head_dim, hidden_size)", false},
      {"k_proj", w.k_proj, kv_rows * hidden, "(num_kv_heads*head_dim, hidden_size)", false},
      {"v_proj", w.v_proj, kv_rows * hidden, "(num_kv_heads*head_dim, hidden_size)", false},
      {"o_proj", w.o_proj, hidden * q_rows, "(hidden_size, num_heads*head_dim)", false},
      {"q_bias", w.q_bias, q_rows, "(num_heads*head_dim)", true},
      {"k_bias", w.k_bias, kv_rows, "(num_kv_heads*head_dim)", true},
      {"v_bias", w.v_bias, kv_rows, "(num_kv_heads*head_dim)", true},
      {"o_bias", w.o_bias, hidden, "(hidden_size)", true},
      {"sinks", w.sinks, s.num_heads, "(num_heads)", true},
  };
  for (const auto& c : checks) {
    if (Status st = check_size(c.name, c.v, c.size, c.shape, c.optional); !st.ok) return st;
  }
  // qkv_proj_bias is one switch for the three projections (section 2).
  if (w.q_bias.empty() != w.k_bias.empty() || w.q_bias.empty() != w.v_bias.empty()) {
    return Status::Error("q_bias, k_bias, v_bias: give all three or none (qkv_proj_bias)");
  }
  return Status::Ok();
}

// Row blocks of `block` rows: target block t is source block sources[t], or zeros for -1.
// With block == head_dim and cols == hidden this gathers head blocks of a (heads*D, hidden)
// weight; with cols == 1 it does the same for a bias (block D) or a per-head vector (block 1).
std::vector<float> gather_rows(const std::vector<float>& src, int64_t block, int64_t cols,
                               const std::vector<int64_t>& sources) {
  if (src.empty()) return {};
  std::vector<float> out(sources.size() * block * cols, 0.0f);
  for (size_t t = 0; t < sources.size(); ++t) {
    if (sources[t] < 0) continue;
    const auto from = src.begin() + sources[t] * block * cols;
    std::copy(from, from + block * cols, out.begin() + t * block * cols);
  }
  return out;
}

// Column blocks of a (rows, source_heads*D) matrix: the o_proj counterpart of gather_rows.
std::vector<float> gather_cols(const std::vector<float>& src, int64_t rows, int64_t d,
                               int64_t source_heads, const std::vector<int64_t>& sources) {
  const int64_t in_cols = source_heads * d;
  const int64_t out_cols = static_cast<int64_t>(sources.size()) * d;
  std::vector<float> out(rows * out_cols, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (size_t t = 0; t < sources.size(); ++t) {
      if (sources[t] < 0) continue;
      const auto from = src.begin() + r * in_cols + sources[t] * d;
      std::copy(from, from + d, out.begin() + r * out_cols + t * d);
    }
  }
  return out;
}

// Source heads of the padded heads [first, first + count).
std::vector<int64_t> query_sources(const GqaSharding& s, int64_t first, int64_t count) {
  std::vector<int64_t> out(count);
  for (int64_t i = 0; i < count; ++i) out[i] = source_query_head(s, first + i);
  return out;
}
std::vector<int64_t> kv_sources(const GqaSharding& s, int64_t first, int64_t count) {
  std::vector<int64_t> out(count);
  for (int64_t i = 0; i < count; ++i) out[i] = source_kv_head(s, first + i);
  return out;
}

// The weights of a run of padded heads, given the source head of each (query_sources and
// kv_sources above): all of them for pad_weights, one rank's for shard_weights.
void gather_weights(const GqaSharding& s, int64_t hidden, int64_t d, const ProjectionWeights& w,
                    const std::vector<int64_t>& q, const std::vector<int64_t>& kv,
                    ProjectionWeights* out) {
  out->q_proj = gather_rows(w.q_proj, d, hidden, q);
  out->k_proj = gather_rows(w.k_proj, d, hidden, kv);
  out->v_proj = gather_rows(w.v_proj, d, hidden, kv);
  out->o_proj = gather_cols(w.o_proj, hidden, d, s.num_heads, q);
  out->q_bias = gather_rows(w.q_bias, d, 1, q);
  out->k_bias = gather_rows(w.k_bias, d, 1, kv);
  out->v_bias = gather_rows(w.v_bias, d, 1, kv);
  out->o_bias = w.o_bias;
  out->sinks = gather_rows(w.sinks, 1, 1, q);
}

}  // namespace

const char* gqa_strategy_name(GqaStrategy strategy) {
  return strategy == GqaStrategy::kReplicateToTpDegree ? "replicate-to-tp-degree"
                                                       : "convert-to-mha";
}

GqaStrategy choose_gqa_strategy(int64_t tp, int64_t num_kv_heads) {
  return tp % num_kv_heads == 0 ? GqaStrategy::kReplicateToTpDegree : GqaStrategy::kConvertToMha;
}

Status plan_gqa_sharding(int64_t tp, int64_t num_heads, int64_t num_kv_heads, GqaSharding* out) {
  if (tp < 1) return Status::Error("tp: must be >= 1, got " + std::to_string(tp));
  if (num_kv_heads < 1)
    return Status::Error("num_kv_heads: must be >= 1, got " + std::to_string(num_kv_heads));
  return plan_gqa_sharding(tp, num_heads, num_kv_heads, choose_gqa_strategy(tp, num_kv_heads), out);
}

Status plan_gqa_sharding(int64_t tp, int64_t num_heads, int64_t num_kv_heads, GqaStrategy strategy,
                         GqaSharding* out) {
  if (tp < 1) return Status::Error("tp: must be >= 1, got " + std::to_string(tp));
  if (num_heads < 1)
    return Status::Error("num_heads: must be >= 1, got " + std::to_string(num_heads));
  if (num_kv_heads < 1)
    return Status::Error("num_kv_heads: must be >= 1, got " + std::to_string(num_kv_heads));
  // Every query group reads one KV head (section 5's repeat_kv), so KV must divide H.
  if (num_heads % num_kv_heads != 0) {
    return Status::Error("num_kv_heads: must divide num_heads (" + std::to_string(num_heads) +
                         " % " + std::to_string(num_kv_heads) + " != 0)");
  }
  GqaSharding s;
  s.strategy = strategy;
  s.tp = tp;
  s.num_heads = num_heads;
  s.num_kv_heads = num_kv_heads;
  s.padded_heads = num_heads + extra_heads(num_heads, tp);
  s.padded_kv_heads = num_kv_heads;
  const bool replicate = strategy == GqaStrategy::kReplicateToTpDegree;
  if (num_heads == num_kv_heads) {  // MHA
    s.padded_kv_heads = s.padded_heads;
  } else if (num_kv_heads < tp || num_kv_heads % tp != 0) {
    s.padded_kv_heads = replicate ? tp : s.padded_heads;
  }
  if (s.padded_kv_heads != num_kv_heads) {
    // Section 4 step 1: tp / KV repeats for REPLICATE, H / KV for CONVERT.
    if (replicate && tp % num_kv_heads != 0) {
      return Status::Error(
          "num_kv_heads: REPLICATE_TO_TP_DEGREE replicates each KV head tp / num_kv_heads times "
          "and needs tp % num_kv_heads == 0 (tp " +
          std::to_string(tp) + ", num_kv_heads " + std::to_string(num_kv_heads) +
          "); use CONVERT_TO_MHA");
    }
    s.kv_repeats = replicate ? tp / num_kv_heads : num_heads / num_kv_heads;
  }
  // utils.divide asserts both (section 9 item 3); the rules above always satisfy them.
  s.heads_per_rank = s.padded_heads / tp;
  s.kv_heads_per_rank = s.padded_kv_heads / tp;
  s.n_rep = s.heads_per_rank / s.kv_heads_per_rank;
  if (s.padded_kv_heads % tp != 0 || s.n_rep * s.kv_heads_per_rank != s.heads_per_rank) {
    return Status::Error("num_kv_heads: no shardable head layout for tp " + std::to_string(tp));
  }
  *out = s;
  return Status::Ok();
}

int64_t source_query_head(const GqaSharding& s, int64_t j) {
  if (j < 0 || j >= s.padded_heads) return -1;
  if (s.strategy == GqaStrategy::kReplicateToTpDegree) {
    // maybe_pad_interleaved: KV groups of H/KV source heads, each followed by (H'-H)/KV zeros.
    const int64_t group = s.num_heads / s.num_kv_heads;
    const int64_t padded_group = s.padded_heads / s.num_kv_heads;
    const int64_t within = j % padded_group;
    return within < group ? (j / padded_group) * group + within : -1;
  }
  return j < s.num_heads ? j : -1;  // maybe_pad_tail
}

int64_t source_kv_head(const GqaSharding& s, int64_t m) {
  if (m < 0 || m >= s.padded_kv_heads) return -1;
  if (s.padded_kv_heads == s.num_kv_heads) return m;  // no replication, no padding
  // replicate_kv repeats each block consecutively; under CONVERT the H replicated heads are then
  // tail-padded up to H'.
  const int64_t m_source = m / s.kv_repeats;
  return m_source < s.num_kv_heads ? m_source : -1;
}

Status local_heads(const GqaSharding& s, int64_t rank, LocalHeads* out) {
  if (rank < 0 || rank >= s.tp) {
    return Status::Error("rank: must be in [0, tp) = [0, " + std::to_string(s.tp) + "), got " +
                         std::to_string(rank));
  }
  const int64_t h = s.heads_per_rank, kv = s.kv_heads_per_rank;
  out->query_heads = query_sources(s, rank * h, h);
  out->kv_heads = kv_sources(s, rank * kv, kv);
  out->kv_of_query.resize(h);
  for (int64_t j = 0; j < h; ++j) out->kv_of_query[j] = j / s.n_rep;
  return Status::Ok();
}

Status pad_weights(const GqaSharding& s, int64_t hidden, int64_t d, const ProjectionWeights& source,
                   ProjectionWeights* padded) {
  if (Status st = check_weights(s, hidden, d, source); !st.ok) return st;
  gather_weights(s, hidden, d, source, query_sources(s, 0, s.padded_heads),
                 kv_sources(s, 0, s.padded_kv_heads), padded);
  return Status::Ok();
}

Status shard_weights(const GqaSharding& s, int64_t hidden, int64_t d,
                     const ProjectionWeights& source, int64_t rank, ProjectionWeights* local) {
  if (Status st = check_weights(s, hidden, d, source); !st.ok) return st;
  LocalHeads heads;
  if (Status st = local_heads(s, rank, &heads); !st.ok) return st;
  gather_weights(s, hidden, d, source, heads.query_heads, heads.kv_heads, local);
  return Status::Ok();
}

Status fuse_qkv(const GqaSharding& s, int64_t hidden, int64_t d, const ProjectionWeights& local,
                std::vector<float>* wqkv, std::vector<float>* bqkv) {
  // `local` holds h query and kv KV heads: check it as a layer of that many heads.
  GqaSharding rank_shape = s;
  rank_shape.num_heads = s.heads_per_rank;
  rank_shape.num_kv_heads = s.kv_heads_per_rank;
  if (Status st = check_weights(rank_shape, hidden, d, local); !st.ok) return st;
  wqkv->clear();
  for (const auto* part : {&local.q_proj, &local.k_proj, &local.v_proj}) {
    wqkv->insert(wqkv->end(), part->begin(), part->end());
  }
  bqkv->clear();
  for (const auto* part : {&local.q_bias, &local.k_bias, &local.v_bias}) {
    bqkv->insert(bqkv->end(), part->begin(), part->end());
  }
  return Status::Ok();
}

}  // namespace flashcte::layer
