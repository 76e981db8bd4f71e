// Bad-input matrix for the `flashcte` program: unreadable, malformed and truncated .npy files,
// wrong dtypes and shapes, bad flag values. Each row runs the built binary and expects a non-zero
// exit code (2: usage, 1: runtime, as tools/main.cc documents), no crash (a signal is a failure),
// and a message on stderr naming the offending flag and, for files, the file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "tools/npy.h"

#ifndef FLASHCTE_CLI_PATH
#error "FLASHCTE_CLI_PATH must name the flashcte binary"
#endif

namespace flashcte::tools {
namespace {

std::string dir() {
  static const std::string d = [] {
    std::string p = ::testing::TempDir() + "flashcte_reliability_cli_" + std::to_string(getpid());
    mkdir(p.c_str(), 0700);
    return p + "/";
  }();
  return d;
}

std::string path(const std::string& name) { return dir() + name + ".npy"; }

// Removes the scratch directory when the test program ends.
class ScratchCleanup : public ::testing::Environment {
 public:
  void TearDown() override { std::filesystem::remove_all(dir()); }
};
[[maybe_unused]] const auto* const kCleanup =
    ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

void write_bytes(const std::string& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary);
  f << bytes;
}

std::string read_text(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Writes a float32 (or other dtype) .npy of `shape` filled with 0.25-ish values.
void save(const std::string& name, std::vector<int64_t> shape,
          NpyDtype dtype = NpyDtype::kFloat32) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<uint8_t> data(static_cast<size_t>(n) * npy_itemsize(dtype), 0x3E);
  std::string error;
  ASSERT_TRUE(write_npy(path(name), dtype, shape, data.data(), &error)) << error;
}

// A .npy header by hand, for headers write_npy would never produce.
std::string npy_with_header(const std::string& dict, size_t data_bytes, char major = 1) {
  std::string h = dict;
  while ((10 + h.size() + 1) % 64 != 0) h += ' ';
  h += '\n';
  std::string s = "\x93NUMPY";
  s += major;
  s += '\0';
  s += static_cast<char>(h.size() & 0xFF);
  s += static_cast<char>(h.size() >> 8);
  return s + h + std::string(data_bytes, '\0');
}

// The valid inputs every row starts from: q (2, 8, 4), k (1, 4, 8), v (1, 8, 4), float32.
void valid_inputs() {
  save("q", {2, 8, 4});
  save("k", {1, 4, 8});
  save("v", {1, 8, 4});
}

std::string run_args(const std::string& q = path("q"), const std::string& k = path("k"),
                     const std::string& v = path("v")) {
  return "run --q " + q + " --k " + k + " --v " + v + " --out " + path("out");
}

struct CliRow {
  const char* name;
  std::function<void()> files;  // writes the row's files (after the valid inputs)
  std::function<std::string()> args;
  int exit_code;                      // 1 runtime, 2 usage
  std::vector<std::string> expected;  // substrings of stderr: the flag, the file, the rule
};

std::vector<CliRow> cli_rows() {
  return {
      // --- unreadable, malformed and truncated files ---
      {"missing_file",
       [] {},
       [] { return run_args(dir() + "no_such_file.npy"); },
       1,
       {"--q", "no_such_file.npy", "cannot open"}},
      {"directory_as_file", [] {}, [] { return run_args(path("q"), dir()); }, 1, {"--k", dir()}},
      {"empty_file",
       [] { write_bytes(path("empty"), ""); },
       [] { return run_args(path("empty")); },
       1,
       {"--q", "empty.npy"}},
      {"not_npy",
       [] { write_bytes(path("text"), "q,k,v\n1,2,3\n"); },
       [] { return run_args(path("q"), path("q"), path("text")); },
       1,
       {"--v", "text.npy", "not a .npy file"}},
      {"truncated_header",
       [] {
         write_bytes(
             path("trunc_h"),
             npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4, 8), }", 128)
                 .substr(0, 30));
       },
       [] { return run_args(path("q"), path("trunc_h")); },
       1,
       {"--k", "trunc_h.npy", "truncated header"}},
      {"truncated_data",
       [] {
         const std::string full =
             npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 8, 4), }", 128);
         write_bytes(path("trunc_d"), full.substr(0, full.size() - 5));
       },
       [] { return run_args(path("q"), path("k"), path("trunc_d")); },
       1,
       {"--v", "trunc_d.npy", "truncated data"}},
      {"huge_shape_tiny_file",
       [] {
         write_bytes(
             path("huge"),
             npy_with_header(
                 "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000000000, 4), }",
                 16));
       },
       [] { return run_args(path("huge")); },
       1,
       {"--q", "huge.npy"}},
      {"unsupported_version",
       [] {
         write_bytes(path("v9"),
                     npy_with_header(
                         "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 8, 4), }", 256, 9));
       },
       [] { return run_args(path("v9")); },
       1,
       {"--q", "v9.npy", "version"}},
      {"malformed_dict",
       [] {
         write_bytes(path("dict"),
                     npy_with_header(
                         "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 8, 4), }", 256));
       },
       [] { return run_args(path("dict")); },
       1,
       {"--q", "dict.npy", "fortran_order"}},
      // --- wrong dtypes ---
      {"q_int32",
       [] {
         save("q_i32", {2, 8, 4}, NpyDtype::kInt32);
       },
       [] { return run_args(path("q_i32")); },
       1,
       {"--q", "q_i32.npy", "not a floating-point type"}},
      {"k_int64",
       [] {
         save("k_i64", {1, 4, 8}, NpyDtype::kInt64);
       },
       [] { return run_args(path("q"), path("k_i64")); },
       1,
       {"--k", "k_i64.npy", "not a floating-point type"}},
      {"v_big_endian",
       [] {
         write_bytes(path("v_be"),
                     npy_with_header(
                         "{'descr': '>f4', 'fortran_order': False, 'shape': (1, 8, 4), }", 128));
       },
       [] { return run_args(path("q"), path("k"), path("v_be")); },
       1,
       {"--v", "v_be.npy", "unsupported dtype"}},
      {"v_complex",
       [] {
         write_bytes(path("v_c8"),
                     npy_with_header(
                         "{'descr': '<c8', 'fortran_order': False, 'shape': (1, 8, 4), }", 256));
       },
       [] { return run_args(path("q"), path("k"), path("v_c8")); },
       1,
       {"--v", "v_c8.npy", "unsupported dtype"}},
      {"bounds_float64_fraction",
       [] {
         const std::vector<double> lo = {0, 0, 0, 0, 0, 0, 0, 0};
         const std::vector<double> hi = {8, 8, 8, 8.5, 8, 8, 8, 8};
         std::string e;
         write_npy(path("bmin"), NpyDtype::kFloat64, {8, 1}, lo.data(), &e);
         write_npy(path("bmax"), NpyDtype::kFloat64, {8, 1}, hi.data(), &e);
       },
       [] { return run_args() + " --bound-min " + path("bmin") + " --bound-max " + path("bmax"); },
       1,
       {"--bound-max", "bmax.npy"}},
      // --- wrong shapes (the library's rule, translated to the flag and file) ---
      {"q_rank2",
       [] {
         save("q2", {8, 4});
       },
       [] { return run_args(path("q2")); },
       1,
       {"--q", "q2.npy", "rank 3"}},
      {"k_rank4",
       [] {
         save("k4", {1, 1, 4, 8});
       },
       [] { return run_args(path("q"), path("k4")); },
       1,
       {"--k", "k4.npy"}},
      {"k_head_dim_mismatch",
       [] {
         save("k_d5", {1, 5, 8});
       },
       [] { return run_args(path("q"), path("k_d5")); },
       1,
       {"--k", "k_d5.npy", "head dim"}},
      {"v_length_mismatch",
       [] {
         save("v_s7", {1, 7, 4});
       },
       [] { return run_args(path("q"), path("k"), path("v_s7")); },
       1,
       {"--v", "v_s7.npy", "Skv"}},
      {"bs_not_multiple",
       [] {
         save("q3", {3, 8, 4});
         save("k2", {2, 4, 8});
         save("v2", {2, 8, 4});
       },
       [] { return run_args(path("q3"), path("k2"), path("v2")); },
       1,
       {"--q", "q3.npy", "multiple"}},
      {"sink_wrong_shape",
       [] {
         save("sink3", {3, 1});
       },
       [] { return run_args() + " --sink " + path("sink3"); },
       1,
       {"--sink", "sink3.npy"}},
      {"bounds_wrong_length",
       [] {
         save("b7a", {7, 1}, NpyDtype::kInt32);
         save("b7b", {7, 1}, NpyDtype::kInt32);
       },
       [] { return run_args() + " --bound-min " + path("b7a") + " --bound-max " + path("b7b"); },
       1,
       {"--bound-min", "b7a.npy", "(Sq, 1)"}},
      {"k_prior_head_dim",
       [] {
         save("kp", {1, 3, 5});
         save("vp", {1, 5, 4});
       },
       [] { return run_args() + " --k-prior " + path("kp") + " --v-prior " + path("vp"); },
       1,
       {"--k-prior", "kp.npy"}},
      // --- bad flag values ---
      {"scale_not_a_number",
       [] {},
       [] { return run_args() + " --scale abc"; },
       2,
       {"--scale", "abc"}},
      {"scale_overflows_float",
       [] {},
       [] { return run_args() + " --scale 1e39"; },
       2,
       {"--scale", "finite"}},
      {"scale_nan", [] {}, [] { return run_args() + " --scale nan"; }, 2, {"--scale"}},
      {"sliding_window_negative",
       [] {},
       [] { return run_args() + " --sliding-window -1"; },
       2,
       {"--sliding-window"}},
      {"cp_degree_zero",
       [] {},
       [] { return run_args() + " --cp-offset 0 --global-cp-deg 0"; },
       2,
       {"--global-cp-deg"}},
      {"cp_degree_without_offset",
       [] {},
       [] { return run_args() + " --global-cp-deg 2"; },
       2,
       {"--global-cp-deg", "--cp-offset"}},
      {"threads_negative", [] {}, [] { return run_args() + " --threads -1"; }, 2, {"--threads"}},
      {"q_block_too_large",
       [] {},
       [] { return run_args() + " --q-block 5000"; },
       2,
       {"--q-block", "4096"}},
      {"section_not_multiple",
       [] {},
       [] { return run_args() + " --kv-tile 4 --section 10"; },
       2,
       {"--section", "multiple"}},
      {"dtype_float64", [] {}, [] { return run_args() + " --dtype float64"; }, 2, {"--dtype"}},
      {"bool_not_a_bool",
       [] {},
       [] { return run_args() + " --tp-q maybe"; },
       2,
       {"--tp-q", "maybe"}},
      {"unknown_flag", [] {}, [] { return run_args() + " --bogus-flag 3"; }, 2, {"--bogus-flag"}},
      {"flag_without_value", [] {}, [] { return run_args() + " --scale"; }, 2, {"--scale"}},
      {"missing_q",
       [] {},
       [] { return "run --k " + path("k") + " --v " + path("v") + " --out x.npy"; },
       2,
       {"--q"}},
      {"prior_used_len_beyond_prior",
       [] {
         save("kp8", {1, 4, 8});
         save("vp8", {1, 8, 4});
       },
       [] {
         return run_args() + " --k-prior " + path("kp8") + " --v-prior " + path("vp8") +
                " --prior-used-len 9";
       },
       2,
       {"--prior-used-len", "S_prior"}},
      {"k_prior_without_v_prior",
       [] {},
       [] { return run_args() + " --k-prior " + path("k"); },
       2,
       {"--k-prior", "--v-prior"}},
      {"cache_softmax_without_outputs",
       [] {},
       [] { return run_args() + " --cache-softmax true"; },
       2,
       {"--cache-softmax", "--neg-max"}},
      {"cache_softmax_sq_not_multiple_of_128",
       [] {},
       [] {
         return run_args() + " --cache-softmax true --neg-max " + path("nm") + " --sum-recip " +
                path("sr");
       },
       2,
       {"--cache-softmax", "128"}},
      {"out_unwritable",
       [] {},
       [] {
         return "run --q " + path("q") + " --k " + path("k") + " --v " + path("v") + " --out " +
                dir() + "no_such_dir/out.npy";
       },
       1,
       {"--out", "no_such_dir/out.npy"}},
      {"unknown_command",
       [] {},
       [] { return std::string("frobnicate"); },
       2,
       {"unknown command", "frobnicate"}},
      {"plan_negative_length", [] {}, [] { return std::string("plan --sq -5"); }, 2, {"--sq"}},
      {"plan_head_dim_too_large",
       [] {},
       [] { return std::string("plan --sq 128 --d 2048"); },
       2,
       {"--d"}},
  };
}

