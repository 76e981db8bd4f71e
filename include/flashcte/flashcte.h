// flashcte: the Neuron `attention_cte` prefill flash-attention kernel, on the CPU.
//
// One entry point, `attention_cte`, computes exactly the function pinned down in
// shared/spec/SEMANTICS.md (every mode, any scale). Arguments carry the Neuron kernel's names and
// defaults. Tensors are passed as strided views; nothing is copied that the kernel does not need
// to repack per tile. Errors come back as a Status whose message names the argument and the rule
// it broke and whose kind says what it is about (a value, a dtype, memory); the library never
// throws across this header.
#ifndef FLASHCTE_FLASHCTE_H_
#define FLASHCTE_FLASHCTE_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace flashcte {

// Element types. Attention inputs are float32, bfloat16 or float16 (q, k, v, priors agree);
// int32/int64 appear only in packing bounds, positions and block tables. int8 and the OCP fp8
// formats float8_e4m3fn and float8_e5m2 are 8-bit KV cache formats (a prior's, a cache's), each
// element standing for its value times an fp32 scale (Options::k_prior_scale, kvcache.h).
enum class DType : int {
  kFloat32,
  kBFloat16,
  kFloat16,
  kInt32,
  kInt64,
  kInt8,
  kFloat8E4M3,
  kFloat8E5M2,
};

const char* dtype_name(DType dtype);
int dtype_size(DType dtype);

// Views hold up to rank 4: attention_cte's tensors are rank 3 (batch and heads folded, as in the
// Neuron kernel) or rank 4 (a batch of such problems), the decode and serving entry points' rank 4
// ((batch, heads, tokens, d) and FlashAttention's (batch, seqlen, heads, d)); each entry point
// checks the ranks it takes.
inline constexpr int kMaxRank = 4;

// The largest head dim any entry point accepts (q/k and v alike). MLA models use d = 576 with
// dv = 512; the per-thread scratch grows linearly with it.
inline constexpr int64_t kMaxHeadDim = 1024;

// A read-only strided view. Strides are in elements, not bytes. A view with rank 0 and null data
// is "absent" (the default of every optional argument).
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};

  bool present() const { return data != nullptr || rank != 0; }
  // A dense row-major view of `shape`.
  static TensorView contiguous(const void* data, DType dtype, const std::vector<int64_t>& shape);
};

// A writable strided view (outputs).
struct MutableTensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};

  bool present() const { return data != nullptr || rank != 0; }
  static MutableTensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape);
};

// Tiling of the flash recurrence. Zero means "choose for this machine". The Neuron kernel's
// values (q_block 128, kv_tile 512, sections of 8192 over a 10240 threshold) are accepted.
struct TileConfig {
  int64_t q_block = 0;  // query rows resident per work item (the Neuron Q group, 128 there)
  int64_t kv_tile = 0;  // KV columns per streamed tile (512 there)
  // KV columns per softmax section: the running max / alpha rescale happens once per section;
  // within a section the scores of all its tiles are computed first, as on Neuron. 0 = one tile.
  int64_t section = 0;
  // Sectioning only applies when the total KV length exceeds this; below it the whole KV axis
  // is one section (Neuron: 10240). 0 = always section.
  int64_t section_threshold = 0;
};

