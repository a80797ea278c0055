#include "tools/fp8mla/args.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <sstream>
#include <utility>

namespace fp8mla::cli {
namespace {

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (i != 0) out += sep;
    out += parts[i];
  }
  return out;
}

// Levenshtein distance, for "did you mean" hints on misspelt options.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string join_ints(const std::vector<int>& v) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i != 0) out += ',';
    out += std::to_string(v[i]);
  }
  return out;
}

// "[min, max]". Built by appending: GCC 12 warns falsely (-Wrestrict) on "[" + std::string.
std::string range_text(std::int64_t min, std::int64_t max) {
  std::string out = "[";
  out += std::to_string(min);
  out += ", ";
  out += std::to_string(max);
  out += "]";
  return out;
}

}  // namespace

bool parse_int64(std::string_view text, std::int64_t* out) {
  if (text.empty()) return false;
  std::int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end) return false;
  *out = v;
  return true;
}

std::vector<std::string_view> split_commas(std::string_view text) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    parts.push_back(text.substr(start, comma == std::string_view::npos ? comma : comma - start));
    if (comma == std::string_view::npos) return parts;
    start = comma + 1;
  }
}

ArgParser::ArgParser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

ArgParser::Option& ArgParser::add(std::string name, std::string metavar, std::string help,
                                  std::string default_text,
                                  std::function<void(std::string_view)> set) {
  Option o;
  o.name = std::move(name);
  o.metavar = std::move(metavar);
  o.help = std::move(help);
  o.default_text = std::move(default_text);
  o.set = std::move(set);
  options_.push_back(std::move(o));
  return options_.back();
}

void ArgParser::add_flag(std::string name, bool* out, std::string help) {
  Option& o =
      add(std::move(name), "", std::move(help), "", [out](std::string_view) { *out = true; });
  o.is_flag = true;
}

template <class Int>
void ArgParser::add_integer(std::string name, Int* out, std::string help, std::int64_t min,
                            std::int64_t max) {
  const std::string range = range_text(min, max);
  const std::string n = name;
  add(std::move(name), "N", std::move(help) + " " + range, std::to_string(*out),
      [this, out, min, max, n, range](std::string_view v) {
        std::int64_t x = 0;
        if (!parse_int64(v, &x) || x < min || x > max) {
          bad_value(*find(n), v, "an integer in " + range);
        }
        *out = static_cast<Int>(x);  // in [min, max], which fits Int
      });
}

void ArgParser::add_int(std::string name, int* out, std::string help, int min, int max) {
  add_integer(std::move(name), out, std::move(help), min, max);
}

void ArgParser::add_int64(std::string name, std::int64_t* out, std::string help, std::int64_t min,
                          std::int64_t max) {
  add_integer(std::move(name), out, std::move(help), min, max);
}

void ArgParser::add_string(std::string name, std::string* out, std::string metavar,
                           std::string help) {
  const std::string n = name;
  add(std::move(name), std::move(metavar), std::move(help), *out,
      [this, out, n](std::string_view v) {
        if (v.empty()) bad_value(*find(n), v, "a non-empty value");
        *out = std::string(v);
      });
}

void ArgParser::add_choice(std::string name, std::string* out, std::vector<std::string> choices,
                           std::string help) {
  const std::string n = name;
  const std::string metavar = join(choices, "|");
  add(std::move(name), metavar, std::move(help), *out, [this, out, choices, n](std::string_view v) {
    if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
      bad_value(*find(n), v, "one of " + join(choices, ", "));
    }
    *out = std::string(v);
  });
}

void ArgParser::add_int_list(std::string name, std::vector<int>* out, std::string help, int min,
                             int max) {
  const std::string range = range_text(min, max);
  const std::string n = name;
  add(std::move(name), "N,N,...", std::move(help), out->empty() ? "" : join_ints(*out),
      [this, out, min, max, n, range](std::string_view v) {
        std::vector<int> values;
        for (std::string_view part : split_commas(v)) {
          std::int64_t x = 0;
          if (!parse_int64(part, &x) || x < min || x > max) {
            bad_value(*find(n), v, "comma-separated integers in " + range);
          }
          values.push_back(static_cast<int>(x));
        }
        *out = std::move(values);
      });
}

void ArgParser::add_choice_list(std::string name, std::vector<std::string>* out,
                                std::vector<std::string> choices, std::string help) {
  const std::string n = name;
  add(std::move(name), "X,X,...", std::move(help) + " (" + join(choices, ", ") + ")",
      join(*out, ","), [this, out, choices, n](std::string_view v) {
        std::vector<std::string> values;
        for (std::string_view part : split_commas(v)) {
          if (std::find(choices.begin(), choices.end(), part) == choices.end()) {
            bad_value(*find(n), v, "comma-separated values from " + join(choices, ", "));
          }
          values.emplace_back(part);
        }
        *out = std::move(values);
      });
}

