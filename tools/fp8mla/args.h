// A small command-line parser for the `fp8mla` subcommands (no dependencies).
//
// Options are `--name value` or `--name=value`; flags take no value. Every option states its
// default and accepted values in --help, and every error names the option and what it accepts,
// so a typo never silently runs the wrong experiment.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace fp8mla::cli {

// Bad command line: main() prints the message and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ArgParser {
 public:
  // `command` is the full name shown in messages ("fp8mla demo").
  ArgParser(std::string command, std::string summary);

  void add_flag(std::string name, bool* out, std::string help);
  void add_int(std::string name, int* out, std::string help, int min, int max);
  void add_int64(std::string name, std::int64_t* out, std::string help, std::int64_t min,
                 std::int64_t max);
  void add_string(std::string name, std::string* out, std::string metavar, std::string help);
  // One of `choices`.
  void add_choice(std::string name, std::string* out, std::vector<std::string> choices,
                  std::string help);
  // Comma-separated integers in [min, max], e.g. "1,16,64".
  void add_int_list(std::string name, std::vector<int>* out, std::string help, int min, int max);
  // Comma-separated values, each one of `choices`.
  void add_choice_list(std::string name, std::vector<std::string>* out,
                       std::vector<std::string> choices, std::string help);
  // One positional argument (a file), named `metavar` in the usage line; required when set.
  void add_positional(std::string metavar, std::string* out, std::string help);
  // Replaces the "(default: ...)" text of an option whose default depends on other options.
  void set_default_text(std::string_view name, std::string text);
  // Free text appended to --help (examples, notes).
  void set_epilog(std::string epilog) { epilog_ = std::move(epilog); }
  // Keeps an option out of --help and out of "did you mean" hints: an internal option that one
  // process of the command passes to another (it is still parsed and checked).
  void hide(std::string_view name);

  // Parses the arguments after the subcommand. Returns false when --help / -h was given (the
  // help text is then printed to stdout and nothing else is parsed). Throws UsageError.
  bool parse(std::span<const std::string_view> args);
  // True when the option appeared on the command line (to tell defaults from choices).
  bool given(std::string_view name) const;
  std::string help() const;

 private:
  struct Option {
    std::string name;  // without the leading "--"
    std::string metavar;
    std::string help;
    std::string default_text;
    bool is_flag = false;
    bool hidden = false;
    bool seen = false;
    std::function<void(std::string_view)> set;
  };
  Option& add(std::string name, std::string metavar, std::string help, std::string default_text,
              std::function<void(std::string_view)> set);
  Option* find(std::string_view name);
  // add_int / add_int64: an integer option checked against [min, max].
  template <class Int>
  void add_integer(std::string name, Int* out, std::string help, std::int64_t min,
                   std::int64_t max);
  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void bad_value(const Option& o, std::string_view value,
                              const std::string& expected) const;

  std::string command_;
  std::string summary_;
  std::string epilog_;
  std::vector<Option> options_;
  std::string positional_metavar_, positional_help_;
  std::string* positional_ = nullptr;
};

// Parses a whole decimal integer (no trailing text); false when it is not one or overflows.
bool parse_int64(std::string_view text, std::int64_t* out);
// Splits "a,b,c" into its parts (empty parts are kept so they can be reported).
std::vector<std::string_view> split_commas(std::string_view text);

}  // namespace fp8mla::cli
