// decode_attention (include/flashcte/decode.h) against the float64 oracle and against the
// prefill kernel: each sequence of a decode call is the prefill problem whose keys are its cache
// slots [0, last position + 1), causal with cp_offset = its first position (consecutive
// positions) or with packing bounds (any positions), bs = q_heads, bs_kv = kv_heads, and the same
// sink, window and softcap. Tolerances follow tests/test_util.cc: float32 within 1e-5 max|ref|;
// bfloat16 / float16 within twice the error of a plain same-precision implementation
// (reference::attention_plain) plus one rounding of the largest output; lse likewise on the
// logits' scale. Cache slots no token attends hold NaN, so a kernel that reads one fails.
// (The machinery: decode_cases.h; paged caches and bad input: decode_paged_test.cc.)
#include "flashcte/decode.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "src/core/half.h"
#include "tests/decode_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

// ---- accuracy ----------------------------------------------------------------------------------

std::vector<DecodeCase> accuracy_cases() {
  std::vector<DecodeCase> shapes;
  auto add = [&](const DecodeCase& c) { shapes.push_back(c); };
  // GQA 32/8 at d = 128, the Llama shape: T = 1 over the whole of a 4096-slot cache, two
  // sequences at different positions.
  add(shape("gqa32_8_T1_d128_len4096", 2, 32, 8, 1, 128, 0, 4096, {4095, 1000}));
  add(shape("gqa32_8_T3_d64_len17", 1, 32, 8, 3, 64, 0, 17, {16}));
  add(shape("gqa32_8_T16_d128_len300", 1, 32, 8, 16, 128, 0, 300, {299}));
  add(shape("gqa8_2_T16_d128_len4096", 1, 8, 2, 16, 128, 0, 4096, {4095}));
  add(shape("mqa8_1_T1_d80_len17", 2, 8, 1, 1, 80, 0, 17, {16, 3}));
  add(shape("mha4_4_T3_d1_len17", 1, 4, 4, 3, 1, 0, 17, {9}));
  add(shape("mha2_2_T1_d257_len1", 1, 2, 2, 1, 257, 0, 1, {0}));
  add(shape("gqa4_2_T3_d257_len17", 1, 4, 2, 3, 257, 0, 17, {16}));
  add(shape("gqa4_2_T1_d64_dv80_len40", 1, 4, 2, 1, 64, 80, 40, {39}));
  // Value widths whose last 32-column group is partial past 16 (the native bfloat16 PV's in-lane
  // interleave) and odd attended lengths, at 2 and 3 rows per KV head.
  add(shape("gqa4_2_T1_d64_dv120_len45", 1, 4, 2, 1, 64, 120, 45, {44}));
  add(shape("gqa12_4_T1_d120_len77", 2, 12, 4, 1, 120, 0, 77, {76, 32}));
  // A batch whose sequences sit at different positions, down to the first slot.
  add(shape("batch3_T1_len17", 3, 8, 2, 1, 64, 0, 17, {16, 5, 0}));
  add(shape("batch2_T3_len4096", 2, 8, 2, 3, 128, 0, 4096, {4095, 2050}));
  // A sliding window (and sink, softcap) over several chunks of the KV axis.
  DecodeCase window = shape("gqa8_2_T3_window100_len4096", 1, 8, 2, 3, 128, 0, 4096, {3000});
  window.window = 100;
  add(window);
  DecodeCase wide_window = window;
  wide_window.name = "gqa8_2_T3_window2500_len4096_sink";
  wide_window.window = 2500;
  wide_window.sink = true;
  add(wide_window);
  DecodeCase sink = shape("gqa32_8_T1_sink_len600", 2, 32, 8, 1, 64, 0, 600, {599, 100});
  sink.sink = true;
  add(sink);
  DecodeCase capped = shape("gqa8_2_T3_softcap_window_sink_len64", 1, 8, 2, 3, 64, 0, 64, {40});
  capped.softcap = 3.0f;
  capped.window = 7;
  capped.sink = true;
  add(capped);
  // Positions that are not consecutive (repeated, with gaps), and more than 16 new tokens.
  DecodeCase gaps = shape("gqa4_2_gapped_positions", 2, 4, 2, 4, 64, 0, 40, {});
  gaps.positions = {{10, 12, 12, 30}, {0, 0, 3, 39}};
  add(gaps);
  add(shape("gqa8_2_T20_len64", 1, 8, 2, 20, 64, 0, 64, {63}));
  // Strided views: the caches' channel stride is 2 (gathered per block), q and out padded.
  DecodeCase strided = shape("gqa8_2_T3_strided_len200", 2, 8, 2, 3, 80, 0, 200, {199, 64});
  strided.strided = true;
  add(strided);

  return in_every_dtype(shapes);
}

class DecodeAccuracy : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeAccuracy, MatchesTheReferenceAndThePrefillKernel) {
  const DecodeCase& c = GetParam();
  const DecodeRun run = run_decode_case(c);
  ASSERT_TRUE(run.status.ok) << run.status.message;
  EXPECT_TRUE(check_against_reference(c, run));
  EXPECT_TRUE(check_against_prefill(c, run));
}

