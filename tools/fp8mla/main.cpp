// The `fp8mla` command: dispatches to its subcommands and turns failures into exit statuses
// (0 ok, 1 failure or failed check, 2 bad command line).
#include <cstdio>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "tools/fp8mla/args.h"
#include "tools/fp8mla/commands.h"

namespace {

constexpr const char* kUsage =
    "usage: fp8mla <command> [options]\n"
    "\n"
    "MLA decode attention over a paged FP8 latent KV cache.\n"
    "\n"
    "commands:\n"
    "  demo      replay the story: one decode step of a GLM-5-shaped stack over an FP8 pool,\n"
    "            three ways (cast the whole pool / gather then cast / native FP8); runs with\n"
    "            no arguments\n"
    "  bench     benchmark decode: the GPU grid on a CUDA device, else the CPU fast path\n"
    "  audit     read a PyTorch profiler trace of a serving engine: time by category per decode\n"
    "            step, and the KV cache cast to bf16 before attention, if there is one\n"
    "  plot      draw a saved bench or demo run (its --json output) as SVG\n"
    "  help      show this help, or a command's: fp8mla help demo\n"
    "\n"
    "options:\n"
    "  --help, -h   show this help\n"
    "  --version    print the version and the backends of this build\n"
    "\n"
    "Every command takes --help.\n";

const char* error_code_name(fp8mla::ErrorCode code) {
  switch (code) {
    case fp8mla::ErrorCode::invalid_argument:
      return "invalid argument";
    case fp8mla::ErrorCode::unsupported:
      return "unsupported";
    case fp8mla::ErrorCode::out_of_memory:
      return "out of memory";
    case fp8mla::ErrorCode::cuda_error:
      return "CUDA error";
    case fp8mla::ErrorCode::internal:
      return "internal error";
  }
  return "error";
}

int dispatch(std::string_view command, std::span<const std::string_view> rest) {
  if (command == "demo") return fp8mla::cli::run_demo(rest);
  if (command == "bench") return fp8mla::cli::run_bench(rest);
  if (command == "audit") return fp8mla::cli::run_audit(rest);
  if (command == "plot") return fp8mla::cli::run_plot(rest);
  throw fp8mla::cli::UsageError(
      "fp8mla: unknown command '" + std::string(command) +
      "': expected demo, bench, audit, plot or help (see 'fp8mla --help')");
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string_view> args(argv + 1, argv + argc);
  std::string_view command = args.empty() ? std::string_view() : args[0];
  try {
    if (args.empty()) {
      std::fputs(kUsage, stderr);
      return 2;
    }
    if (command == "--help" || command == "-h" || (command == "help" && args.size() == 1)) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (command == "--version") {
      const int devices = fp8mla::detail::cuda_device_count();
      std::printf("fp8mla %s (CPU backend; CUDA backend %s, %d device%s visible)\n",
                  fp8mla::version(), fp8mla::detail::cuda_built() ? "built" : "not built", devices,
                  devices == 1 ? "" : "s");
      return 0;
    }
    if (command == "help") {
      const std::string_view help[] = {"--help"};
      if (args.size() > 2) throw fp8mla::cli::UsageError("fp8mla help: expected one command");
      command = args[1];
      return dispatch(command, help);
    }
    return dispatch(command, std::span(args).subspan(1));
  } catch (const fp8mla::cli::UsageError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const fp8mla::Error& e) {
    std::fprintf(stderr, "fp8mla %s: %s: %s\n", std::string(command).c_str(),
                 error_code_name(e.code()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8mla %s: error: %s\n", std::string(command).c_str(), e.what());
    return 1;
  }
}
