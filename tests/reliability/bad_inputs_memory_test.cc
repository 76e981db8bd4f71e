// Bad-input matrix for the C++ API (bad_inputs_test.cc), the rows of the outputs and the memory:
// statistics outputs, aliasing between outputs and inputs, null data with a non-empty shape,
// sizes past 2^63 on fake pointers (which would crash if validation touched memory before
// refusing), and tiles. Each row is one defect of the valid call of bad_inputs_call.h, refused
// with "<argument>: <rule>" without a byte written.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "flashcte/flashcte.h"
#include "tests/reliability/bad_inputs_call.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

constexpr int64_t kBig = int64_t{1} << 40;

}  // namespace

std::vector<Row> memory_rows() {
  return {
      // --- statistics ---
      {"cache_softmax_without_neg_max",
       [](Call& c) {
         c.with_stats();
         c.outputs.neg_max = MutableTensorView{};
       },
       "neg_max", "is required with cache_softmax"},
      {"cache_softmax_without_sum_recip",
       [](Call& c) {
         c.with_stats();
         c.outputs.sum_recip = MutableTensorView{};
       },
       "sum_recip", "is required with cache_softmax"},
      {"cache_softmax_without_any_stats", [](Call& c) { c.options.cache_softmax = true; },
       "neg_max", "is required with cache_softmax"},
      {"neg_max_without_cache_softmax",
       [](Call& c) {
         c.with_stats();
         c.options.cache_softmax = false;
       },
       "neg_max", "without cache_softmax"},
      {"neg_max_float16",
       [](Call& c) {
         c.with_stats();
         c.outputs.neg_max.dtype = DType::kFloat16;
       },
       "neg_max", "dtype must be float32"},
      {"neg_max_row_major_wrong_length",
       [](Call& c) {
         c.with_stats();
         c.outputs.neg_max.shape[1] = 7;
       },
       "neg_max", "must be (bs, Sq)"},
      {"sum_recip_rank1",
       [](Call& c) {
         c.with_stats();
         c.outputs.sum_recip.rank = 1;
       },
       "sum_recip", "must have rank 2 (bs, Sq) or rank 3"},
      {"neg_max_neuron_layout_sq_not_multiple_of_128",
       [](Call& c) {
         c.with_stats();
         c.outputs.neg_max.rank = 3;
         c.outputs.neg_max.shape = {2, 128, 0};
         c.outputs.neg_max.strides = {0, 0, 1};
       },
       "neg_max", "multiple of 128"},
      {"sum_recip_neuron_layout_wrong_shape",
       [](Call& c) {
         c.reset(with([](auto& s) { s.sq = 256; }));
         c.with_stats();
         // (bs, 64, 4) holds Sq elements per batch but is not (bs, 128, Sq/128).
         c.outputs.sum_recip =
             MutableTensorView::contiguous(c.sr_buf.data(), DType::kFloat32, {2, 64, 4});
       },
       "sum_recip", "must be (bs, 128, Sq/128)"},
      {"lse_rank3",
       [](Call& c) {
         c.outputs.lse.rank = 3;
         c.outputs.lse.shape = {2, 8, 1};
         c.outputs.lse.strides = {8, 1, 1};
       },
       "lse", "must have rank 2 (bs, Sq)"},
      {"lse_wrong_batch", [](Call& c) { c.outputs.lse.shape[0] = 3; }, "lse", "must be (bs, Sq)"},
      // --- aliasing ---
      {"out_aliases_q", [](Call& c) { c.outputs.out.data = const_cast<void*>(c.q.data); }, "out",
       "overlaps the input q"},
      {"out_overlaps_tail_of_v",
       [](Call& c) {
         // The last element of v is the first of out.
         c.outputs.out.data = static_cast<uint8_t*>(c.v_buf.data()) + (8 * 4 - 1) * 4;
       },
       "out", "overlaps the input v"},
      {"out_aliases_k_prior",
       [](Call& c) {
         c.with_prior();
         c.outputs.out.data = c.kp_buf.data();
       },
       "out", "overlaps the input k_prior"},
      {"lse_aliases_sink",
       [](Call& c) {
         c.with_sink();
         c.outputs.lse.data = c.sink_buf.data();
       },
       "lse", "overlaps the input sink"},
      {"out_aliases_key_bias",
       [](Call& c) {
         c.with_key_bias();
         c.outputs.out.data = c.kb_buf.data();
       },
       "out", "overlaps the input key_bias"},
      {"neg_max_aliases_alibi",
       [](Call& c) {
         c.with_alibi();
         c.with_stats();
         c.outputs.neg_max.data = c.alibi_buf.data();
       },
       "neg_max", "overlaps the input alibi_slopes"},
      {"lse_aliases_out", [](Call& c) { c.outputs.lse.data = c.out_buf.data(); }, "lse",
       "overlaps the output out"},
      {"sum_recip_aliases_neg_max",
       [](Call& c) {
         c.with_stats();
         c.outputs.sum_recip.data = c.nm_buf.data();
       },
       "sum_recip", "overlaps the output neg_max"},
      // --- null data with a non-empty shape ---
      {"q_null_data", [](Call& c) { c.q.data = nullptr; }, "q", "data is null"},
      {"v_null_data", [](Call& c) { c.v.data = nullptr; }, "v", "data is null"},
      {"out_null_data", [](Call& c) { c.outputs.out.data = nullptr; }, "out", "data is null"},
      {"lse_null_data", [](Call& c) { c.outputs.lse.data = nullptr; }, "lse", "data is null"},
      // --- sizes past 2^63, on fake pointers ---
      {"q_elements_overflow",
       [](Call& c) {
         c.q = TensorView{fake_pointer(1), DType::kFloat32, 3, {kBig, kBig, 4}, {kBig * 4, 4, 1}};
       },
       "q", "more elements than fit in 64 bits"},
      {"out_elements_overflow",
       [](Call& c) {
         c.outputs.out = MutableTensorView{
             const_cast<void*>(fake_pointer(2)), DType::kFloat32, 3, {2, kBig, kBig}, {1, 1, 1}};
       },
       "out", "more elements than fit in 64 bits"},
      {"k_strides_overflow",
       [](Call& c) {
         // (4 - 1) * 2^62 does not fit.
         c.k.data = fake_pointer(3);
         c.k.strides = {1, int64_t{1} << 62, 1};
       },
       "k", "addresses past 2^63 elements"},
      {"v_bytes_overflow",
       [](Call& c) {
         // The largest element offset, 10 * 2^58, fits in int64; 4 bytes per element do not.
         c.v = TensorView{fake_pointer(4),
                          DType::kFloat32,
                          3,
                          {1, 8, 4},
                          {0, int64_t{1} << 58, int64_t{1} << 58}};
       },
       "v", "addresses past 2^63 bytes"},
      {"k_prior_elements_overflow",
       [](Call& c) {
         c.with_prior();
         c.options.k_prior =
             TensorView{fake_pointer(5), DType::kFloat32, 3, {1, 4, int64_t{1} << 62}, {0, 1, 1}};
       },
       "k_prior", "more elements than fit in 64 bits"},
      // --- tiles ---
      {"q_block_negative", [](Call& c) { c.options.tiles.q_block = -1; }, "tiles.q_block",
       "must be in [0, 4096]"},
      {"q_block_too_large", [](Call& c) { c.options.tiles.q_block = 4097; }, "tiles.q_block",
       "must be in [0, 4096]"},
      {"kv_tile_too_large", [](Call& c) { c.options.tiles.kv_tile = 65537; }, "tiles.kv_tile",
       "must be in [0, 65536]"},
      {"section_negative", [](Call& c) { c.options.tiles.section = -8; }, "tiles.section",
       "must be in [0,"},
      {"section_not_multiple_of_kv_tile",
       [](Call& c) {
         c.options.tiles = TileConfig{8, 4, 10, 0};
       },
       "tiles.section", "must be a multiple of tiles.kv_tile"},
      {"section_threshold_negative", [](Call& c) { c.options.tiles.section_threshold = -1; },
       "tiles.section_threshold", "must be >= 0"},
  };
}

}  // namespace flashcte::test
