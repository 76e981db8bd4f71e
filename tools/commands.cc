#include "tools/commands.h"

#include <cstdio>

namespace flashcte::tools {

int UsageError(const std::string& command, const std::string& message) {
  std::fprintf(stderr, "flashcte %s: %s\n(see 'flashcte %s --help')\n", command.c_str(),
               message.c_str(), command.c_str());
  return kExitUsage;
}

int ParseCommandFlags(const std::string& command, const std::vector<std::string>& args,
                      const std::vector<FlagSpec>& specs,
                      const std::function<void(const std::vector<FlagSpec>&)>& print_help,
                      ParsedFlags* f) {
  std::string error;
  if (!ParseFlags(args, specs, f, &error)) return UsageError(command, error);
  if (f->help_requested()) {
    print_help(specs);
    return kExitOk;
  }
  return kContinue;
}

int RuntimeError(const std::string& command, const std::string& message) {
  std::fprintf(stderr, "flashcte %s: %s\n", command.c_str(), message.c_str());
  return kExitRuntime;
}

std::string ExplainStatus(const std::string& message,
                          const std::map<std::string, std::string>& names) {
  const size_t colon = message.find(": ");
  if (colon == std::string::npos) return message;
  auto it = names.find(message.substr(0, colon));
  if (it == names.end()) return message;
  return it->second + " (" + it->first + ")" + message.substr(colon);
}

std::string FormatG(double x, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*g", digits, x);
  return buf;
}

}  // namespace flashcte::tools
