// `flashcte bench --impl peak` and the SGEMM roofline's OpenBLAS core, end to end: the program's
// JSON lines are parsed as flat JSON objects and checked for their fields. No timing thresholds:
// a rate only has to be positive and finite.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "hwy/detect_targets.h"
#include "hwy/targets.h"

#ifndef FLASHCTE_CLI_PATH
#error "FLASHCTE_CLI_PATH must name the flashcte binary"
#endif
#ifndef FLASHCTE_CLI_HAS_OPENBLAS
#error "FLASHCTE_CLI_HAS_OPENBLAS must say whether the flashcte binary links OpenBLAS"
#endif

namespace flashcte::tools {
namespace {

struct Output {
  int exit_code = -1;
  std::string out, err;
};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

Output RunCli(const std::string& args) {
  const std::string base = ::testing::TempDir() + "flashcte_bench_cli_" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const std::string command = std::string("\"") + FLASHCTE_CLI_PATH + "\" " + args + " >" + base +
                              ".out 2>" + base + ".err";
  const int status = std::system(command.c_str());
  Output o;
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  o.out = ReadAll(base + ".out");
  o.err = ReadAll(base + ".err");
  return o;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream s(text);
  for (std::string line; std::getline(s, line);) lines.push_back(line);
  return lines;
}

// Parses one flat JSON object (string, number, true/false/null values) into key -> value, with
// strings unquoted. Returns false on anything else, so a malformed line fails the test.
bool ParseFlatJson(const std::string& line, std::map<std::string, std::string>* out) {
  size_t i = 0;
  auto skip = [&] {
    while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
  };
  auto string = [&](std::string* s) {
    if (i >= line.size() || line[i] != '"') return false;
    for (++i; i < line.size() && line[i] != '"'; ++i) {
      if (line[i] == '\\' && ++i >= line.size()) return false;
      *s += line[i];
    }
    return i++ < line.size();
  };
  skip();
  if (i >= line.size() || line[i++] != '{') return false;
  for (;;) {
    skip();
    std::string key, value;
    if (!string(&key)) return false;
    skip();
    if (i >= line.size() || line[i++] != ':') return false;
    skip();
    if (i < line.size() && line[i] == '"') {
      if (!string(&value)) return false;
    } else {
      const size_t start = i;
      while (i < line.size() && line[i] != ',' && line[i] != '}') ++i;
      value = line.substr(start, i - start);
      while (!value.empty() && std::isspace(static_cast<unsigned char>(value.back()))) {
        value.pop_back();
      }
      char* end = nullptr;
      const bool number = !value.empty() && (std::strtod(value.c_str(), &end), *end == '\0');
      if (!number && value != "true" && value != "false" && value != "null") return false;
    }
    if (!out->emplace(key, value).second) return false;  // a key twice
    skip();
    if (i < line.size() && line[i] == ',') {
      ++i;
      continue;
    }
    if (i >= line.size() || line[i++] != '}') return false;
    skip();
    return i == line.size();
  }
}

double Number(const std::map<std::string, std::string>& j, const std::string& key) {
  auto it = j.find(key);
  return it == j.end() ? std::nan("") : std::strtod(it->second.c_str(), nullptr);
}

bool CpuHasBf16Dot() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

TEST(BenchPeak, JsonLinesPerTargetWithPositiveRates) {
  const Output o = RunCli("bench --impl peak --json true --reps 1 --threads 2");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const std::string baseline = hwy::TargetName(HWY_STATIC_TARGET);
  int baseline_lines = 0, bf16_measured = 0, bf16_unavailable = 0;
  for (const std::string& line : Lines(o.out)) {
    std::map<std::string, std::string> j;
    ASSERT_TRUE(ParseFlatJson(line, &j)) << "not a flat JSON object: " << line;
    EXPECT_EQ(j["impl"], "peak") << line;
    ASSERT_TRUE(j["kind"] == "fma_f32" || j["kind"] == "bf16_dot") << line;
    EXPECT_FALSE(j["target"].empty()) << line;
    EXPECT_FALSE(j["counting"].empty()) << line;
    if (j["available"] == "false") {
      EXPECT_EQ(j["kind"], "bf16_dot") << "every fp32 target that runs is measured: " << line;
      EXPECT_FALSE(j["note"].empty()) << line;
      EXPECT_EQ(j.count("gflops"), 0u) << line;
      ++bf16_unavailable;
      continue;
    }
    ASSERT_EQ(j["available"], "true") << line;
    const double gflops = Number(j, "gflops"), best = Number(j, "best_gflops");
    EXPECT_TRUE(std::isfinite(gflops) && gflops > 0) << line;
    EXPECT_GE(best, gflops) << line;
    const double threads = Number(j, "threads");
    EXPECT_TRUE(threads == 1 || threads == 2) << line;
    EXPECT_GT(Number(j, "chains"), 0) << line;
    if (j["kind"] == "fma_f32") {
      // 2 FLOPs per fp32 lane per multiply-add.
      EXPECT_EQ(Number(j, "flops_per_instruction"), Number(j, "vector_bits") / 32 * 2) << line;
      if (j["target"] == baseline) ++baseline_lines;
    } else {
      EXPECT_EQ(j["target"], "AVX512_BF16") << line;
      EXPECT_EQ(Number(j, "flops_per_instruction"), 64) << line;
      ++bf16_measured;
    }
  }
  EXPECT_GE(baseline_lines, 1) << "no line for the baseline target " << baseline << ":\n" << o.out;
  if (CpuHasBf16Dot()) {
    EXPECT_GE(bf16_measured, 1) << o.out;
    EXPECT_EQ(bf16_unavailable, 0) << o.out;
  } else {
    EXPECT_EQ(bf16_measured, 0) << o.out;
    EXPECT_EQ(bf16_unavailable, 1) << o.out;
  }
}

TEST(BenchPeak, TableStatesTheCountingAndTheBf16Dot) {
  const Output o = RunCli("bench --impl peak --reps 1 --threads 1");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("fp32 FMA peak: "), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("2 FLOPs per fp32 lane per multiply-add"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("64 FLOPs per zmm vdpbf16ps"), std::string::npos) << o.out;
  if (CpuHasBf16Dot()) {
    EXPECT_NE(o.out.find("bf16 dot peak: "), std::string::npos) << o.out;
  } else {
    EXPECT_NE(o.out.find("bf16_dot: not available"), std::string::npos) << o.out;
  }
}

TEST(BenchPeak, RejectsFlagsItDoesNotUse) {
  Output o = RunCli("bench --impl peak --sq 128");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("--sq: not used by --impl peak"), std::string::npos) << o.err;
  o = RunCli("bench --impl peak --openblas-core Haswell");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("--openblas-core: not used by --impl peak"), std::string::npos) << o.err;
  o = RunCli("bench --impl peak --reps 0");
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("--reps: 0 is out of range"), std::string::npos) << o.err;
}

