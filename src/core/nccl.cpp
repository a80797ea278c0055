// NCCL loaded at run time (src/core/nccl.h).
#include "src/core/nccl.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <optional>

#include "fp8mla/error.h"
#include "src/core/check.h"

namespace fp8mla::detail {
namespace {

[[noreturn]] void unavailable(const std::string& path, const std::string& why) {
  throw Error(ErrorCode::unsupported, "NCCL",
              msg("cannot use '", path, "': ", why,
                  " (set FP8MLA_NCCL_LIBRARY to the path of libnccl.so.2, e.g. PyTorch's "
                  "nvidia/nccl/lib/libnccl.so.2)"));
}

template <class Fn>
void resolve(void* lib, const std::string& path, const char* name, Fn*& fn) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr) unavailable(path, msg("it has no ", name));
  fn = reinterpret_cast<Fn*>(sym);
}

}  // namespace

NcclApi load_nccl(const std::string& path) {
  // A copy the process already holds (an engine's) first, so both share one NCCL.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    unavailable(path, err != nullptr ? err : "dlopen failed");
  }
  NcclApi api;
  api.path = path;
  resolve(lib, path, "ncclGetVersion", api.get_version);
  resolve(lib, path, "ncclGetErrorString", api.get_error_string);
  resolve(lib, path, "ncclGetUniqueId", api.get_unique_id);
  resolve(lib, path, "ncclCommInitRank", api.comm_init_rank);
  resolve(lib, path, "ncclCommDestroy", api.comm_destroy);
  resolve(lib, path, "ncclCommCount", api.comm_count);
  resolve(lib, path, "ncclCommUserRank", api.comm_user_rank);
  resolve(lib, path, "ncclAllGather", api.all_gather);
  resolve(lib, path, "ncclGroupStart", api.group_start);
  resolve(lib, path, "ncclGroupEnd", api.group_end);
  int version = 0;
  if (api.get_version(&version) != 0 || version < 21000)
    unavailable(path, msg("NCCL ", version, " is older than 2.10 (no bf16)"));
  return api;
}

const NcclApi& nccl() {
  static std::mutex mutex;
  static std::optional<NcclApi> api;
  const std::lock_guard<std::mutex> lock(mutex);
  if (!api) {
    const char* env = std::getenv("FP8MLA_NCCL_LIBRARY");
    api = load_nccl(env != nullptr && *env != '\0' ? env : "libnccl.so.2");
  }
  return *api;
}

void nccl_check(int result, const char* call) {
  if (result != 0)
    throw Error(ErrorCode::cuda_error, call,
                msg("NCCL error ", result, ": ", nccl().get_error_string(result)));
}

}  // namespace fp8mla::detail
