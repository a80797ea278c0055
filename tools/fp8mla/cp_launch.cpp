// `fp8mla bench --cp N`'s launcher (tools/fp8mla/cp_launch.h).
#include "tools/fp8mla/cp_launch.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "tools/fp8mla/args.h"

extern char** environ;

namespace fp8mla::cli {

std::string id_to_hex(const NcclId& id) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  for (const char c : id.bytes) {
    const auto b = static_cast<unsigned char>(c);
    hex += kDigits[b >> 4];
    hex += kDigits[b & 15];
  }
  return hex;
}

NcclId id_from_hex(std::string_view hex) {
  const auto nibble = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  NcclId id;
  bool ok = hex.size() == 2 * id.bytes.size();
  for (std::size_t i = 0; ok && i < id.bytes.size(); ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    id.bytes[i] = static_cast<char>(ok ? hi * 16 + lo : 0);
  }
  if (!ok)
    throw UsageError("fp8mla bench: --cp-id: expected " + std::to_string(2 * id.bytes.size()) +
                     " lowercase hex digits (set by --cp's launcher)");
  return id;
}

int launch_ranks(int world, std::span<const std::string_view> args) {
  const int visible = detail::cuda_device_count();
  if (visible < world)
    throw Error(ErrorCode::unsupported, "--cp",
                "needs " + std::to_string(world) + " CUDA devices (one a rank), " +
                    std::to_string(visible) + " visible");
  const std::string hex = id_to_hex(nccl_unique_id());
  setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off unless the caller chose
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();

  std::vector<pid_t> ranks;
  const auto stop_all = [&] {
    for (const pid_t pid : ranks)
      if (pid > 0) kill(pid, SIGTERM);
  };
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> argv{exe, "bench"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--cp-rank", std::to_string(r), "--cp-id", hex});
    std::vector<char*> ptrs;
    for (std::string& a : argv) ptrs.push_back(a.data());
    ptrs.push_back(nullptr);
    pid_t pid = 0;
    const int err = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, ptrs.data(), environ);
    if (err != 0) {
      stop_all();
      throw Error(ErrorCode::internal, "--cp",
                  "cannot start rank " + std::to_string(r) + " (" + exe + "): error " +
                      std::to_string(err));
    }
    ranks.push_back(pid);
  }
  int worst = 0;
  for (int left = world; left > 0; --left) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    for (pid_t& p : ranks)
      if (p == pid) p = 0;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (!WIFEXITED(status))
      std::fprintf(stderr, "fp8mla bench --cp: a rank ended by signal %d\n", WTERMSIG(status));
    if (code != 0 && worst == 0) stop_all();
    worst = std::max(worst, code);
  }
  return worst;
}

}  // namespace fp8mla::cli
