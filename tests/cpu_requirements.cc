#include "tests/cpu_requirements.h"

#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <set>
#include <sstream>
#include <string>

namespace flashcte::test {
namespace {

// The flags of the first processor in /proc/cpuinfo (every core of these machines has the same).
// Empty where there is no such file (not Linux): then nothing is required.
const std::set<std::string>& cpu_flags() {
  static const std::set<std::string> flags = [] {
    std::set<std::string> out;
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("flags", 0) != 0) continue;
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) out.insert(w);
      break;
    }
    return out;
  }();
  return flags;
}

#if defined(__x86_64__)
bool has_all(std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (!cpu_has_flag(n)) return false;
  }
  return true;
}

// FLASHCTE_ALLOW_SKIP names `path` (or "all").
bool allowed_to_skip(FastPath path) {
  const char* env = std::getenv("FLASHCTE_ALLOW_SKIP");
  if (env == nullptr) return false;
  std::istringstream items(env);
  for (std::string item; std::getline(items, item, ',');) {
    if (item == "all" || item == fast_path_name(path)) return true;
  }
  return false;
}

// FLASHCTE_SIMD_TARGET set to a target below AVX3 (src/simd/ops.cc's cap).
bool capped_below_avx3(std::string* cap) {
  const char* env = std::getenv("FLASHCTE_SIMD_TARGET");
  if (env == nullptr || *env == '\0') return false;
  *cap = env;
  return *cap != "AVX3" && *cap != "AVX3_DL";
}
#endif

}  // namespace

const char* fast_path_name(FastPath path) { return path == FastPath::kAvx3 ? "avx3" : "native"; }

bool cpu_has_flag(const std::string& flag) { return cpu_flags().count(flag) != 0; }

bool must_run(FastPath path, std::string* reason) {
#if defined(__x86_64__)
  const bool avx3 = has_all({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"});
  const bool native = avx3 && has_all({"avx512_bf16", "avx512_vnni"});
  const std::string what = path == FastPath::kAvx3 ? "AVX-512 (avx512f/bw/vl/dq/cd)"
                                                   : "AVX-512 with avx512_bf16 and avx512_vnni";
  std::string cap;
  if (!(path == FastPath::kAvx3 ? avx3 : native)) {
    *reason = "not required: /proc/cpuinfo does not list " + what;
    return false;
  }
  if (capped_below_avx3(&cap)) {
    *reason = "not required: FLASHCTE_SIMD_TARGET=" + cap + " caps the dispatch below AVX3";
    return false;
  }
  if (allowed_to_skip(path)) {
    *reason = std::string("ALLOWED TO SKIP by FLASHCTE_ALLOW_SKIP=") +
              std::getenv("FLASHCTE_ALLOW_SKIP") + " although /proc/cpuinfo lists " + what;
    return false;
  }
  *reason = "required: /proc/cpuinfo lists " + what +
            " (FLASHCTE_ALLOW_SKIP=" + fast_path_name(path) + " would allow the skip)";
  return true;
#else
  // Both paths are x86's (and under qemu-user, /proc/cpuinfo is the x86 host's).
  (void)path;
  *reason = "not required: not an x86 build";
  return false;
#endif
}

}  // namespace flashcte::test