// Every `attention_cte` argument other than q, k, v and the outputs, with the kernel's defaults.
struct Options {
  float scale = 1.0f;
  bool causal_mask = true;
  // Prefix caching: keys are concat(k_prior[:, :prior_used_len], k) (same for values).
  // k_prior/v_prior are laid out like k/v: (bs_kv, d, S_prior) unless tp_k, v_prior (bs_kv,
  // S_prior, d).
  TensorView k_prior;
  TensorView v_prior;
  // Empty: all of S_prior is valid. One value: the kernel's single length for the whole batch.
  // bs_kv values: one per KV batch (an extension of the kernel).
  std::vector<int64_t> prior_used_len;
  // A paged prefix (a serving engine's KV cache): with this (bs_kv / kv_heads, max_blocks) int32
  // table, k_prior and v_prior are pools of pages (num_blocks, kv_heads, block_size, d / dv),
  // any block_size >= 1, and KV batch kv_b is head kv_b % kv_heads of sequence kv_b / kv_heads,
  // whose prior slot j is row j % block_size of page table[sequence, j / block_size]
  // (S_prior = max_blocks * block_size). Only the pages of the used prior are read, each in
  // [0, num_blocks). Results are bitwise those over the same rows in a dense prior.
  TensorView prior_block_table;
  // An 8-bit prior: k_prior / v_prior of int8, float8_e4m3fn or float8_e5m2 (else q's dtype),
  // whose element c stands for c x its float32 scale. Required with an 8-bit prior and refused
  // with a float one; K and V may differ in format and granularity:
  //   (1,)                                one scale for the whole prior
  //   (bs_kv,) dense, (kv_heads,) paged   one per KV batch / KV head
  //   the prior's shape without its channel axis, (bs_kv, S_prior) dense or (num_blocks,
  //   kv_heads, block_size) paged (in the prior's pages): one per slot, read like the prior
  // Each read scale (the first two) must be finite and > 0; per-slot scales are data. The prior
  // is read in place; its sections run on the float32 kernels (the native bfloat16 ones would
  // round the dequantized values), so bfloat16 prefill over an 8-bit prior widens there.
  TensorView k_prior_scale;
  TensorView v_prior_scale;
  TensorView sink;             // (bs, 1) float32: one extra logit per (batch*head), not scaled
  int64_t sliding_window = 0;  // 0: none; else keep the sw most recent positions (own included)
  bool tp_q = true;            // q is (bs, Sq, d); false: (bs, d, Sq)
  bool tp_k = false;           // k is (bs_kv, Skv, d); false: (bs_kv, d, Skv)
  bool tp_out = false;         // out is (bs, d, Sq); false: (bs, Sq, d)
  bool cache_softmax = false;  // also write neg_max and sum_recip (Outputs)
  std::optional<int64_t> cp_offset;      // global position of local query row 0
  std::optional<int64_t> global_cp_deg;  // context-parallel degree (strided slicing stride)
  bool cp_strided_q_slicing = false;     // local row i is global row cp_offset + i*global_cp_deg
  // Sequence packing: per query row, allowed concatenated-KV index range [bound_min, bound_max).
  // Shape (Sq, 1) or (Sq,), dtype int32, int64 or float32 (integral values).
  TensorView bound_min;
  TensorView bound_max;
  int num_threads = 0;  // 0: OpenMP's default
  TileConfig tiles;

  // --- Beyond the Neuron kernel: FlashAttention-family score modifiers and mask conveniences.
  // All combine with every mode above. Scores are built in this order:
  //   S = scale * q.k  ->  softcap  ->  + alibi  ->  + key_bias  ->  masks (-inf).
  float softcap = 0.0f;  // > 0: S -> softcap * tanh(S / softcap) (Gemma 2, Grok)
  // ALiBi: (bs,) or (bs, 1) float32, one slope per query (batch*head): S += -slope * |q_pos -
  // kv_pos| with the positions of SEMANTICS.md step 2.
  TensorView alibi_slopes;
  // Additive bias per key: (bs, L) float32 over the concatenated KV axis (L = the longest
  // prior_used_len + Skv); -inf masks a key. Row b reads its first prior_used_len(b) + Skv.
  TensorView key_bias;
  // FlashAttention's window_size = (left, right): key j is kept for query i only when
  // -left <= kv_pos - q_pos <= right; -1 is unbounded. Intersected with causal_mask (right 0)
  // and sliding_window (left sw - 1).
  int64_t window_left = -1;
  int64_t window_right = -1;
  // FlashAttention's causal alignment for Sq != Skv: the last query row sits at the position of
  // the last key, i.e. every query position moves by Skv - Sq (rows that end up before key 0
  // see nothing under causal). Added to the context-parallel positions.
  bool bottom_right = false;
};

