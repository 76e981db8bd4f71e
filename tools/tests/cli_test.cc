// End-to-end tests of the `flashcte` program: write .npy inputs, run the binary, read its
// outputs, and compare with the float64 reference. Also pins the exit codes (2 usage, 1 runtime).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "src/core/half.h"
#include "src/reference/reference.h"
#include "tools/npy.h"

#ifndef FLASHCTE_CLI_PATH
#error "FLASHCTE_CLI_PATH must name the flashcte binary"
#endif

namespace flashcte::tools {
namespace {

struct Array {
  std::vector<int64_t> shape;
  std::vector<float> data;
  TensorView view() const { return TensorView::contiguous(data.data(), DType::kFloat32, shape); }
};

class CliTest : public ::testing::Test {
 protected:
  std::string Path(const std::string& name) const {
    return ::testing::TempDir() + "flashcte_cli_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "_" + name + ".npy";
  }

  Array Random(const std::string& name, std::vector<int64_t> shape, float lo = 0, float hi = 1) {
    Array a;
    a.shape = std::move(shape);
    int64_t n = 1;
    for (int64_t d : a.shape) n *= d;
    std::uniform_real_distribution<float> dist(lo, hi);
    for (int64_t i = 0; i < n; ++i) a.data.push_back(dist(rng_));
    Save(name, a);
    return a;
  }

  void Save(const std::string& name, const Array& a) {
    std::string error;
    ASSERT_TRUE(write_npy(Path(name), NpyDtype::kFloat32, a.shape, a.data.data(), &error)) << error;
  }

  Array Load(const std::string& name) {
    NpyArray n;
    std::string error;
    EXPECT_TRUE(read_npy(Path(name), &n, &error)) << error;
    EXPECT_EQ(n.dtype, NpyDtype::kFloat32);
    Array a;
    a.shape = n.shape;
    a.data.resize(n.elements());
    std::memcpy(a.data.data(), n.data.data(), n.data.size());
    return a;
  }

  // Runs `flashcte <args>` with stdout and stderr discarded; returns the exit code.
  int Run(const std::string& args) {
    const std::string command = std::string("\"") + FLASHCTE_CLI_PATH + "\" " + args + " >" +
                                ::testing::TempDir() + "flashcte_cli_log.txt 2>&1";
    const int status = std::system(command.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // Compares out (bs, Sq, dv) with the reference, by the Neuron comparator scaled down for
  // float32 arithmetic.
  void ExpectClose(const Array& out, const reference::Result& ref, double rtol = 1e-4) {
    double max_ref = 0, max_err = 0;
    ASSERT_EQ(out.data.size(), ref.out.size());
    for (size_t i = 0; i < ref.out.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(ref.out[i]));
      max_err = std::max(max_err, std::fabs(out.data[i] - ref.out[i]));
    }
    EXPECT_LE(max_err, 1e-5 + rtol * max_ref);
  }

  std::string Q() { return " --q " + Path("q"); }
  std::string K() { return " --k " + Path("k"); }
  std::string V() { return " --v " + Path("v"); }
  std::string Out() { return " --out " + Path("out"); }

  std::mt19937 rng_{42};
};

TEST_F(CliTest, CausalGqaWithLse) {
  const Array q = Random("q", {4, 200, 40}), k = Random("k", {2, 40, 260}),
              v = Random("v", {2, 260, 24});
  ASSERT_EQ(Run("run" + Q() + K() + V() + Out() + " --scale 0.3 --lse " + Path("lse")), 0);
  Options o;
  o.scale = 0.3f;
  reference::Result ref;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &ref).ok);
  ExpectClose(Load("out"), ref);
  const Array lse = Load("lse");
  ASSERT_EQ(lse.shape, (std::vector<int64_t>{4, 200}));
  for (size_t i = 0; i < ref.lse.size(); ++i) ASSERT_NEAR(lse.data[i], ref.lse[i], 1e-4);
}

TEST_F(CliTest, PrefixWithTransposedKeys) {
  const Array q = Random("q", {2, 64, 16}), k = Random("k", {2, 50, 16}),
              v = Random("v", {2, 50, 16}), kp = Random("kp", {2, 90, 16}),
              vp = Random("vp", {2, 90, 16});
  ASSERT_EQ(Run("run" + Q() + K() + V() + Out() + " --tp-k true --k-prior " + Path("kp") +
                " --v-prior " + Path("vp") + " --prior-used-len 70"),
            0);
  Options o;
  o.tp_k = true;
  o.k_prior = kp.view();
  o.v_prior = vp.view();
  o.prior_used_len = {70};
  reference::Result ref;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &ref).ok);
  ExpectClose(Load("out"), ref);
}

TEST_F(CliTest, SinkAndNeuronCacheSoftmax) {
  const Array q = Random("q", {2, 256, 32}), k = Random("k", {1, 32, 256}),
              v = Random("v", {1, 256, 32}), sink = Random("sink", {2, 1}, 15, 25);
  ASSERT_EQ(Run("run" + Q() + K() + V() + Out() + " --sink " + Path("sink") +
                " --cache-softmax true --neg-max " + Path("nm") + " --sum-recip " + Path("sr")),
            0);
  Options o;
  o.sink = sink.view();
  reference::Result ref;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &ref).ok);
  ExpectClose(Load("out"), ref);
  const Array nm = Load("nm"), sr = Load("sr");
  ASSERT_EQ(nm.shape, (std::vector<int64_t>{2, 128, 2}));
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 256; ++i) {
      const size_t at = (b * 128 + i % 128) * 2 + i / 128;  // [b, p, g] is row g*128 + p
      ASSERT_NEAR(nm.data[at], ref.neg_max[b * 256 + i], 1e-4);
      ASSERT_NEAR(sr.data[at] / ref.sum_recip[b * 256 + i], 1.0, 1e-4);
    }
  }
}

