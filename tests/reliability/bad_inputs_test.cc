// Bad-input matrix for the C++ API: a table of invalid attention_cte calls, each differing from a
// valid call by one defect. Every row must come back !ok with "<argument>: <rule>", and must not
// write a byte anywhere: every buffer of the call (inputs and outputs, with a margin on both
// sides of each) holds a canary pattern that is compared before and after. Rows that use fake
// pointers with huge shapes would crash if validation touched memory before refusing.
// The call and the row: bad_inputs_call.h; the rows of statistics, aliasing, null data, huge sizes
// and tiles: bad_inputs_memory_test.cc.
#include <gtest/gtest.h>

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

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Every row: one defect of a valid call.
std::vector<Row> api_rows() {
  std::vector<Row> rows = {
      // --- presence and rank ---
      {"q_absent", [](Call& c) { c.q = TensorView{}; }, "q", "is required"},
      {"k_absent", [](Call& c) { c.k = TensorView{}; }, "k", "is required"},
      {"v_absent", [](Call& c) { c.v = TensorView{}; }, "v", "is required"},
      {"out_absent", [](Call& c) { c.outputs.out = MutableTensorView{}; }, "out", "is required"},
      {"q_rank2", [](Call& c) { c.q.rank = 2; }, "q", "must have rank 3"},
      {"q_rank1", [](Call& c) { c.q.rank = 1; }, "q", "must have rank 3"},
      {"k_rank4", [](Call& c) { c.k.rank = 4; }, "k", "must have rank 3"},
      {"k_rank5", [](Call& c) { c.k.rank = 5; }, "k", "rank must be 1 to 4"},
      {"v_rank0_with_data", [](Call& c) { c.v.rank = 0; }, "v", "rank must be 1 to 4"},
      {"v_rank_negative", [](Call& c) { c.v.rank = -1; }, "v", "rank must be 1 to 4"},
      {"out_rank2", [](Call& c) { c.outputs.out.rank = 2; }, "out", "must have rank 3"},
      // --- dtypes ---
      {"q_int32", [](Call& c) { c.q.dtype = DType::kInt32; }, "q", "dtype must be float32"},
      {"q_dtype_out_of_enum", [](Call& c) { c.q.dtype = static_cast<DType>(42); }, "q",
       "dtype must be float32"},
      {"k_float16_q_float32", [](Call& c) { c.k.dtype = DType::kFloat16; }, "k",
       "differs from q's dtype"},
      {"v_bfloat16_q_float32", [](Call& c) { c.v.dtype = DType::kBFloat16; }, "v",
       "differs from q's dtype"},
      {"out_dtype_differs", [](Call& c) { c.outputs.out.dtype = DType::kFloat16; }, "out",
       "must be q's dtype"},
      // --- shapes ---
      {"bs_not_multiple_of_bs_kv",
       [](Call& c) { c.reset(with([](auto& s) { s.bs = 3, s.bs_kv = 2; })); }, "q",
       "must be a multiple of k's bs_kv"},
      {"bs_kv_zero", [](Call& c) { c.reset(with([](auto& s) { s.bs_kv = 0; })); }, "k",
       "bs_kv is 0"},
      {"head_dim_zero", [](Call& c) { c.reset(with([](auto& s) { s.d = 0; })); }, "q",
       "must be in [1, 1024]"},
      {"head_dim_1025", [](Call& c) { c.reset(with([](auto& s) { s.d = 1025; })); }, "q",
       "must be in [1, 1024]"},
      {"value_dim_zero", [](Call& c) { c.reset(with([](auto& s) { s.dv = 0; })); }, "v",
       "must be in [1, 1024]"},
      {"value_dim_1025", [](Call& c) { c.reset(with([](auto& s) { s.dv = 1025; })); }, "v",
       "must be in [1, 1024]"},
      {"k_head_dim_differs", [](Call& c) { c.k.shape[1] = 3; }, "k", "differs from q's d"},
      {"k_head_dim_differs_tp_k",
       [](Call& c) {
         c.options.tp_k = true;  // k (1, 4, 8) now reads as (bs_kv, Skv=4, d=8)
       },
       "k", "differs from q's d"},
      {"v_seqlen_differs", [](Call& c) { c.v.shape[1] = 7; }, "v", "must be (bs_kv, Skv, dv)"},
      {"v_batch_differs", [](Call& c) { c.v.shape[0] = 2; }, "v", "must be (bs_kv, Skv, dv)"},
      {"out_seqlen_differs", [](Call& c) { c.outputs.out.shape[1] = 7; }, "out", "expected Sq"},
      {"out_batch_differs", [](Call& c) { c.outputs.out.shape[0] = 1; }, "out", "expected bs"},
      {"out_not_transposed_with_tp_out", [](Call& c) { c.options.tp_out = true; }, "out",
       "expected Sq"},
      {"q_negative_dimension", [](Call& c) { c.q.shape[1] = -8; }, "q", "is negative"},
      {"k_negative_stride", [](Call& c) { c.k.strides[2] = -1; }, "k", "negative strides"},
      {"out_zero_stride", [](Call& c) { c.outputs.out.strides[1] = 0; }, "out", "overlap"},
      // A self-overlapping output that has no zero stride: rows 1 element apart, 4 wide, so
      // out[b, i, c] and out[b, i+1, c-1] are the same float. Threads would race on it.
      {"out_self_overlapping_strides",
       [](Call& c) {
         c.outputs.out.strides = {32, 1, 1};
       },
       "out", "overlap"},
      // --- scalars ---
      {"scale_nan", [](Call& c) { c.options.scale = kNaN; }, "scale", "must be finite"},
      {"scale_inf", [](Call& c) { c.options.scale = kInf; }, "scale", "must be finite"},
      {"scale_minus_inf", [](Call& c) { c.options.scale = -kInf; }, "scale", "must be finite"},
      {"sliding_window_negative", [](Call& c) { c.options.sliding_window = -1; }, "sliding_window",
       "must be >= 0"},
      {"num_threads_negative", [](Call& c) { c.options.num_threads = -2; }, "num_threads",
       "must be >= 0"},
      // --- prefix caching ---
      {"prior_used_len_beyond_k_prior",
       [](Call& c) {
         c.with_prior();
         c.options.prior_used_len = {9};
       },
       "prior_used_len", "must be in [0, S_prior = 8]"},
      {"prior_used_len_negative",
       [](Call& c) {
         c.with_prior();
         c.options.prior_used_len = {-1};
       },
       "prior_used_len", "must be in [0, S_prior"},
      {"prior_used_len_wrong_count",
       [](Call& c) {
         c.with_prior();
         c.options.prior_used_len = {1, 2, 3};
       },
       "prior_used_len", "must hold 1 value or bs_kv"},
      {"prior_used_len_without_prior", [](Call& c) { c.options.prior_used_len = {1}; },
       "prior_used_len", "without k_prior"},
      {"k_prior_without_v_prior",
       [](Call& c) {
         c.with_prior();
         c.options.v_prior = TensorView{};
       },
       "v_prior", "is required when k_prior"},
      {"v_prior_without_k_prior",
       [](Call& c) {
         c.with_prior();
         c.options.k_prior = TensorView{};
       },
       "k_prior", "is required when v_prior"},
      {"k_prior_dtype",
       [](Call& c) {
         c.with_prior();
         c.options.k_prior.dtype = DType::kBFloat16;
       },
       "k_prior", "must be q's float32 or an 8-bit cache format"},
      {"k_prior_scale_missing",
       [](Call& c) {
         c.with_prior();
         c.options.k_prior.dtype = DType::kInt8;
       },
       "k_prior_scale", "is required with the int8 k_prior"},
      {"v_prior_scale_without_8bit_prior",
       [](Call& c) {
         c.with_prior();
         c.with_sink();
         c.options.v_prior_scale = c.options.sink;
       },
       "v_prior_scale", "is for an 8-bit v_prior"},
      {"k_prior_head_dim",
       [](Call& c) {
         c.with_prior();
         c.options.k_prior.shape[1] = 2;
       },
       "k_prior", "expected d"},
      {"k_prior_batch",
       [](Call& c) {
         c.with_prior();
         c.options.k_prior.shape[0] = 2;
       },
       "k_prior", "expected bs_kv"},
      {"v_prior_length_differs",
       [](Call& c) {
         c.with_prior();
         c.options.v_prior.shape[1] = 6;
       },
       "v_prior", "expected S_prior"},
      {"v_prior_rank2",
       [](Call& c) {
         c.with_prior();
         c.options.v_prior.rank = 2;
       },
       "v_prior", "must have rank 3"},
      // --- sink ---
      {"sink_float16",
       [](Call& c) {
         c.with_sink();
         c.options.sink.dtype = DType::kFloat16;
       },
       "sink", "dtype must be float32"},
      {"sink_wrong_batch",
       [](Call& c) {
         c.with_sink();
         c.options.sink.shape[0] = 1;
       },
       "sink", "must be (bs, 1)"},
      {"sink_two_columns",
       [](Call& c) {
         c.with_sink();
         c.options.sink.shape = {1, 2};
       },
       "sink", "must be (bs, 1)"},
      {"sink_nan",
       [](Call& c) {
         c.with_sink();
         std::memcpy(static_cast<uint8_t*>(c.sink_buf.data()) + 4, &kNaN, 4);
       },
       "sink", "must be finite or -inf"},
      {"sink_plus_inf",
       [](Call& c) {
         c.with_sink();
         std::memcpy(c.sink_buf.data(), &kInf, 4);
       },
       "sink", "must be finite or -inf"},
      {"sink_null_data",
       [](Call& c) {
         c.with_sink();
         c.options.sink.data = nullptr;
       },
       "sink", "data is null"},
      // --- context parallelism ---
      {"cp_degree_zero",
       [](Call& c) {
         c.options.cp_offset = 0;
         c.options.global_cp_deg = 0;
       },
       "global_cp_deg", "must be >= 1"},
      {"cp_degree_negative",
       [](Call& c) {
         c.options.cp_offset = 0;
         c.options.global_cp_deg = -4;
       },
       "global_cp_deg", "must be >= 1"},
      {"cp_offset_negative", [](Call& c) { c.options.cp_offset = -1; }, "cp_offset",
       "must be >= 0"},
      {"cp_strided_without_offset",
       [](Call& c) {
         c.options.global_cp_deg = 2;
         c.options.cp_strided_q_slicing = true;
       },
       "cp_offset", "is required with cp_strided_q_slicing"},
      {"cp_strided_without_degree",
       [](Call& c) {
         c.options.cp_offset = 1;
         c.options.cp_strided_q_slicing = true;
       },
       "global_cp_deg", "is required with cp_strided_q_slicing"},
      {"cp_degree_without_offset", [](Call& c) { c.options.global_cp_deg = 2; }, "cp_offset",
       "is required when global_cp_deg"},
      {"cp_offset_too_large", [](Call& c) { c.options.cp_offset = int64_t{1} << 62; }, "cp_offset",
       "exceeds 2^60"},
      {"cp_positions_overflow",
       [](Call& c) {
         // Row 7 sits at 7 * 2^61: past int64.
         c.options.cp_offset = 0;
         c.options.global_cp_deg = int64_t{1} << 61;
         c.options.cp_strided_q_slicing = true;
       },
       "global_cp_deg", "exceed 2^60"},
      // --- score modifiers and windows (FlashAttention family) ---
      {"softcap_nan", [](Call& c) { c.options.softcap = kNaN; }, "softcap", "finite and >= 0"},
      {"softcap_negative", [](Call& c) { c.options.softcap = -1.0f; }, "softcap",
       "finite and >= 0"},
      {"softcap_inf", [](Call& c) { c.options.softcap = kInf; }, "softcap", "finite and >= 0"},
      {"alibi_float16",
       [](Call& c) {
         c.with_alibi();
         c.options.alibi_slopes.dtype = DType::kFloat16;
       },
       "alibi_slopes", "dtype must be float32"},
      {"alibi_wrong_batch",
       [](Call& c) {
         c.with_alibi();
         c.options.alibi_slopes.shape[0] = 3;
       },
       "alibi_slopes", "must be (bs,) or (bs, 1)"},
      {"alibi_nan_entry",
       [](Call& c) {
         c.with_alibi();
         std::memcpy(static_cast<uint8_t*>(c.alibi_buf.data()) + 4, &kNaN, 4);
       },
       "alibi_slopes", "not finite"},
      {"key_bias_too_short",
       [](Call& c) {
         c.with_key_bias();
         c.options.key_bias.shape[1] = 7;
       },
       "key_bias", "must be (bs, prior_used_len + Skv)"},
      {"key_bias_rank1",
       [](Call& c) {
         c.with_key_bias();
         c.options.key_bias.rank = 1;
       },
       "key_bias", "must be (bs, prior_used_len + Skv)"},
      {"key_bias_int32",
       [](Call& c) {
         c.with_key_bias();
         c.options.key_bias.dtype = DType::kInt32;
       },
       "key_bias", "dtype must be float32"},
      {"window_left_below_minus_one", [](Call& c) { c.options.window_left = -2; }, "window_left",
       "-1 for unbounded"},
      {"window_right_below_minus_one", [](Call& c) { c.options.window_right = -5; }, "window_right",
       "-1 for unbounded"},
      // --- packing bounds ---
      {"bound_min_without_bound_max",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_max = TensorView{};
       },
       "bound_max", "is required when bound_min"},
      {"bound_max_without_bound_min",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_min = TensorView{};
       },
       "bound_min", "is required when bound_max"},
      {"bound_min_negative",
       [](Call& c) {
         c.with_bounds();
         c.set_bound(c.bmin_buf, 3, -1);
       },
       "bound_min", "outside [0, 8]"},
      {"bound_min_past_end",
       [](Call& c) {
         c.with_bounds();
         c.set_bound(c.bmin_buf, 5, 9);
         c.set_bound(c.bmax_buf, 5, 9);
       },
       "bound_min", "outside [0, 8]"},
      {"bound_max_past_end",
       [](Call& c) {
         c.with_bounds();
         c.set_bound(c.bmax_buf, 7, 100);
       },
       "bound_max", "outside [bound_min"},
      {"bounds_inverted",
       [](Call& c) {
         c.with_bounds();
         c.set_bound(c.bmin_buf, 2, 6);
         c.set_bound(c.bmax_buf, 2, 3);
       },
       "bound_max", "outside [bound_min = 6"},
      {"bound_min_wrong_length",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_min.shape[0] = 7;
       },
       "bound_min", "must be (Sq, 1) or (Sq,)"},
      {"bound_max_two_columns",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_max.shape = {4, 2};
       },
       "bound_max", "must be (Sq, 1) or (Sq,)"},
      {"bound_min_float16",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_min.dtype = DType::kFloat16;
       },
       "bound_min", "dtype must be int32, int64 or float32"},
      {"bound_float32_not_integral",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_max.dtype = DType::kFloat32;
         for (int64_t i = 0; i < 8; ++i) {
           const float f = i == 4 ? 7.5f : 8.0f;
           std::memcpy(static_cast<uint8_t*>(c.bmax_buf.data()) + 4 * i, &f, 4);
         }
       },
       "bound_max", "not an integral index"},
      {"bound_float32_nan",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_min.dtype = DType::kFloat32;
         for (int64_t i = 0; i < 8; ++i) {
           const float f = i == 6 ? kNaN : 0.0f;
           std::memcpy(static_cast<uint8_t*>(c.bmin_buf.data()) + 4 * i, &f, 4);
         }
       },
       "bound_min", "not an integral index"},
      {"bound_null_data",
       [](Call& c) {
         c.with_bounds();
         c.options.bound_min.data = nullptr;
       },
       "bound_min", "data is null"},
  };
  for (Row& r : memory_rows()) rows.push_back(std::move(r));
  return rows;
}

