// The rule that picks OpenBLAS's kernels for the SGEMM roofline (tools/openblas_core.h), on
// CPUs described by hand, so every branch runs whatever CPU the tests run on.
#include "tools/openblas_core.h"

#include <gtest/gtest.h>

#include <string>

namespace flashcte::tools {
namespace {

CpuIsa Isa(CpuVendor vendor, IsaTier tier) {
  CpuIsa isa;
  isa.vendor = vendor;
  isa.avx = tier >= IsaTier::kAvx;
  isa.avx2_fma = tier >= IsaTier::kAvx2Fma;
  isa.avx512 = tier >= IsaTier::kAvx512;
  isa.avx512_bf16 = tier >= IsaTier::kAvx512Bf16;
  return isa;
}

TEST(OpenBlasCore, TiersOfCoreNames) {
  EXPECT_EQ(TierOfOpenBlasCore("Prescott"), IsaTier::kSse);
  EXPECT_EQ(TierOfOpenBlasCore("PRESCOTT"), IsaTier::kSse)
      << "OpenBLAS matches names ignoring case";
  EXPECT_EQ(TierOfOpenBlasCore("Sandybridge"), IsaTier::kAvx);
  EXPECT_EQ(TierOfOpenBlasCore("Haswell"), IsaTier::kAvx2Fma);
  EXPECT_EQ(TierOfOpenBlasCore("zen"), IsaTier::kAvx2Fma);
  EXPECT_EQ(TierOfOpenBlasCore("SkylakeX"), IsaTier::kAvx512);
  EXPECT_EQ(TierOfOpenBlasCore("Cooperlake"), IsaTier::kAvx512Bf16);
  EXPECT_EQ(TierOfOpenBlasCore("Zen5"), IsaTier::kUnknown);
  EXPECT_EQ(TierOfOpenBlasCore(""), IsaTier::kUnknown);
}

TEST(OpenBlasCore, TierOfCpuNeedsEveryFeatureOfTheTier) {
  CpuIsa isa = Isa(CpuVendor::kIntel, IsaTier::kAvx512Bf16);
  EXPECT_EQ(TierOfCpu(isa), IsaTier::kAvx512Bf16);
  EXPECT_EQ(DescribeIsa(isa), "AVX-512 F/BW/DQ/VL + AVX512_BF16");
  isa.avx512 = false;  // BF16 without the F/BW/DQ/VL set does not make SkylakeX kernels runnable
  isa.avx512_bf16 = false;
  EXPECT_EQ(TierOfCpu(isa), IsaTier::kAvx2Fma);
  EXPECT_EQ(TierOfCpu(Isa(CpuVendor::kOther, IsaTier::kSse)), IsaTier::kSse);
  EXPECT_EQ(DescribeIsa(Isa(CpuVendor::kOther, IsaTier::kSse)), "no AVX");
}

TEST(OpenBlasCore, OlderThanTheIsaIsOverridden) {
  // The misdetection this exists for: a recent Xeon that OpenBLAS 0.3.21 calls Prescott.
  CoreChoice c = ChooseOpenBlasCore("Prescott", Isa(CpuVendor::kIntel, IsaTier::kAvx512Bf16));
  EXPECT_EQ(c.coretype, "Cooperlake");
  EXPECT_NE(c.reason.find("OpenBLAS chose Prescott, older than this CPU's ISA (AVX-512"),
            std::string::npos)
      << c.reason;
  EXPECT_EQ(ChooseOpenBlasCore("Prescott", Isa(CpuVendor::kIntel, IsaTier::kAvx512)).coretype,
            "SkylakeX");
  EXPECT_EQ(ChooseOpenBlasCore("Haswell", Isa(CpuVendor::kIntel, IsaTier::kAvx512)).coretype,
            "SkylakeX");
  EXPECT_EQ(ChooseOpenBlasCore("SkylakeX", Isa(CpuVendor::kAmd, IsaTier::kAvx512Bf16)).coretype,
            "Cooperlake");
  EXPECT_EQ(ChooseOpenBlasCore("Sandybridge", Isa(CpuVendor::kIntel, IsaTier::kAvx2Fma)).coretype,
            "Haswell");
  EXPECT_EQ(ChooseOpenBlasCore("Sandybridge", Isa(CpuVendor::kAmd, IsaTier::kAvx2Fma)).coretype,
            "Zen");
  EXPECT_EQ(ChooseOpenBlasCore("Unknown", Isa(CpuVendor::kOther, IsaTier::kAvx2Fma)).coretype,
            "Haswell");
}

TEST(OpenBlasCore, NotOlderOrUnrankedIsKept) {
  const CpuIsa zen4 = Isa(CpuVendor::kAmd, IsaTier::kAvx512Bf16);
  CoreChoice c = ChooseOpenBlasCore("Cooperlake", zen4);
  EXPECT_EQ(c.coretype, "");
  EXPECT_NE(c.reason.find("kept"), std::string::npos) << c.reason;
  EXPECT_EQ(ChooseOpenBlasCore("Zen", Isa(CpuVendor::kAmd, IsaTier::kAvx2Fma)).coretype, "");
  EXPECT_EQ(ChooseOpenBlasCore("Haswell", Isa(CpuVendor::kIntel, IsaTier::kAvx2Fma)).coretype, "");
  // A name newer than the table (a later OpenBLAS) is OpenBLAS's business.
  c = ChooseOpenBlasCore("Zen5", zen4);
  EXPECT_EQ(c.coretype, "");
  EXPECT_NE(c.reason.find("does not rank"), std::string::npos) << c.reason;
  // Below AVX2+FMA there is no override: OpenBLAS has long known those CPUs.
  EXPECT_EQ(ChooseOpenBlasCore("Prescott", Isa(CpuVendor::kIntel, IsaTier::kAvx)).coretype, "");
  EXPECT_EQ(ChooseOpenBlasCore("Prescott", Isa(CpuVendor::kIntel, IsaTier::kSse)).coretype, "");
}

TEST(OpenBlasCore, WithoutDynamicArchNothingChanges) {
  // Such an OpenBLAS ignores OPENBLAS_CORETYPE, so there is nothing to re-execute for.
  OpenBlasSelection sel;
  std::string error;
  ASSERT_EQ(SelectOpenBlasCore("auto", "Haswell", /*dynamic_arch=*/false, &sel, &error), 0);
  EXPECT_EQ(sel.used, "Haswell");
  EXPECT_FALSE(sel.overridden);
  EXPECT_NE(sel.reason.find("without DYNAMIC_ARCH"), std::string::npos) << sel.reason;
  EXPECT_EQ(SelectOpenBlasCore("Zen", "Haswell", /*dynamic_arch=*/false, &sel, &error), 1);
  EXPECT_NE(error.find("--openblas-core Zen: this OpenBLAS is built without DYNAMIC_ARCH"),
            std::string::npos)
      << error;
}

}  // namespace
}  // namespace flashcte::tools