TEST_F(CliTest, PackingBoundsNonCausalTransposedOutput) {
  const Array q = Random("q", {1, 96, 8}), k = Random("k", {1, 8, 96}), v = Random("v", {1, 96, 8});
  std::vector<int32_t> lo(96), hi(96);
  for (int i = 0; i < 96; ++i) {
    lo[i] = i < 30 ? 0 : i < 70 ? 30 : 70;
    hi[i] = i < 30 ? 30 : i < 70 ? 70 : 96;
  }
  std::string error;
  ASSERT_TRUE(write_npy(Path("lo"), NpyDtype::kInt32, {96, 1}, lo.data(), &error));
  ASSERT_TRUE(write_npy(Path("hi"), NpyDtype::kInt32, {96}, hi.data(), &error));
  ASSERT_EQ(Run("run" + Q() + K() + V() + Out() + " --causal-mask false --tp-out true " +
                "--bound-min " + Path("lo") + " --bound-max " + Path("hi")),
            0);
  Options o;
  o.causal_mask = false;
  o.bound_min = TensorView::contiguous(lo.data(), DType::kInt32, {96, 1});
  o.bound_max = TensorView::contiguous(hi.data(), DType::kInt32, {96});
  reference::Result ref;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &ref).ok);
  Array out = Load("out");
  ASSERT_EQ(out.shape, (std::vector<int64_t>{1, 8, 96}));
  Array rows = out;  // (1, dv, Sq) -> (1, Sq, dv)
  for (int64_t i = 0; i < 96; ++i) {
    for (int64_t c = 0; c < 8; ++c) rows.data[i * 8 + c] = out.data[c * 96 + i];
  }
  ExpectClose(rows, ref);
}

TEST_F(CliTest, Bfloat16ComputeRoundsInputs) {
  Array q = Random("q", {2, 130, 24}), k = Random("k", {2, 24, 140}), v = Random("v", {2, 140, 24});
  ASSERT_EQ(Run("run" + Q() + K() + V() + Out() + " --dtype bfloat16 --scale 0.2"), 0);
  for (Array* a : {&q, &k, &v}) {
    for (float& x : a->data) x = half::bf16_to_float(half::float_to_bf16(x));
  }
  Options o;
  o.scale = 0.2f;
  reference::Result ref;
  ASSERT_TRUE(reference::attention(q.view(), k.view(), v.view(), o, &ref).ok);
  ExpectClose(Load("out"), ref, 2e-2);
}

TEST_F(CliTest, ExitCodes) {
  Random("q", {1, 100, 8});
  Random("k", {1, 8, 100});
  Random("v", {1, 100, 8});
  Random("v_bad", {1, 99, 8});
  EXPECT_EQ(Run("run" + Q() + K() + V() + Out()), 0);
  EXPECT_EQ(Run("run" + Q() + K() + V()), 2) << "missing --out";
  EXPECT_EQ(Run("run" + Q() + K() + V() + Out() + " --bogus 1"), 2);
  EXPECT_EQ(Run("run" + Q() + K() + V() + Out() + " --threads -1"), 2);
  EXPECT_EQ(Run("run" + Q() + K() + V() + Out() + " --q-block 100000"), 2) << "library range";
  EXPECT_EQ(Run("run" + Q() + K() + V() + Out() + " --cache-softmax true --neg-max " + Path("nm") +
                " --sum-recip " + Path("sr")),
            2)
      << "Sq = 100 cannot use the Neuron layout";
  EXPECT_EQ(Run("run" + Q() + K() + " --v " + Path("v_bad") + Out()), 1) << "shape mismatch";
  EXPECT_EQ(Run("run" + Q() + K() + " --v " + Path("missing") + Out()), 1);
  EXPECT_EQ(Run("run" + Q() + K() + " --v " + std::string(FLASHCTE_CLI_PATH) + Out()), 1)
      << "not a .npy file";
  EXPECT_EQ(Run("frobnicate"), 2);
  EXPECT_EQ(Run("plan --sq 100 --bs 3 --bs-kv 2"), 2);
  EXPECT_EQ(Run("plan --sq 100 --bs 4 --bs-kv 2"), 0);
  EXPECT_EQ(Run("strategy --sq 4096 --lnc 2 --batch-heads 3"), 0);
  EXPECT_EQ(Run("strategy --d 64"), 2) << "missing --sq";
  EXPECT_EQ(Run("strategy --sq 16 --lnc 0"), 2);
  EXPECT_EQ(Run("strategy --sq 16 --kernel-enabled maybe"), 2);
  EXPECT_EQ(Run("strategy --sq 16 --batch-heads 6 --kv-batch-heads 4"), 2);
  EXPECT_EQ(Run("help"), 0);
}

}  // namespace
}  // namespace flashcte::tools