// Every valid configuration the rows start from succeeds, so each row's refusal is due to its
// own defect and not to the setup.
TEST(BadInputs, TheValidStartingPointsSucceed) {
  const std::vector<std::function<void(Call&)>> valid = {
      [](Call&) {},
      [](Call& c) { c.with_prior(); },
      [](Call& c) { c.with_sink(); },
      [](Call& c) { c.with_bounds(); },
      [](Call& c) { c.with_stats(); },
      [](Call& c) {
        c.with_alibi();
        c.with_key_bias();
        c.options.softcap = 30.0f;
        c.options.window_left = 3;
        c.options.window_right = 0;
        c.options.bottom_right = true;
      },
      [](Call& c) {
        c.reset(with([](auto& s) { s.sq = 256; }));
        c.with_stats();
      },
      [](Call& c) { c.reset(with([](auto& s) { s.d = 1024, s.dv = 1024; })); },
      [](Call& c) {
        c.options.cp_offset = 3;
        c.options.global_cp_deg = 2;
        c.options.cp_strided_q_slicing = true;
      },
      [](Call& c) {
        c.options.tiles = TileConfig{4096, 65536, 65536, 0};
      },
  };
  for (size_t i = 0; i < valid.size(); ++i) {
    Call c;
    valid[i](c);
    const Status s = c.run();
    EXPECT_TRUE(s.ok) << "valid starting point " << i << ": " << s.message;
  }
}