void ArgParser::add_positional(std::string metavar, std::string* out, std::string help) {
  positional_metavar_ = std::move(metavar);
  positional_help_ = std::move(help);
  positional_ = out;
}

ArgParser::Option* ArgParser::find(std::string_view name) {
  for (Option& o : options_) {
    if (o.name == name) return &o;
  }
  return nullptr;
}

void ArgParser::set_default_text(std::string_view name, std::string text) {
  if (Option* o = find(name)) o->default_text = std::move(text);
}

void ArgParser::hide(std::string_view name) {
  if (Option* o = find(name)) o->hidden = true;
}

bool ArgParser::given(std::string_view name) const {
  for (const Option& o : options_) {
    if (o.name == name) return o.seen;
  }
  return false;
}

void ArgParser::fail(const std::string& message) const {
  throw UsageError(command_ + ": " + message + " (see '" + command_ + " --help')");
}

void ArgParser::bad_value(const Option& o, std::string_view value,
                          const std::string& expected) const {
  fail("--" + o.name + ": expected " + expected + ", got '" + std::string(value) + "'");
}

bool ArgParser::parse(std::span<const std::string_view> args) {
  for (std::string_view a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
  }
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view arg = args[i];
    if (arg.size() < 3 || arg.substr(0, 2) != "--") {
      if (positional_ != nullptr && positional_->empty() && !arg.empty() && arg != "-") {
        *positional_ = std::string(arg);
        continue;
      }
      fail("unexpected argument '" + std::string(arg) + "'");
    }
    std::string_view name = arg.substr(2);
    std::string_view value;
    bool has_value = false;
    if (const std::size_t eq = name.find('='); eq != std::string_view::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    Option* o = find(name);
    if (o == nullptr) {
      std::string hint;
      std::size_t best = 3;  // suggest only close matches
      for (const Option& candidate : options_) {
        if (candidate.hidden) continue;
        const std::size_t d = edit_distance(name, candidate.name);
        if (d < best) {
          best = d;
          hint = " (did you mean --" + candidate.name + "?)";
        }
      }
      fail("unknown option '--" + std::string(name) + "'" + hint);
    }
    if (o->is_flag) {
      if (has_value) fail("--" + o->name + " takes no value, got '" + std::string(value) + "'");
    } else if (!has_value) {
      if (i + 1 >= args.size()) fail("--" + o->name + " needs a value (" + o->metavar + ")");
      value = args[++i];
    }
    o->set(value);
    o->seen = true;
  }
  if (positional_ != nullptr && positional_->empty()) fail("expected " + positional_metavar_);
  return true;
}

// Appends `text` word-wrapped to kLineWidth columns; continuation lines start at `indent`.
static void wrap_into(std::ostringstream& os, const std::string& text, std::size_t indent) {
  constexpr std::size_t kLineWidth = 100;
  std::size_t column = indent;
  std::size_t pos = 0;
  bool line_start = true;
  while (pos < text.size()) {
    const std::size_t end = std::min(text.find(' ', pos), text.size());
    const std::string_view word = std::string_view(text).substr(pos, end - pos);
    if (!line_start && column + 1 + word.size() > kLineWidth) {
      os << '\n' << std::string(indent, ' ');
      column = indent;
      line_start = true;
    }
    if (!line_start) {
      os << ' ';
      ++column;
    }
    os << word;
    column += word.size();
    line_start = false;
    pos = end + 1;
  }
}

std::string ArgParser::help() const {
  std::ostringstream os;
  os << "usage: " << command_ << (positional_ != nullptr ? " " + positional_metavar_ : "")
     << " [options]\n\n"
     << summary_ << "\n\n";
  if (positional_ != nullptr) {
    os << "arguments:\n  " << positional_metavar_ << "  ";
    wrap_into(os, positional_help_, positional_metavar_.size() + 4);
    os << "\n\n";
  }
  os << "options:\n";
  std::vector<std::string> heads;
  std::size_t width = 0;
  for (const Option& o : options_) {
    heads.push_back("--" + o.name + (o.metavar.empty() ? "" : " " + o.metavar));
    if (!o.hidden) width = std::max(width, heads.back().size());
  }
  width = std::min<std::size_t>(width, 30);
  for (std::size_t i = 0; i < options_.size(); ++i) {
    const Option& o = options_[i];
    if (o.hidden) continue;
    os << "  " << heads[i];
    if (heads[i].size() > width) {
      os << "\n  " << std::string(width, ' ');
    } else {
      os << std::string(width - heads[i].size(), ' ');
    }
    os << "  ";
    std::string text = o.help;
    if (!o.default_text.empty()) text += " (default: " + o.default_text + ")";
    wrap_into(os, text, width + 4);
    os << "\n";
  }
  os << "  --help" << std::string(width > 6 ? width - 6 : 0, ' ') << "  show this help and exit\n";
  if (!epilog_.empty()) os << "\n" << epilog_ << "\n";
  return os.str();
}

}  // namespace fp8mla::cli