std::string case_name(const ::testing::TestParamInfo<DecodeCase>& param) {
  return param.param.name;
}
INSTANTIATE_TEST_SUITE_P(Decode, DecodeAccuracy, ::testing::ValuesIn(accuracy_cases()), case_name);

// Every SIMD target this CPU runs computes the whole kernel correctly (the micro-kernels' own
// testers are tests/simd/decode_ops_test.cc).
TEST(DecodeTargets, EveryTargetMatchesTheReference) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    DecodeCase c = shape("targets", 2, 8, 2, 3, 80, 0, 1500, {1499, 40}, dtype);
    c.sink = true;
    c.window = 1200;
    for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
      hwy::SetSupportedTargetsForTest(target);
      SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + ", " + dtype_name(dtype));
      const DecodeRun run = run_decode_case(c);
      ASSERT_TRUE(run.status.ok) << run.status.message;
      EXPECT_TRUE(check_against_reference(c, run));
    }
    hwy::SetSupportedTargetsForTest(0);
  }
}

// ---- determinism -------------------------------------------------------------------------------

// The KV axis is cut into chunks by the problem alone: 1, 2 and 3 threads give the same bytes.
TEST(DecodeThreads, BitwiseIdenticalForAnyThreadCount) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    DecodeCase c = shape("threads", 3, 8, 2, 3, 128, 0, 4096, {4095, 2000, 10}, dtype);
    c.sink = true;
    std::vector<DecodeRun> runs;
    for (int threads : {1, 2, 3}) {
      c.threads = threads;
      runs.push_back(run_decode_case(c, /*with_reference=*/false));
      ASSERT_TRUE(runs.back().status.ok) << runs.back().status.message;
    }
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_TRUE(runs[i].out_bytes == runs[0].out_bytes) << dtype_name(dtype) << ": out differs";
      EXPECT_TRUE(runs[i].lse_bytes == runs[0].lse_bytes) << dtype_name(dtype) << ": lse differs";
    }
  }
}

// A cache laid out (batch, seqlen, heads, d) (FlashAttention's) is worked chunk by chunk with a
// chunk's KV heads in one item, a (batch, heads, seqlen, d) one head by head (decode_schedule.cc):
// the same values give the same bytes either way, over several chunks (partial states merged) or
// one (rows written by the item), and threads that group the heads (1-3: at least two items per
// thread) or not (4).
TEST(DecodeLayouts, SlotMajorCacheGivesTheHeadMajorBytes) {
  constexpr int64_t kB = 3, kHq = 8, kHkv = 2, kL = 2600, kD = 64;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> q(kB * kHq * kD), k_hm(kB * kHkv * kL * kD), v_hm(k_hm.size());
  for (auto* t : {&q, &k_hm, &v_hm}) {
    for (float& x : *t) x = u(rng);
  }
  // The same values slot-major.
  std::vector<float> k_sm(k_hm.size()), v_sm(v_hm.size());
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < kHkv; ++h) {
      for (int64_t j = 0; j < kL; ++j) {
        for (int64_t x = 0; x < kD; ++x) {
          const size_t hm = static_cast<size_t>(((b * kHkv + h) * kL + j) * kD + x);
          const size_t sm = static_cast<size_t>(((b * kL + j) * kHkv + h) * kD + x);
          k_sm[sm] = k_hm[hm];
          v_sm[sm] = v_hm[hm];
        }
      }
    }
  }
  const std::vector<int64_t> positions = {kL - 1, 1500, 600};  // 3, 2 and 1 chunks
  const auto run = [&](const float* k, const float* v, bool slot_major, int threads) {
    const std::array<int64_t, 4> strides =
        slot_major ? std::array<int64_t, 4>{kL * kHkv * kD, kD, kHkv * kD, 1}
                   : std::array<int64_t, 4>{kHkv * kL * kD, kL * kD, kD, 1};
    const TensorView kv_shape[2] = {{k, DType::kFloat32, 4, {kB, kHkv, kL, kD}, strides},
                                    {v, DType::kFloat32, 4, {kB, kHkv, kL, kD}, strides}};
    std::vector<float> out(q.size()), lse(kB * kHq);
    DecodeOutputs outputs;
    outputs.out = MutableTensorView::contiguous(out.data(), DType::kFloat32, {kB, kHq, 1, kD});
    outputs.lse = MutableTensorView::contiguous(lse.data(), DType::kFloat32, {kB, kHq, 1});
    DecodeOptions o;
    o.scale = 0.125f;
    o.num_threads = threads;
    EXPECT_TRUE(decode_attention(
                    TensorView::contiguous(q.data(), DType::kFloat32, {kB, kHq, 1, kD}),
                    kv_shape[0], kv_shape[1],
                    TensorView::contiguous(positions.data(), DType::kInt64, {kB, 1}), outputs, o)
                    .ok);
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const std::vector<float> want = run(k_hm.data(), v_hm.data(), false, 1);
  for (int threads : {1, 2, 3, 4}) {
    const std::vector<float> got = run(k_sm.data(), v_sm.data(), true, threads);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
        << threads << " threads";
  }
}

}  // namespace
}  // namespace flashcte::test