class BadInputRow : public ::testing::TestWithParam<Row> {};

TEST_P(BadInputRow, IsRefusedCleanly) {
  const Row& row = GetParam();
  Call c;
  row.setup(c);
  const BufferSnapshot snap = c.snapshot();
  Status s;
  ASSERT_NO_THROW(s = c.run());
  EXPECT_FALSE(s.ok) << "accepted";
  const std::string prefix = std::string(row.argument) + ": ";
  EXPECT_EQ(s.message.rfind(prefix, 0), 0u)
      << "message \"" << s.message << "\" does not start with \"" << prefix << "\"";
  EXPECT_NE(s.message.find(row.rule), std::string::npos)
      << "message \"" << s.message << "\" does not contain the rule \"" << row.rule << "\"";
  // Nothing written: not the outputs, not the margins, not the inputs.
  EXPECT_TRUE(snap.unchanged());
  // plan_attention validates the same arguments (outputs aside) and must not crash either.
  PlanSummary plan;
  ASSERT_NO_THROW(plan_attention(c.q, c.k, c.v, c.options, &plan));
}

std::string row_name(const ::testing::TestParamInfo<Row>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Api, BadInputRow, ::testing::ValuesIn(api_rows()), row_name);

TEST(BadInputs, TheMatrixHasAtLeastFortyRows) {
  EXPECT_GE(api_rows().size(), 40u);
  std::printf("[ bad inputs ] API rows: %zu tried\n", api_rows().size());
}

}  // namespace
}  // namespace flashcte::test
