// flashcte layer: optimum-neuron's attention layer (NeuronAttentionBase, shared/spec/LAYER.md) on
// the CPU: QKV projections, optional per-head q/k RMSNorm, RoPE, the KV cache write, attention
// (prefill through attention_cte with the cached tokens as the prior; token generation through
// decode_attention), and the O projection.
//
// One call, AttentionLayer::forward(x, positions, cache), is NeuronAttentionBase.forward with
// the decoder model's cache write folded in. Errors come back as a Status naming the argument and
// the rule it broke; nothing here throws.
#ifndef FLASHCTE_LAYER_H_
#define FLASHCTE_LAYER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"

namespace flashcte {

// rope_scaling with rope_type "llama3" (LAYER.md section 3), with its defaults.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct LayerConfig {
  int64_t hidden_size = 0;
  int64_t num_heads = 0;     // query heads (H)
  int64_t num_kv_heads = 0;  // KV heads; must divide num_heads
  int64_t head_dim = 0;      // 0: hidden_size / num_heads (section 1, Construction)
  bool rope = true;          // false: a NoPE layer, Q and K are not rotated (section 3)
  double rope_theta = 10000.0;
  // Channels rotated: the first rotary_dim of each head, half-split within them (NeoX style, as
  // partial_rotary_factor models do); the rest pass through. 0: head_dim (section 3's case).
  int64_t rotary_dim = 0;
  std::optional<Llama3RopeScaling> rope_scaling;
  int64_t sliding_window = 0;  // 0: off; else key j is visible to query i when i - j < w
  double qk_scale = 0.0;       // 0: 1/sqrt(head_dim) (section 9 item 14: 0 means unset)
  bool qkv_bias = false;       // q/k/v_proj have biases (Qwen2)
  bool o_bias = false;         // o_proj has a bias
  bool qk_norm = false;        // per-head RMSNorm of Q and K along head_dim, before RoPE
  double qk_norm_eps = 1e-6;
  bool sinks = false;  // one learned, value-less, unscaled logit per query head (section 8)
  DType dtype = DType::kFloat32;  // activation dtype: float32, bfloat16 or float16
  // The KV cache's format: unset (or the activation dtype) holds K and V as the module does; an
  // 8-bit format (int8, float8_e4m3fn, float8_e5m2) holds each token's K and V row of each KV head
  // quantized with its own float32 scale, the row's largest finite |value| over the format's
  // largest (quantize_kv), halving a bf16 cache's bytes. Attention reads code x scale.
  std::optional<DType> kv_cache_dtype;
  // Tensor parallelism (LAYER.md section 4): the layer built as rank tp_rank of tp_degree holds
  // that rank's heads of the GQA-sharded weights (gqa_strategy, with ON's padding) and its
  // forward() returns the rank's partial o_proj output without o_bias: the caller sums the ranks'
  // outputs and adds o_bias once (the all-reduce). tp_degree 1: the whole layer, o_bias included.
  int64_t tp_degree = 1;
  int64_t tp_rank = 0;
  // ON's GQA enum; kAuto is ON's choice: REPLICATE_TO_TP_DEGREE when tp_degree is a multiple of
  // num_kv_heads, else CONVERT_TO_MHA. REPLICATE_TO_TP_DEGREE cannot shard every layout (it needs
  // tp_degree % num_kv_heads == 0 when it replicates); CONVERT_TO_MHA can.
  enum class GqaStrategy { kAuto, kReplicateToTpDegree, kConvertToMha };
  GqaStrategy gqa_strategy = GqaStrategy::kAuto;
};

// The config rank config.tp_rank of config.tp_degree runs (what AttentionLayer::config() returns
// for it): its query and KV heads after GQA sharding, head_dim resolved, o_bias off, tp_degree 1.
// The config itself when tp_degree is 1. Checks the config as AttentionLayer::create does.
Status rank_config(const LayerConfig& config, LayerConfig* rank);

// The heads rank config.tp_rank of config.tp_degree holds, numbered as the full layer's (LAYER.md
// section 4): per local query head its source query head, per local KV head its source KV head,
// -1 for a pad head (zero weights). A replicated KV head appears on each rank that holds it. The
// rank's shard of the weights (AttentionLayer::create_from_shard) is, in this order, these
// heads' blocks of head_dim rows of q_proj / k_proj / v_proj and of their biases, head_dim
// columns of o_proj and entries of sinks, zero for a pad head; q_norm and k_norm whole.
struct RankHeads {
  std::vector<int64_t> query_heads;
  std::vector<int64_t> kv_heads;
};
Status rank_heads(const LayerConfig& config, RankHeads* heads);

