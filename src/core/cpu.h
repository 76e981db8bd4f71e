// The one CPU-feature probe: every detector of the library and its tools reads it (the native
// bf16 / VNNI kernels' policy, the layer's OpenBLAS core, the CLI's roofline probes), and the
// AMX kernels will too.
//
// From CPUID and, for each register state an extension needs, XCR0 (the state the OS saves on a
// context switch): a feature whose state the OS or a hypervisor does not enable reads as absent,
// so nothing here can lead to a SIGILL. Highway's own target detection stays Highway's.
//   leaf 1      ECX 12 FMA, 27 OSXSAVE, 28 AVX
//   leaf 7.0    EBX 5 AVX2, 16 AVX512F, 17 DQ, 30 BW, 31 VL; ECX 11 AVX512_VNNI;
//               EDX 22 AMX_BF16, 24 AMX_TILE, 25 AMX_INT8
//   leaf 7.1    EAX 5 AVX512_BF16
//   XCR0        1-2 xmm/ymm, 5-7 opmask and zmm, 17-18 tile config and data
// AMX needs one more step on Linux before its first instruction: each process asks the kernel
// for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM); amx_* here says only that the CPU
// and the OS support it.
#ifndef FLASHCTE_CORE_CPU_H_
#define FLASHCTE_CORE_CPU_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define FLASHCTE_CPU_X86 1
#else
#define FLASHCTE_CPU_X86 0
#endif

namespace flashcte::internal {

enum class CpuVendor { kOther, kIntel, kAmd };  // AMD includes Hygon (Zen cores)

struct CpuFeatures {
  CpuVendor vendor = CpuVendor::kOther;
  bool avx = false;          // with ymm state
  bool avx2_fma = false;     // AVX2 and FMA3
  bool avx512 = false;       // F, BW, DQ and VL, with opmask and zmm state
  bool avx512_vnni = false;  // with avx512
  bool avx512_bf16 = false;  // with avx512
  bool amx_tile = false;     // with tile config and data state
  bool amx_bf16 = false;     // with amx_tile
  bool amx_int8 = false;     // with amx_tile
};

// Reads the CPU now. cpu_features() is the same, read once per process.
inline CpuFeatures probe_cpu() {
  CpuFeatures f;
#if FLASHCTE_CPU_X86
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return f;
  const unsigned max_leaf = eax;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  if (std::strcmp(vendor, "GenuineIntel") == 0) f.vendor = CpuVendor::kIntel;
  if (std::strcmp(vendor, "AuthenticAMD") == 0 || std::strcmp(vendor, "HygonGenuine") == 0) {
    f.vendor = CpuVendor::kAmd;
  }
  if (max_leaf < 1 || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const auto bit = [](unsigned reg, int i) { return ((reg >> i) & 1u) != 0; };
  if (!bit(ecx, 27)) return f;  // no OSXSAVE: no xgetbv, no state beyond SSE
  const bool avx = bit(ecx, 28), fma = bit(ecx, 12);
  uint32_t xcr0 = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0), "=d"(xcr0_hi) : "c"(0));
  const auto state = [&](uint32_t bits) { return (xcr0 & bits) == bits; };
  const bool ymm = state((1u << 1) | (1u << 2));
  const bool zmm = ymm && state((1u << 5) | (1u << 6) | (1u << 7));
  const bool tiles = state((1u << 17) | (1u << 18));
  f.avx = avx && ymm;
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const unsigned subleaves = eax, ebx7 = ebx, ecx7 = ecx, edx7 = edx;
  f.avx2_fma = f.avx && fma && bit(ebx7, 5);
  f.avx512 = zmm && bit(ebx7, 16) && bit(ebx7, 17) && bit(ebx7, 30) && bit(ebx7, 31);
  f.avx512_vnni = f.avx512 && bit(ecx7, 11);
  f.amx_tile = tiles && bit(edx7, 24);
  f.amx_bf16 = f.amx_tile && bit(edx7, 22);
  f.amx_int8 = f.amx_tile && bit(edx7, 25);
  if (subleaves >= 1) {
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx512_bf16 = f.avx512 && bit(eax, 5);
  }
#endif
  return f;
}

inline const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe_cpu();
  return features;
}

}  // namespace flashcte::internal

#endif  // FLASHCTE_CORE_CPU_H_
