// The `fp8mla` subcommands. Each takes the arguments after its name, returns the exit status,
// and throws UsageError for a bad command line or fp8mla::Error for a failure of the library.
#pragma once

#include <span>
#include <string_view>

namespace fp8mla::cli {

int run_demo(std::span<const std::string_view> args);
int run_bench(std::span<const std::string_view> args);
int run_audit(std::span<const std::string_view> args);
int run_plot(std::span<const std::string_view> args);

}  // namespace fp8mla::cli
