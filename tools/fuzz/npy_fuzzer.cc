// libFuzzer target for the .npy parser: any input must parse or fail with a message, never
// crash, and whatever parses must serialize and parse back to the same array.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tools/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashcte::tools;
  NpyArray a;
  std::string error;
  if (!parse_npy(data, size, &a, &error)) {
    if (error.empty()) std::abort();  // every failure must say why
    return 0;
  }
  const std::vector<uint8_t> bytes = serialize_npy(a.dtype, a.shape, a.data.data());
  NpyArray b;
  if (!parse_npy(bytes.data(), bytes.size(), &b, &error) || b.dtype != a.dtype ||
      b.shape != a.shape || b.data != a.data) {
    std::abort();
  }
  return 0;
}
