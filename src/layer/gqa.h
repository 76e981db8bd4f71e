// GQA head sharding of the attention layer (shared/spec/LAYER.md section 4): how many query and
// KV heads exist after padding or replication for a tensor-parallel degree, which source head
// each padded head is, and the q/k/v/o projection weights one rank holds.
//
// The two strategies of optimum-neuron's `GQA` enum:
//   REPLICATE_TO_TP_DEGREE  K/V replicated until there is exactly one KV head per rank; Q padded
//                           *interleaved* (zero heads after each KV group) so that every query
//                           head stays on the rank of its KV head.
//   CONVERT_TO_MHA          K/V replicated until there is one KV head per query head; Q, K and V
//                           padded at the *tail*.
// The arithmetic is ON's `get_shardable_head_counts`; the weight transforms are its
// `replicate_kv`, `maybe_pad_interleaved` and `maybe_pad_tail` followed by NxD's row / column
// slicing (section 2). Everything works on the full, unsharded weights of one layer.
#ifndef FLASHCTE_SRC_LAYER_GQA_H_
#define FLASHCTE_SRC_LAYER_GQA_H_

#include <cstdint>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte::layer {

enum class GqaStrategy { kReplicateToTpDegree, kConvertToMha };

// ON's enum values: "replicate-to-tp-degree", "convert-to-mha".
const char* gqa_strategy_name(GqaStrategy strategy);

// The strategy ON picks (section 4, "Strategy choice"): REPLICATE_TO_TP_DEGREE when
// tp % num_kv_heads == 0, else CONVERT_TO_MHA. Arguments must be >= 1 (not checked here).
GqaStrategy choose_gqa_strategy(int64_t tp, int64_t num_kv_heads);

// The head layout of one layer at one tensor-parallel degree (LAYER.md notation in brackets).
struct GqaSharding {
  GqaStrategy strategy = GqaStrategy::kConvertToMha;
  int64_t tp = 1;
  int64_t num_heads = 0;          // H, from the model config
  int64_t num_kv_heads = 0;       // KV
  int64_t padded_heads = 0;       // H' = H rounded up to a multiple of tp
  int64_t padded_kv_heads = 0;    // KV'
  int64_t heads_per_rank = 0;     // h = H' / tp
  int64_t kv_heads_per_rank = 0;  // kv = KV' / tp
  int64_t n_rep = 0;              // h / kv: query heads per KV head on a rank
  // How often each source K/V head block is repeated, consecutively (1: no replication).
  int64_t kv_repeats = 1;
};

// ON's get_shardable_head_counts with the strategy it chooses itself.
Status plan_gqa_sharding(int64_t tp, int64_t num_heads, int64_t num_kv_heads, GqaSharding* out);

// The same with an explicit strategy (NxDI lets the caller ask for one). CONVERT_TO_MHA works for
// every configuration; REPLICATE_TO_TP_DEGREE needs tp % num_kv_heads == 0 whenever it has to
// replicate (LAYER.md section 9 item 4), and says so instead of producing ON's 0 repeats.
Status plan_gqa_sharding(int64_t tp, int64_t num_heads, int64_t num_kv_heads, GqaStrategy strategy,
                         GqaSharding* out);

// The source query head of padded query head `padded_head` (0-based, in [0, H')), or -1 for a
// zero pad head.
int64_t source_query_head(const GqaSharding& sharding, int64_t padded_head);
// The source KV head of padded KV head `padded_kv_head` (in [0, KV')), or -1 for a pad head.
int64_t source_kv_head(const GqaSharding& sharding, int64_t padded_kv_head);

// What rank `rank` of tp computes, head by head.
struct LocalHeads {
  std::vector<int64_t> query_heads;  // per local query head: the source query head, -1 for a pad
  std::vector<int64_t> kv_heads;     // per local KV head: the source KV head, -1 for a pad
  // Per local query head j: the local KV head it attends with, (j mod h) / n_rep (section 4).
  std::vector<int64_t> kv_of_query;
};
Status local_heads(const GqaSharding& sharding, int64_t rank, LocalHeads* out);

// Projection weights in torch.nn.Linear layout (out_features, in_features), float32 row-major.
// A head block is head_dim consecutive rows of q/k/v_proj and head_dim consecutive columns of
// o_proj. Optional vectors are empty when absent.
struct ProjectionWeights {
  std::vector<float> q_proj;  // (heads * head_dim, hidden)
  std::vector<float> k_proj;  // (kv_heads * head_dim, hidden)
  std::vector<float> v_proj;  // (kv_heads * head_dim, hidden)
  std::vector<float> o_proj;  // (hidden, heads * head_dim)
  std::vector<float> q_bias;  // (heads * head_dim)
  std::vector<float> k_bias;  // (kv_heads * head_dim)
  std::vector<float> v_bias;  // (kv_heads * head_dim)
  std::vector<float> o_bias;  // (hidden): never sharded, added once after the all-reduce
  std::vector<float> sinks;   // (heads): one learned sink logit per query head
};

// Section 4 steps 1-3 on the full weights: K/V replicated, Q/O (and K/V under CONVERT) padded.
// The result has H' query heads and KV' KV heads. Pad heads are zero in every weight, bias and
// sink; o_bias is copied. Under CONVERT with KV' == KV, K/V are left alone (the section 4 caveat
// about ON's negative pad length).
Status pad_weights(const GqaSharding& sharding, int64_t hidden_size, int64_t head_dim,
                   const ProjectionWeights& source, ProjectionWeights* padded);

// The weights rank `rank` holds: pad_weights, then the row block [r*h*D, (r+1)*h*D) of q_proj
// (rows [r*kv*D, ...) of k/v_proj), the column block [r*h*D, ...) of o_proj, the matching bias
// and sink slices (section 2). o_bias is the full vector on every rank: the caller adds it once,
// after summing the ranks' partial outputs.
Status shard_weights(const GqaSharding& sharding, int64_t hidden_size, int64_t head_dim,
                     const ProjectionWeights& source, int64_t rank, ProjectionWeights* local);

// The fused Wqkv of a rank (section 2, fused_qkv): rows [Q_r; K_r; V_r] of its local weights, so
// the local output splits at q_end = h*D and k_end = q_end + kv*D. The bias is fused the same
// way (not as ON's one contiguous block, see section 2's caveat); empty when `local` has none.
Status fuse_qkv(const GqaSharding& sharding, int64_t hidden_size, int64_t head_dim,
                const ProjectionWeights& local, std::vector<float>* wqkv, std::vector<float>* bqkv);

}  // namespace flashcte::layer

#endif  // FLASHCTE_SRC_LAYER_GQA_H_