class CliBadInput : public ::testing::TestWithParam<CliRow> {};

TEST_P(CliBadInput, FailsWithAMessageNamingTheFlag) {
  const CliRow& row = GetParam();
  valid_inputs();
  row.files();
  const std::string log = dir() + row.name + ".log";
  const std::string command =
      std::string("\"") + FLASHCTE_CLI_PATH + "\" " + row.args() + " >" + log + " 2>&1";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << "killed by a signal: " << command;
  const std::string output = read_text(log);
  EXPECT_EQ(WEXITSTATUS(status), row.exit_code) << command << "\n" << output;
  for (const std::string& s : row.expected) {
    EXPECT_NE(output.find(s), std::string::npos)
        << "the message does not mention \"" << s << "\":\n"
        << output;
  }
  // A refused run writes no output file.
  EXPECT_NE(access(path("out").c_str(), F_OK), 0) << "out.npy was written";
  std::remove(path("out").c_str());
}

INSTANTIATE_TEST_SUITE_P(Cli, CliBadInput, ::testing::ValuesIn(cli_rows()),
                         [](const ::testing::TestParamInfo<CliRow>& p) {
                           return std::string(p.param.name);
                         });

// The valid starting point runs, so each row fails for its own defect.
TEST(CliBadInputs, TheValidStartingPointRuns) {
  valid_inputs();
  const std::string command =
      std::string("\"") + FLASHCTE_CLI_PATH + "\" " + run_args() + " >/dev/null 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0);
  EXPECT_EQ(access(path("out").c_str(), F_OK), 0);
  std::remove(path("out").c_str());
  std::printf("[ bad inputs ] CLI rows: %zu\n", cli_rows().size());
}

}  // namespace
}  // namespace flashcte::tools
