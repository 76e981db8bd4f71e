// plan_varlen_kvcache / run_varlen_kvcache (include/flashcte/kvcache.h): a serving step planned
// once and run in every layer. Each layer's run is bitwise flash_attn_varlen_kvcache on that
// layer's tensors with the planned step (the direct call is checked against the float64 oracle
// in varlen_kvcache_test.cc); the plan reads nothing of the tensors it was made with once made;
// a layer whose tensors differ from the plan's layouts, or whose outputs overlap an input, or
// whose sinks, slopes or scales are bad, is refused by name before anything is written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "flashcte/kvcache.h"
#include "tests/test_util.h"
#include "tests/varlen_inputs.h"

namespace flashcte::test {
namespace {

// Layer tensors of a case: its q, caches, slopes and sinks (another seed: other values).
VarlenKvCacheLayer layer_of(const VarlenCase& c, const VarlenInputs& in) {
  VarlenKvCacheLayer l;
  if (c.alibi > 0) l.alibi_slopes = in.slopes.view();
  if (c.sinks) l.sinks = in.sinks.view();
  return l;
}

VarlenRun run_planned(const VarlenCase& c, const VarlenKvCachePlan& plan, const VarlenInputs& in) {
  VarlenRun r{Status::Ok(), HostTensor(c.dtype, {c.total_q(), c.heads, c.value_dim()}),
              nan_floats(c.heads * c.total_q())};
  r.status = run_varlen_kvcache(
      plan, in.q.view(), in.k_cache.view(), in.v_cache.view(), r.out.mutable_view(),
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {c.heads, c.total_q()}),
      layer_of(c, in));
  return r;
}

// The direct call on a layer's tensors with the step of `step` (its offsets, lengths, table).
VarlenRun run_direct(const VarlenCase& c, const VarlenInputs& step, const VarlenInputs& in) {
  VarlenRun r{Status::Ok(), HostTensor(c.dtype, {c.total_q(), c.heads, c.value_dim()}),
              nan_floats(c.heads * c.total_q())};
  VarlenKvCacheOptions o = step.options(c);
  const VarlenKvCacheLayer l = layer_of(c, in);
  o.alibi_slopes = l.alibi_slopes;
  o.sinks = l.sinks;
  r.status = flash_attn_varlen_kvcache(
      in.q.view(), in.k_cache.view(), in.v_cache.view(), r.out.mutable_view(),
      MutableTensorView::contiguous(r.lse.data(), DType::kFloat32, {c.heads, c.total_q()}), o);
  return r;
}

Status plan_for(const VarlenCase& c, const VarlenInputs& in, VarlenKvCachePlan* plan) {
  HostTensor out(c.dtype, {c.total_q(), c.heads, c.value_dim()});
  std::vector<float> lse(static_cast<size_t>(c.heads * c.total_q()));
  return plan_varlen_kvcache(
      in.q.view(), in.k_cache.view(), in.v_cache.view(), out.mutable_view(),
      MutableTensorView::contiguous(lse.data(), DType::kFloat32, {c.heads, c.total_q()}),
      in.options(c), plan);
}

void expect_same_bits(const VarlenRun& a, const VarlenRun& b) {
  ASSERT_TRUE(a.status.ok) << a.status.message;
  ASSERT_TRUE(b.status.ok) << b.status.message;
  EXPECT_EQ(a.out.bytes(), b.out.bytes()) << "out";
  EXPECT_EQ(0, std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float))) << "lse";
}

std::vector<VarlenCase> steps() {
  std::vector<VarlenCase> s;
  VarlenCase c;
  c.name = "decode_and_prefill";
  c.q_lens = {1, 300, 1, 3, 17, 0};
  c.used = {500, 300, 77, 3, 640, 12};
  s.push_back(c);
  c.name = "paged16_window_sinks_alibi_per_batch";
  c.page = 16, c.left = 100, c.sinks = true, c.alibi = 2;
  s.push_back(c);
  c = VarlenCase{};
  c.name = "paged3_not_causal_softcap_dv";
  c.q_lens = {3, 50};
  c.used = {200, 120};
  c.page = 3, c.causal = false, c.left = 30, c.right = 7, c.dv = 48, c.softcap = 5.0f, c.alibi = 1;
  c.threads = 3;
  s.push_back(c);
  return s;
}

class VarlenPlan : public ::testing::TestWithParam<VarlenCase> {};

// Three layers of one step, each run through the plan, each bitwise its own direct call; the
// plan made with tensors freed before the first run.
TEST_P(VarlenPlan, EachLayerBitwiseItsOwnCall) {
  const VarlenCase& c = GetParam();
  const VarlenInputs step(c);
  VarlenKvCachePlan plan;
  {
    VarlenCase other = c;
    other.seed = c.seed + 100;
    const auto planned_with = std::make_unique<VarlenInputs>(other);
    VarlenInputs structure = *planned_with;
    structure.cu = step.cu, structure.used = step.used, structure.table = step.table;
    ASSERT_TRUE(plan_for(c, structure, &plan).ok);
  }
  for (const uint64_t seed : {c.seed, c.seed + 1, c.seed + 2}) {
    VarlenCase layer_case = c;
    layer_case.seed = seed;
    const VarlenInputs layer(layer_case);
    SCOPED_TRACE("layer seed " + std::to_string(seed));
    expect_same_bits(run_planned(c, plan, layer), run_direct(c, step, layer));
  }
}

std::string case_name(const ::testing::TestParamInfo<VarlenCase>& param) {
  return param.param.name;
}

INSTANTIATE_TEST_SUITE_P(Varlen, VarlenPlan, ::testing::ValuesIn(in_every_dtype(steps())),
                         case_name);