// Outputs. `out` is required; the statistics are float32 and optional.
// neg_max / sum_recip: rank 3 (bs, 128, Sq/128) is the Neuron layout (element [b, p, g] is query
// row g*128 + p); rank 2 (bs, Sq) is row-major and works for any Sq. Both are required when
// Options::cache_softmax is set. lse: (bs, Sq), lse = max + log(sum) = -(neg_max +
// log(sum_recip)).
// A row with no unmasked key and no sink has output 0, neg_max = +inf, sum_recip = +inf and
// lse = -inf (the softmax of an empty row is defined as contributing nothing).
struct Outputs {
  MutableTensorView out;
  MutableTensorView neg_max;
  MutableTensorView sum_recip;
  MutableTensorView lse;
};

// What an error is about, for callers that raise typed errors (the Python binding raises
// ValueError, TypeError, MemoryError and RuntimeError for these, in this order).
enum class ErrorKind {
  kNone,      // no error
  kValue,     // an argument's shape, value or combination with another breaks a rule
  kDtype,     // an argument's dtype is not one the call takes
  kMemory,    // an allocation failed; the call wrote nothing
  kInternal,  // a library bug: please report it
};

struct [[nodiscard]] Status {
  bool ok = true;
  std::string message;  // "<argument>: <rule it broke>" when !ok
  ErrorKind kind = ErrorKind::kNone;

  static Status Ok() { return {}; }
  static Status Error(std::string message, ErrorKind kind = ErrorKind::kValue) {
    return {false, std::move(message), kind};
  }
  static Status DtypeError(std::string message) {
    return Error(std::move(message), ErrorKind::kDtype);
  }
  // The same error, its message followed by `suffix` (" (sequence 2)").
  Status with_suffix(const std::string& suffix) const { return {ok, message + suffix, kind}; }
};

// Computes attention_cte(q, k, v, ...) into `outputs`. Thread-safe; results are bitwise identical
// for any num_threads.
//
// Rank-4 q, k, v and out make a batch of independent problems along axis 0 in one call and one
// parallel region: entry b is the rank-3 call on entry b of every argument, bitwise. Every other
// tensor argument then has the batch axis first too (a stride of 0 shares one entry across the
// batch): k_prior / v_prior and their scales when dense, prior_block_table, sink, bound_min,
// bound_max, alibi_slopes, key_bias, neg_max, sum_recip and lse. A paged prior's pools, their
// scales and prior_used_len are shared. FlashAttention's (batch, seqlen, heads, d) is such a batch:
// (batch, heads, seqlen, d) through its strides, with tp_k. An error in one entry ends in " (batch
// entry b)", and nothing is written when any entry is refused. plan_attention takes the rank-3 form
// only.
Status attention_cte(const TensorView& q, const TensorView& k, const TensorView& v,
                     const Outputs& outputs, const Options& options = {});

// What the kernel would do for these inputs, without computing it. q, k and v may have null
// data (only shapes are read); bounds and priors' lengths are read when present.
struct PlanSummary {
  int64_t batch = 0;
  int64_t kv_batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_kv = 0;  // including the used prior
  int64_t head_dim = 0;
  int64_t value_dim = 0;
  TileConfig tiles;        // resolved
  int64_t q_blocks = 0;    // per batch
  int64_t kv_tiles = 0;    // per batch
  int64_t sections = 0;    // per batch
  int64_t kv_splits = 1;   // KV ranges per item (split when items are too few to share)
  int64_t work_items = 0;  // units handed to threads
  // (query sub-block, kv tile) pairs over all query batches, as the kernel plans them.
  int64_t tiles_full = 0;     // computed unmasked
  int64_t tiles_masked = 0;   // computed with an element-wise mask
  int64_t tiles_skipped = 0;  // never touched
  double flops_done = 0;      // 2 * (d + dv) * computed pairs (tile granularity)
  double flops_dense = 0;     // 2 * (d + dv) * Sq * Skv * bs
  double flops_useful = 0;    // over unmasked (query, key) pairs only
  int threads = 0;
};
Status plan_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const Options& options, PlanSummary* summary);

// Human-readable description of the SIMD target the dispatcher picked at run time.
std::string simd_target();

// The library's version, "MAJOR.MINOR.PATCH": CMakeLists.txt's project(VERSION), the one place it
// is written (the CLI's --version, the Python package's __version__ and its wheel read it too).
std::string version();

}  // namespace flashcte

#endif  // FLASHCTE_FLASHCTE_H_
