// libFuzzer target for the flag parser: the input is split at NUL bytes into an argument vector
// and parsed against a table with every flag kind.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tools/args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashcte::tools;
  static const std::vector<FlagSpec> specs = {
      {"path", FlagKind::kString, ""},
      {"flag", FlagKind::kBool, ""},
      {"n", FlagKind::kInt, "", -5, 1000},
      {"x", FlagKind::kFloat, ""},
      {"list", FlagKind::kIntList, "", 0, 1 << 20},
      {"dtype", FlagKind::kChoice, "", 0, 0, "float32|bfloat16|float16"},
  };
  std::vector<std::string> args(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.emplace_back();
    } else {
      args.back() += static_cast<char>(data[i]);
    }
  }
  ParsedFlags flags;
  std::string error;
  if (!ParseFlags(args, specs, &flags, &error)) {
    if (error.empty()) std::abort();
    return 0;
  }
  const int64_t n = flags.integer("n", 0);
  if (n < -5 || n > 1000) std::abort();
  for (int64_t x : flags.list("list")) {
    if (x < 0 || x > (1 << 20)) std::abort();
  }
  return 0;
}
