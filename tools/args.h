// Command-line flags of the form `--name value` (or `--name=value`), declared per subcommand in a
// table so that parsing, range checks and the help text come from one place. CLI11 splits the
// arguments and lays out the help; the table's kinds are checked by strict parsers of this file's
// own (CLI11's integer conversion would take "0x10" and "010"), so that errors name the flag and
// say what was expected. ParseFlags is pure (no I/O, no globals), so a fuzzer can drive it with
// arbitrary argument vectors.
#ifndef FLASHCTE_TOOLS_ARGS_H_
#define FLASHCTE_TOOLS_ARGS_H_

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace flashcte::tools {

enum class FlagKind {
  kString,   // any text (file names)
  kBool,     // true/false/1/0; a bare `--flag` means true
  kInt,      // a decimal integer within [min, max]
  kFloat,    // a finite decimal or hex floating-point number
  kIntList,  // comma-separated integers, each within [min, max]
  kChoice,   // one of the '|'-separated words in `choices`
};

struct FlagSpec {
  const char* name;  // without the leading "--"
  FlagKind kind;
  const char* help;
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();
  const char* choices = nullptr;  // kChoice only, e.g. "float32|bfloat16|float16"
};

struct FlagValue {
  std::string text;  // as written
  bool boolean = false;
  int64_t integer = 0;
  double real = 0;
  std::vector<int64_t> list;
};

class ParsedFlags {
 public:
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  bool help_requested() const { return help_; }

  // Typed getters: the value given, or `fallback` when the flag was not given. The kind was
  // checked while parsing, so they cannot fail.
  const std::string& text(const std::string& name, const std::string& fallback = empty_) const;
  bool boolean(const std::string& name, bool fallback) const;
  int64_t integer(const std::string& name, int64_t fallback) const;
  double real(const std::string& name, double fallback) const;
  std::vector<int64_t> list(const std::string& name) const;

 private:
  friend bool ParseFlags(const std::vector<std::string>&, const std::vector<FlagSpec>&,
                         ParsedFlags*, std::string*);
  static const std::string empty_;
  std::map<std::string, FlagValue> values_;
  bool help_ = false;
};

// Parses `args` (without the program and subcommand names) against `specs`. "-h" or "--help"
// anywhere sets help_requested() unless a value is malformed (CLI11 checks values first). Returns
// false with *error naming the flag on an unknown flag, a missing or malformed value, a value out
// of range, a flag given twice or a stray positional argument.
bool ParseFlags(const std::vector<std::string>& args, const std::vector<FlagSpec>& specs,
                ParsedFlags* out, std::string* error);

// One line per flag: "  --name VALUE   help".
std::string FlagsHelp(const std::vector<FlagSpec>& specs);

// Strict scalar parsers, exposed for reuse and tests: the whole string must be consumed.
bool ParseInt64(const std::string& s, int64_t* value);
bool ParseBool(const std::string& s, bool* value);
bool ParseFiniteDouble(const std::string& s, double* value);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_ARGS_H_