// torch.nn.Linear layout (out_features, in_features), float32 row-major. Optional parts are empty
// exactly when the config turns them off.
struct LayerWeights {
  std::vector<float> q_proj;                  // (num_heads * head_dim, hidden_size)
  std::vector<float> k_proj;                  // (num_kv_heads * head_dim, hidden_size)
  std::vector<float> v_proj;                  // (num_kv_heads * head_dim, hidden_size)
  std::vector<float> o_proj;                  // (hidden_size, num_heads * head_dim)
  std::vector<float> q_bias, k_bias, v_bias;  // qkv_bias: (num_heads or num_kv_heads) * head_dim
  std::vector<float> o_bias;                  // o_bias: (hidden_size)
  std::vector<float> q_norm, k_norm;          // qk_norm: (head_dim) each, shared by all heads
  std::vector<float> sinks;                   // sinks: (num_heads)
};

// The KV cache of one layer (LAYER.md section 7): K (after q/k norm and RoPE) and V in the
// activation dtype, zero-initialized, with the number of filled slots per sequence. In an 8-bit
// format (LayerConfig::kv_cache_dtype) each slot of each KV head also has a float32 scale per K
// and V, 1 until written. Either dense,
// each sequence its own (kv_heads, max_len, head_dim) rows, or a block pool a serving engine
// keeps: pages of block_size slots, (num_blocks, kv_heads, block_size, head_dim) each for K and V
// (vLLM's layout), which the sequences name through their block tables (assign). Sequences may
// name the same pages for a common prefix; those are read-only: a forward call that would write
// into a page another sequence names is refused before anything is written.
class KvCache {
 public:
  KvCache() = default;
  // A dense cache for `batch` sequences of up to `max_len` tokens of a layer with `kv_heads`
  // heads of `head_dim` channels in `dtype` (float32, bfloat16, float16 or an 8-bit format).
  static Status create(int64_t batch, int64_t kv_heads, int64_t max_len, int64_t head_dim,
                       DType dtype, KvCache* cache);
  // A block pool of `num_blocks` pages of `block_size` slots (any size from 1) for `batch`
  // sequences, each with no page until assign().
  static Status create_paged(int64_t batch, int64_t num_blocks, int64_t block_size,
                             int64_t kv_heads, int64_t head_dim, DType dtype, KvCache* cache);

  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }
  bool paged() const { return block_size_ > 0; }
  // Dense: slots per sequence. Paged: the most any sequence's pages hold now.
  int64_t max_len() const;
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  // The slots sequence b can hold: max_len (dense), its pages x block_size (paged).
  int64_t capacity(int64_t b) const;
  // Paged: sequence b's pages, in slot order (slot j is row j % block_size of pages[j /
  // block_size]).
  const std::vector<int32_t>& pages(int64_t b) const { return pages_[static_cast<size_t>(b)]; }
  // Paged: gives sequence b the pages `pages` (each in [0, num_blocks), none repeated) with
  // `length` slots already filled (<= pages x block_size): a new request (length 0), or one whose
  // prompt starts with another's pages (length: the shared prefix). Refused (the cache as it
  // was) on a dense cache, a page out of range or repeated, or a length past the pages.
  Status assign(int64_t b, const std::vector<int32_t>& pages, int64_t length);
  // Slots [0, length(b)) of sequence b hold tokens.
  int64_t length(int64_t b) const { return lengths_[static_cast<size_t>(b)]; }
  const std::vector<int64_t>& lengths() const { return lengths_; }
  // Forgets every token of sequence b (its slots, or pages, are reused by the next prompt).
  void reset(int64_t b) { lengths_[static_cast<size_t>(b)] = 0; }

  // Element views of the storage: dense (batch, kv_heads, max_len, head_dim); paged
  // (num_blocks, kv_heads, block_size, head_dim).
  const void* k_data() const { return k_.get(); }
  const void* v_data() const { return v_.get(); }
  void* k_data() { return k_.get(); }
  void* v_data() { return v_.get(); }
  // 8-bit caches: the scales of the storage's slots, dense (batch, kv_heads, max_len), paged
  // (num_blocks, kv_heads, block_size); element c of a slot stands for c x its scale. Null for a
  // float cache.
  const float* k_scale_data() const { return k_scale_.get(); }
  const float* v_scale_data() const { return v_scale_.get(); }
  float* k_scale_data() { return k_scale_.get(); }
  float* v_scale_data() { return v_scale_.get(); }

 private:
  friend class AttentionLayer;
  static Status allocate(int64_t rows, int64_t kv_heads, int64_t slots, int64_t head_dim,
                         DType dtype, KvCache* cache);
  int64_t batch_ = 0, kv_heads_ = 0, max_len_ = 0, head_dim_ = 0;
  int64_t num_blocks_ = 0, block_size_ = 0;  // paged only
  DType dtype_ = DType::kFloat32;
  // Large caches sit on transparent huge pages: a decode step streams all of them.
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, Free> k_, v_;
  std::unique_ptr<float[]> k_scale_, v_scale_;  // 8-bit only
  std::vector<int64_t> lengths_;
  std::vector<std::vector<int32_t>> pages_;  // paged: per sequence
};

