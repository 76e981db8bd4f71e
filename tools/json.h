// bench's --json output: one JSON object per line, written by nlohmann-json (nlohmann-json3-dev)
// with the fields in the order they are set (ordered_json), so a line reads like the table.
#ifndef FLASHCTE_TOOLS_JSON_H_
#define FLASHCTE_TOOLS_JSON_H_

#include <cstdio>
#include <nlohmann/json.hpp>

namespace flashcte::tools {

using Json = nlohmann::ordered_json;

// `j` on one line of stdout. Bytes that are not UTF-8 (none are expected: every string is ASCII)
// become U+FFFD rather than an exception.
inline void PrintJsonLine(const Json& j) {
  std::puts(j.dump(-1, ' ', false, Json::error_handler_t::replace).c_str());
}

}  // namespace flashcte::tools

#endif  // FLASHCTE_TOOLS_JSON_H_
