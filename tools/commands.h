// The subcommands of the `flashcte` program and what they share: exit codes, error printing and
// the translation of library messages into flag names.
//
// Exit codes: 0 success; 2 a usage error (the command line cannot work as written: an unknown
// flag, a malformed or out-of-range value, a missing or conflicting flag, --cache-softmax for a
// query length the Neuron layout cannot hold); 1 a runtime error (a file that cannot be read or
// parsed, inputs the kernel rejects, an output that cannot be written, a failed self-check).
#ifndef FLASHCTE_TOOLS_COMMANDS_H_
#define FLASHCTE_TOOLS_COMMANDS_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tools/args.h"

namespace flashcte::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntime = 1;
inline constexpr int kExitUsage = 2;

int RunCommand(const std::vector<std::string>& args);
int DemoCommand(const std::vector<std::string>& args);
int PlanCommand(const std::vector<std::string>& args);
int BenchCommand(const std::vector<std::string>& args);
int StrategyCommand(const std::vector<std::string>& args);

// What ParseCommandFlags returns when the command goes on.
inline constexpr int kContinue = -1;

// A command's flags, parsed against `specs` into *f: kExitUsage after printing the error,
// kExitOk after print_help(specs) when --help was asked, else kContinue.
int ParseCommandFlags(const std::string& command, const std::vector<std::string>& args,
                      const std::vector<FlagSpec>& specs,
                      const std::function<void(const std::vector<FlagSpec>&)>& print_help,
                      ParsedFlags* f);

// Print "flashcte <command>: <message>" to stderr (usage errors add a pointer to --help) and
// return the matching exit code.
int UsageError(const std::string& command, const std::string& message);
int RuntimeError(const std::string& command, const std::string& message);

// Library errors read "<argument>: <rule>"; this swaps the argument for the flag that set it
// (per `names`, e.g. "tiles.q_block" -> "--q-block") so the user knows what to change.
std::string ExplainStatus(const std::string& message,
                          const std::map<std::string, std::string>& names);

// Formats x with `digits` significant digits, e.g. 1.23e+09 or 0.0123.
std::string FormatG(double x, int digits = 4);

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_COMMANDS_H_