class AttentionLayer {
 public:
  // Checks the config and the weights against it and converts the weights to the layout the
  // projections run on. The weights are rounded to the activation dtype (LAYER.md R1).
  static Status create(const LayerConfig& config, const LayerWeights& weights,
                       std::unique_ptr<AttentionLayer>* layer);
  // create() from the weights rank config.tp_rank holds rather than the full layer's, so that a
  // rank never holds the whole layer: `shard` is sized for rank_config(config) (its num_heads and
  // num_kv_heads; no o_bias past tp_degree 1, the caller adds it once after the sum) and laid out
  // by rank_heads(config). The layer is bitwise create()'s from the full weights.
  static Status create_from_shard(const LayerConfig& config, const LayerWeights& shard,
                                  std::unique_ptr<AttentionLayer>* layer);
  ~AttentionLayer();

  // The config this layer runs: with tp_degree > 1, the rank's (num_heads and num_kv_heads per
  // rank, o_bias off).
  const LayerConfig& config() const;
  int64_t head_dim() const;

  // A cache this layer accepts, for `batch` sequences of up to `max_len` tokens.
  Status new_cache(int64_t batch, int64_t max_len, KvCache* cache) const;
  // A block pool this layer accepts: `num_blocks` pages of `block_size` slots for `batch`
  // sequences, each given its pages by KvCache::assign.
  Status new_paged_cache(int64_t batch, int64_t num_blocks, int64_t block_size,
                         KvCache* cache) const;

  // NeuronAttentionBase.forward with the cache write folded in:
  //   x          (batch, T, hidden_size), float32 / bfloat16 / float16 (rounded to the activation
  //              dtype), any strides;
  //   positions  (batch, T) int64: the absolute position of each token. In each row they go up
  //              by 1 from one token to the next and start at most at the row's cache length
  //              (an earlier start rewrites the slots from there); below the sequence's
  //              capacity (max_len, or its pages); a paged row writes only pages no other
  //              sequence names;
  //   out        (batch, T, hidden_size) in the activation dtype.
  // Each token's K/V is written into the cache at its position, then every token attends to
  // every cached slot at a position <= its own (within the window; sinks add a value-less
  // logit). Calls with T <= kMaxDecodeTokens run on the decode kernel, longer ones (context
  // encoding, chunked prefill) on attention_cte with the cache as the prior, dense or paged
  // alike (results over pages are bitwise those over a dense cache). A call that fails leaves
  // the cache as it was. Thread count: num_threads (0: OpenMP's default).
  Status forward(const TensorView& x, const TensorView& positions, KvCache* cache,
                 const MutableTensorView& out, int num_threads = 0) const;

  // New tokens per sequence up to which forward() takes the decode kernel.
  static constexpr int64_t kMaxDecodeTokens = 16;

 private:
  struct Impl;
  explicit AttentionLayer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The GEMM library the projections run on and the kernels it uses, e.g.
// "OpenBLAS 0.3.21, core SkylakeX (set by flashcte: the detected Zen ...)". Loads it on first use.
std::string layer_gemm_backend();

// Another OpenBLAS for the projections, tried when the system's libopenblas.so.0 does not load:
// a shared library's path and the prefix of its symbols, e.g. scipy-openblas32's
// lib/libscipy_openblas.so and "scipy_" (scipy_cblas_sgemm, ...); the Python package sets that
// one when scipy-openblas32 is installed. OpenBLAS is loaded once per process, on the first
// projection or layer_gemm_backend(): a call after that changes nothing.
void set_layer_gemm_fallback(const std::string& path, const std::string& symbol_prefix);

}  // namespace flashcte

#endif  // FLASHCTE_LAYER_H_
