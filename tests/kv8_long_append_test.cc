// 8-bit KV caches at long contexts (issue 41, item 4): Kv8LongAppend, flash_attn_with_kvcache
// appending new tokens into 8-bit caches with rotary, cache_leftpad and cache_batch_idx (dense) or
// pages; the design, the oracle and the spec the codes are checked against are kv8_long_test.cc's
// file comment, the machinery kv8_long_append.h.
#include "tests/kv8_long_append.h"

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
#include "tests/kv8_formats.h"
#include "tests/kv8_long_cases.h"
#include "tests/test_util.h"

namespace flashcte::test {
namespace {

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