// The tests run OpenBLAS with the environment they were given (--openblas-core inherit): the
// machine may set OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE because other cores misbehave on it, and
// only the one benchmark command that measures the roofline may change them.
constexpr char kSmallSgemm[] =
    "bench --impl sgemm --sq 256 --heads 1 --kv-heads 1 --reps 1 --openblas-core inherit";

TEST(BenchSgemm, ReportsTheOpenBlasCoreItRan) {
  if (!FLASHCTE_CLI_HAS_OPENBLAS) GTEST_SKIP() << "this build of flashcte has no OpenBLAS";
  Output o = RunCli(std::string(kSmallSgemm) + " --json");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const std::vector<std::string> lines = Lines(o.out);
  ASSERT_EQ(lines.size(), 1u) << o.out;
  std::map<std::string, std::string> j;
  ASSERT_TRUE(ParseFlatJson(lines[0], &j)) << lines[0];
  EXPECT_EQ(j["impl"], "sgemm");
  EXPECT_FALSE(j["openblas_core"].empty()) << lines[0];
  EXPECT_FALSE(j["openblas_core_reason"].empty()) << lines[0];
  EXPECT_EQ(j["openblas_core_overridden"], "false") << lines[0];
  // A core the environment forces (OPENBLAS_CORETYPE) is reported as such, with none detected;
  // otherwise the core OpenBLAS detected is the one it ran.
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  if (forced != nullptr && *forced != '\0') {
    EXPECT_EQ(j["openblas_core_detected"], "null") << lines[0];
    EXPECT_EQ(j["openblas_core"], forced) << lines[0];
  } else {
    EXPECT_EQ(j["openblas_core_detected"], j["openblas_core"]) << lines[0];
  }
  const std::string core = j["openblas_core"];

  o = RunCli(kSmallSgemm);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("OpenBLAS core: " + core + " ("), std::string::npos) << o.out;
}

// Bad --openblas-core values are refused before OpenBLAS runs.
TEST(BenchSgemm, RejectsBadCoreNames) {
  Output o = RunCli("bench --impl sgemm --sq 256 --heads 1 --kv-heads 1 --openblas-core 'Zen;x'");
  EXPECT_EQ(o.exit_code, 2) << o.err;
  o = RunCli("bench --impl flashcte --openblas-core Zen");
  EXPECT_EQ(o.exit_code, 2) << o.err;
}

}  // namespace
}  // namespace flashcte::tools
