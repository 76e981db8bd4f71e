// The library's one CPU-feature probe (src/core/cpu.h) against the flags Linux reports in
// /proc/cpuinfo, which the kernel derives from CPUID and clears where it does not enable the
// register state (cpu_requirements.h reads them, independently of the library).
#include <gtest/gtest.h>

#include <cstdio>
#include <initializer_list>
#include <string>

#include "src/core/cpu.h"
#include "tests/cpu_requirements.h"

namespace flashcte::test {
namespace {

bool flags(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (!cpu_has_flag(n)) return false;
  }
  return true;
}

TEST(CpuFeatures, TheProbeAgreesWithTheKernelsFlags) {
  const internal::CpuFeatures& cpu = internal::cpu_features();
  const bool avx512 = flags({"avx512f", "avx512bw", "avx512dq", "avx512vl"});
  EXPECT_EQ(cpu.avx, flags({"avx"}));
  EXPECT_EQ(cpu.avx2_fma, flags({"avx2", "fma"}));
  EXPECT_EQ(cpu.avx512, avx512);
  EXPECT_EQ(cpu.avx512_vnni, avx512 && flags({"avx512_vnni"}));
  EXPECT_EQ(cpu.avx512_bf16, avx512 && flags({"avx512_bf16"}));
  EXPECT_EQ(cpu.amx_tile, flags({"amx_tile"}));
  EXPECT_EQ(cpu.amx_bf16, flags({"amx_tile", "amx_bf16"}));
  EXPECT_EQ(cpu.amx_int8, flags({"amx_tile", "amx_int8"}));
  // Read once: the same answer as a fresh read.
  const internal::CpuFeatures again = internal::probe_cpu();
  EXPECT_EQ(again.avx512_bf16, cpu.avx512_bf16);
  EXPECT_EQ(again.vendor, cpu.vendor);
  std::printf(
      "[ cpu      ] avx %d avx2_fma %d avx512 %d vnni %d bf16 %d amx tile/bf16/int8 %d/%d/%d\n",
      cpu.avx, cpu.avx2_fma, cpu.avx512, cpu.avx512_vnni, cpu.avx512_bf16, cpu.amx_tile,
      cpu.amx_bf16, cpu.amx_int8);
}

}  // namespace
}  // namespace flashcte::test
