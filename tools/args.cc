#include "tools/args.h"

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace flashcte::tools {
namespace {

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

// What --help writes after a flag's name.
std::string placeholder(const FlagSpec& spec) {
  switch (spec.kind) {
    case FlagKind::kString:
      return "PATH";
    case FlagKind::kBool:
      return "true|false";
    case FlagKind::kInt:
      return "N";
    case FlagKind::kFloat:
      return "X";
    case FlagKind::kIntList:
      return "N[,N...]";
    case FlagKind::kChoice:
      return spec.choices ? spec.choices : "";
  }
  return "";
}

// Reads `text` as the value of `spec` into *v. Returns "" when it is valid, else the rule it
// broke (CLI11 puts the flag's name in front). A flag written without a value (or with "") has
// the value "": missing, or true for a boolean.
std::string parse_value(const FlagSpec& spec, const std::string& text, FlagValue* v) {
  v->text = text;
  if (text.empty()) {
    if (spec.kind != FlagKind::kBool) return "missing value";
    v->text = "true";  // a bare boolean flag switches it on
  }
  switch (spec.kind) {
    case FlagKind::kString:
      return "";
    case FlagKind::kBool:
      if (!ParseBool(v->text, &v->boolean)) {
        return "expected true, false, 1 or 0, got " + shown(text);
      }
      return "";
    case FlagKind::kInt:
      if (!ParseInt64(text, &v->integer)) return "expected an integer, got " + shown(text);
      if (v->integer < spec.min || v->integer > spec.max) {
        return text + " is out of range " + range_text(spec);
      }
      return "";
    case FlagKind::kFloat:
      if (!ParseFiniteDouble(text, &v->real)) return "expected a finite number, got " + shown(text);
      return "";
    case FlagKind::kIntList: {
      v->list.clear();
      size_t start = 0;
      for (;;) {
        const size_t comma = text.find(',', start);
        const std::string item =
            text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        int64_t x = 0;
        if (!ParseInt64(item, &x)) {
          return "expected an integer or a comma-separated list of integers, got " + shown(text);
        }
        if (x < spec.min || x > spec.max) return item + " is out of range " + range_text(spec);
        v->list.push_back(x);
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      v->integer = v->list.front();
      return "";
    }
    case FlagKind::kChoice: {
      const std::string choices = spec.choices ? spec.choices : "";
      size_t start = 0;
      for (;;) {
        const size_t bar = choices.find('|', start);
        if (choices.compare(start, bar == std::string::npos ? std::string::npos : bar - start,
                            text) == 0) {
          return "";
        }
        if (bar == std::string::npos) break;
        start = bar + 1;
      }
      return "expected one of " + choices + ", got " + shown(text);
    }
  }
  return "internal error: unknown flag kind";
}

// A CLI11 app with one option per spec. Every option takes zero or one value, so that a flag
// without one reaches parse_value (which names the rule) instead of CLI11's generic mismatch;
// all occurrences are kept so that a flag given twice is caught. When `values` is given, each
// option's validator parses its value into (*values)[name].
std::unique_ptr<CLI::App> make_app(const std::vector<FlagSpec>& specs,
                                   std::map<std::string, FlagValue>* values) {
  auto app = std::make_unique<CLI::App>();
  app->set_help_flag("-h,--help");
  app->allow_extras();  // unknown flags and stray words get this file's messages (ParseFlags)
  for (const FlagSpec& spec : specs) {
    CLI::Option* option = app->add_option(std::string("--") + spec.name, spec.help);
    option->expected(0, 1)->take_all()->option_text(placeholder(spec));
    if (values != nullptr) {
      option->check(CLI::Validator(
          [spec, values](std::string& text) {
            FlagValue v;
            std::string rule = parse_value(spec, text, &v);
            if (rule.empty()) (*values)[spec.name] = std::move(v);
            return rule;
          },
          placeholder(spec)));
    }
  }
  return app;
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
  const std::unique_ptr<CLI::App> app = make_app(specs, &out->values_);
  try {
    app->parse(std::vector<std::string>(args.rbegin(), args.rend()));  // CLI11 pops from the back
  } catch (const CLI::CallForHelp&) {
    out->help_ = true;
    return true;
  } catch (const CLI::ParseError& e) {
    *error = e.what();
    return false;
  }
  for (const FlagSpec& spec : specs) {
    const std::string flag = std::string("--") + spec.name;
    const size_t count = app->get_option(flag)->count();
    if (count > 1) {
      *error = flag + ": given twice";
      return false;
    }
    // CLI11 runs no validator on an empty value (a flag written without one), so it is read here.
    FlagValue v;
    if (count == 1 && out->values_.count(spec.name) == 0) {
      if (std::string rule = parse_value(spec, "", &v); !rule.empty()) {
        *error = flag + ": " + rule;
        return false;
      }
      out->values_[spec.name] = std::move(v);
    }
  }
  const std::vector<std::string> extras = app->remaining();
  if (!extras.empty()) {
    const std::string& first = extras.front();
    if (first.size() > 2 && first.compare(0, 2, "--") == 0) {
      *error =
          "unknown flag " + shown(first.substr(0, first.find('='))) + " (--help lists the flags)";
    } else {
      *error = "unexpected argument " + shown(first) + " (flags are written --name value)";
    }
    return false;
  }
  return true;
}

std::string FlagsHelp(const std::vector<FlagSpec>& specs) {
  const std::unique_ptr<CLI::App> app = make_app(specs, nullptr);
  CLI::Formatter formatter;
  formatter.column_width(34);
  std::string out;
  for (const FlagSpec& spec : specs) {
    out += formatter.make_option(app->get_option(std::string("--") + spec.name), false);
  }
  return out;
}

}  // namespace flashcte::tools
