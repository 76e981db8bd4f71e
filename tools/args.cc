#include "tools/args.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace flashcte::tools {
namespace {

const FlagSpec* find_spec(const std::vector<FlagSpec>& specs, const std::string& name) {
  for (const FlagSpec& s : specs) {
    if (name == s.name) return &s;
  }
  return nullptr;
}

std::string range_text(const FlagSpec& spec) {
  return "[" + std::to_string(spec.min) + ", " + std::to_string(spec.max) + "]";
}

// Shows a user's value in a message without letting control characters or a megabyte of text
// through.
std::string shown(const std::string& s) {
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 60; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (s.size() > 60) out += "...";
  return out + "'";
}

bool parse_value(const FlagSpec& spec, const std::string& text, FlagValue* v, std::string* error) {
  const std::string flag = std::string("--") + spec.name;
  v->text = text;
  switch (spec.kind) {
    case FlagKind::kString:
      if (text.empty()) {
        *error = flag + ": the value is empty";
        return false;
      }
      return true;
    case FlagKind::kBool:
      if (!ParseBool(text, &v->boolean)) {
        *error = flag + ": expected true, false, 1 or 0, got " + shown(text);
        return false;
      }
      return true;
    case FlagKind::kInt:
      if (!ParseInt64(text, &v->integer)) {
        *error = flag + ": expected an integer, got " + shown(text);
        return false;
      }
      if (v->integer < spec.min || v->integer > spec.max) {
        *error = flag + ": " + text + " is out of range " + range_text(spec);
        return false;
      }
      return true;
    case FlagKind::kFloat:
      if (!ParseFiniteDouble(text, &v->real)) {
        *error = flag + ": expected a finite number, got " + shown(text);
        return false;
      }
      return true;
    case FlagKind::kIntList: {
      v->list.clear();
      size_t start = 0;
      for (;;) {
        const size_t comma = text.find(',', start);
        const std::string item =
            text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        int64_t x = 0;
        if (!ParseInt64(item, &x)) {
          *error = flag + ": expected an integer or a comma-separated list of integers, got " +
                   shown(text);
          return false;
        }
        if (x < spec.min || x > spec.max) {
          *error = flag + ": " + item + " is out of range " + range_text(spec);
          return false;
        }
        v->list.push_back(x);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      v->integer = v->list.front();
      return true;
    }
    case FlagKind::kChoice: {
      const std::string choices = spec.choices ? spec.choices : "";
      size_t start = 0;
      for (;;) {
        const size_t bar = choices.find('|', start);
        if (choices.compare(start, bar == std::string::npos ? std::string::npos : bar - start,
                            text) == 0) {
          return true;
        }
        if (bar == std::string::npos) break;
        start = bar + 1;
      }
      *error = flag + ": expected one of " + choices + ", got " + shown(text);
      return false;
    }
  }
  *error = flag + ": internal error: unknown flag kind";
  return false;
}

}  // namespace

const std::string ParsedFlags::empty_;

const std::string& ParsedFlags::text(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.text;
}

bool ParsedFlags::boolean(const std::string& name, bool fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.boolean;
}

int64_t ParsedFlags::integer(const std::string& name, int64_t fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.integer;
}

double ParsedFlags::real(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.real;
}

std::vector<int64_t> ParsedFlags::list(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<int64_t>{} : it->second.list;
}

bool ParseInt64(const std::string& s, int64_t* value) {
  size_t i = 0;
  bool negative = false;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  if (i == s.size()) return false;
  // Accumulate as a negative number so INT64_MIN is representable.
  int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    const int digit = s[i] - '0';
    if (v < (std::numeric_limits<int64_t>::min() + digit) / 10) return false;
    v = v * 10 - digit;
  }
  if (!negative) {
    if (v == std::numeric_limits<int64_t>::min()) return false;
    v = -v;
  }
  *value = v;
  return true;
}

bool ParseBool(const std::string& s, bool* value) {
  if (s == "true" || s == "1" || s == "True" || s == "TRUE") return *value = true, true;
  if (s == "false" || s == "0" || s == "False" || s == "FALSE") return *value = false, true;
  return false;
}

bool ParseFiniteDouble(const std::string& s, double* value) {
  // strtod would skip leading spaces and stop at an embedded NUL; neither is a number here.
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0])) ||
      std::strlen(s.c_str()) != s.size()) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *value = v;
  return true;
}

bool ParseFlags(const std::vector<std::string>& args, const std::vector<FlagSpec>& specs,
                ParsedFlags* out, std::string* error) {
  *out = ParsedFlags();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help") {
      out->help_ = true;
      return true;
    }
    if (arg.size() < 3 || arg[0] != '-' || arg[1] != '-') {
      *error = "unexpected argument " + shown(arg) + " (flags are written --name value)";
      return false;
    }
    std::string name = arg.substr(2);
    std::string value;
    bool inline_value = false;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
      inline_value = true;
    }
    const FlagSpec* spec = find_spec(specs, name);
    if (spec == nullptr) {
      *error = "unknown flag " + shown("--" + name) + " (--help lists the flags)";
      return false;
    }
    if (out->values_.count(name)) {
      *error = "--" + name + ": given twice";
      return false;
    }
    if (!inline_value) {
      const bool next_is_value =
          i + 1 < args.size() && !(args[i + 1].size() >= 2 && args[i + 1].compare(0, 2, "--") == 0);
      if (next_is_value) {
        value = args[++i];
      } else if (spec->kind == FlagKind::kBool) {
        value = "true";  // a bare boolean flag switches it on
      } else {
        *error = "--" + name + ": missing value";
        return false;
      }
    }
    FlagValue v;
    if (!parse_value(*spec, value, &v, error)) return false;
    out->values_[name] = std::move(v);
  }
  return true;
}

std::string FlagsHelp(const std::vector<FlagSpec>& specs) {
  std::string out;
  for (const FlagSpec& s : specs) {
    std::string left = std::string("  --") + s.name;
    switch (s.kind) {
      case FlagKind::kString:
        left += " PATH";
        break;
      case FlagKind::kBool:
        left += " true|false";
        break;
      case FlagKind::kInt:
        left += " N";
        break;
      case FlagKind::kFloat:
        left += " X";
        break;
      case FlagKind::kIntList:
        left += " N[,N...]";
        break;
      case FlagKind::kChoice:
        left += std::string(" ") + (s.choices ? s.choices : "");
        break;
    }
    if (left.size() < 34) {
      left.append(34 - left.size(), ' ');
    } else {
      left += "\n" + std::string(34, ' ');
    }
    out += left + s.help + "\n";
  }
  return out;
}

}  // namespace flashcte::tools