// A run's profile is the run's: the plan keeps no profile given to plan_varlen_kvcache (here one
// that is gone before the run, which ASan would catch were it written).
TEST(VarlenPlan, EachRunProfilesItself) {
  const VarlenCase c = steps()[0];
  const VarlenInputs in(c);
  VarlenKvCachePlan plan;
  {
    ThreadProfile gone;
    VarlenKvCacheOptions o = in.options(c);
    o.profile = &gone;
    HostTensor out(c.dtype, {c.total_q(), c.heads, c.value_dim()});
    ASSERT_TRUE(plan_varlen_kvcache(in.q.view(), in.k_cache.view(), in.v_cache.view(),
                                    out.mutable_view(), {}, o, &plan)
                    .ok);
  }
  HostTensor out(c.dtype, {c.total_q(), c.heads, c.value_dim()});
  ThreadProfile profile;
  ASSERT_TRUE(run_varlen_kvcache(plan, in.q.view(), in.k_cache.view(), in.v_cache.view(),
                                 out.mutable_view(), {}, {}, &profile)
                  .ok);
  EXPECT_FALSE(profile.busy_seconds.empty());
  EXPECT_GT(profile.wall_seconds, 0.0);
}

TEST(VarlenPlanValidation, ALayerUnlikeThePlanIsRefusedByName) {
  VarlenCase c = steps()[1];
  const VarlenInputs in(c);
  VarlenKvCachePlan plan;
  EXPECT_TRUE(refused_for(
      run_varlen_kvcache(plan, in.q.view(), in.k_cache.view(), in.v_cache.view(), {}, {}), "plan"));
  ASSERT_TRUE(plan_for(c, in, &plan).ok);
  HostTensor out(c.dtype, {c.total_q(), c.heads, c.value_dim()});
  std::vector<float> lse(static_cast<size_t>(c.heads * c.total_q()));
  const MutableTensorView lse_view =
      MutableTensorView::contiguous(lse.data(), DType::kFloat32, {c.heads, c.total_q()});
  const auto run = [&](const TensorView& q, const TensorView& k_cache, const MutableTensorView& o,
                       const MutableTensorView& l, const VarlenKvCacheLayer& layer) {
    return run_varlen_kvcache(plan, q, k_cache, in.v_cache.view(), o, l, layer);
  };
  const VarlenKvCacheLayer layer = layer_of(c, in);
  ASSERT_TRUE(run(in.q.view(), in.k_cache.view(), out.mutable_view(), lse_view, layer).ok);

  // Another layout: a q of another dtype, a cache with one more page, a transposed view.
  HostTensor q_bf16(DType::kBFloat16, {c.total_q(), c.heads, c.d});
  EXPECT_TRUE(
      refused_for(run(q_bf16.view(), in.k_cache.view(), out.mutable_view(), lse_view, layer), "q"));
  TensorView more_pages = in.k_cache.view();
  more_pages.shape[0] -= 1;
  EXPECT_TRUE(
      refused_for(run(in.q.view(), more_pages, out.mutable_view(), lse_view, layer), "k_cache"));
  TensorView swapped = in.q.view();
  std::swap(swapped.strides[0], swapped.strides[1]);
  std::swap(swapped.shape[0], swapped.shape[1]);
  EXPECT_TRUE(
      refused_for(run(swapped, in.k_cache.view(), out.mutable_view(), lse_view, layer), "q"));
  // Given where the plan had none, or missing where it had one.
  EXPECT_TRUE(
      refused_for(run(in.q.view(), in.k_cache.view(), out.mutable_view(), {}, layer), "lse"));
  VarlenKvCacheLayer no_sinks = layer;
  no_sinks.sinks = {};
  EXPECT_TRUE(refused_for(
      run(in.q.view(), in.k_cache.view(), out.mutable_view(), lse_view, no_sinks), "sinks"));
  VarlenKvCacheLayer scaled = layer;
  const float one = 1.0f;
  scaled.k_scale = TensorView::contiguous(&one, DType::kFloat32, {1});
  EXPECT_TRUE(refused_for(run(in.q.view(), in.k_cache.view(), out.mutable_view(), lse_view, scaled),
                          "k_scale"));
  // Values: a NaN sink, an infinite slope.
  HostTensor bad_sinks(DType::kFloat32, {c.heads}), bad_slopes(DType::kFloat32, in.slopes.shape());
  for (int64_t h = 0; h < c.heads; ++h) bad_sinks.set(h, 0, 0, h == 2 ? NAN : 0.5);
  for (int64_t b = 0; b < c.batch(); ++b) {
    for (int64_t h = 0; h < c.heads; ++h) bad_slopes.set(b, h, 0, b == 1 && h == 3 ? INFINITY : 0);
  }
  VarlenKvCacheLayer bad = layer;
  bad.sinks = bad_sinks.view();
  EXPECT_TRUE(
      refused_for(run(in.q.view(), in.k_cache.view(), out.mutable_view(), lse_view, bad), "sinks"));
  bad = layer;
  bad.alibi_slopes = bad_slopes.view();
  EXPECT_TRUE(refused_for(run(in.q.view(), in.k_cache.view(), out.mutable_view(), lse_view, bad),
                          "alibi_slopes"));
  // An output over an input: refused before anything is written.
  HostTensor q_and_out(c.dtype, {c.total_q(), c.heads, c.d});
  const std::vector<uint8_t> before = q_and_out.bytes();
  EXPECT_TRUE(refused_for(
      run(q_and_out.view(), in.k_cache.view(), q_and_out.mutable_view(), lse_view, layer), "out"));
  EXPECT_EQ(before, q_and_out.bytes());
}

}  // namespace
}  // namespace flashcte::test
