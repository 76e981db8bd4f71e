// flashcte: the command line of the flashcte library. `flashcte` alone runs the demo.
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "flashcte/flashcte.h"
#include "tools/commands.h"

namespace {

constexpr char kUsage[] =
    "flashcte: the Neuron attention_cte prefill flash-attention kernel, on the CPU\n"
    "\n"
    "usage: flashcte [COMMAND] [--flag value ...]\n"
    "\n"
    "commands:\n"
    "  demo    a Llama-3-8B-shaped prefill on random inputs, timed and checked against the\n"
    "          float64 reference (what `flashcte` alone runs)\n"
    "  run     attention_cte on .npy files: --q Q.npy --k K.npy --v V.npy --out OUT.npy ...\n"
    "  plan    the schedule for a shape and mode, without computing anything\n"
    "  bench   time one configuration against a materialized OpenBLAS baseline and SGEMM\n"
    "  strategy  which attention strategy optimum-neuron, NxD Inference and flashcte pick for\n"
    "          a shape, and why\n"
    "  help    this text\n"
    "\n"
    "'flashcte COMMAND --help' lists a command's flags. Exit codes: 0 success, 1 runtime error\n"
    "(unreadable or rejected inputs, failed check), 2 usage error.\n";

int Dispatch(const std::vector<std::string>& argv) {
  using namespace flashcte::tools;
  if (argv.empty()) return DemoCommand({});
  const std::string& command = argv[0];
  if (command == "--version") {  // the library's version: CMakeLists.txt's project(VERSION)
    std::printf("flashcte %s\n", flashcte::version().c_str());
    return kExitOk;
  }
  const std::vector<std::string> rest(argv.begin() + 1, argv.end());
  if (command == "run") return RunCommand(rest);
  if (command == "demo") return DemoCommand(rest);
  if (command == "plan") return PlanCommand(rest);
  if (command == "bench") return BenchCommand(rest);
  if (command == "strategy") return StrategyCommand(rest);
  if (command == "help" || command == "--help" || command == "-h") {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  // Flags without a command belong to the demo (`flashcte --seqlen 1024`).
  if (command.compare(0, 2, "--") == 0) return DemoCommand(argv);
  std::fprintf(stderr, "flashcte: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return kExitUsage;
}

}  // namespace

int main(int argc, char** argv) {
  // Nothing may escape main: an allocation failure or any other exception becomes a message
  // and a runtime-error exit code instead of std::terminate.
  try {
    return Dispatch(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "flashcte: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flashcte: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "flashcte: unknown error\n");
  }
  return flashcte::tools::kExitRuntime;
}
