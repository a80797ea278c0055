// Internal: NCCL, loaded at run time (include/fp8mla/context_parallel.h says why). Only the few
// entry points the context-parallel exchange needs, declared here with NCCL's C ABI (stable
// since NCCL 2.0; bf16 since 2.10), so neither nccl.h nor libnccl is needed to build.
#pragma once

#include <cstddef>
#include <string>

namespace fp8mla::detail {

struct NcclUniqueIdAbi {
  char internal[128];
};

// ncclDataType_t values.
inline constexpr int kNcclFloat32 = 7;
inline constexpr int kNcclBfloat16 = 9;

struct NcclApi {
  std::string path;  // the library that was loaded
  int (*get_version)(int* version);
  const char* (*get_error_string)(int result);
  int (*get_unique_id)(NcclUniqueIdAbi* id);
  int (*comm_init_rank)(void** comm, int nranks, NcclUniqueIdAbi id, int rank);
  int (*comm_destroy)(void* comm);
  int (*comm_count)(const void* comm, int* count);
  int (*comm_user_rank)(const void* comm, int* rank);
  int (*all_gather)(const void* send, void* recv, std::size_t count, int datatype, void* comm,
                    void* stream);
  int (*group_start)();
  int (*group_end)();
};

// Loads `path` and resolves every entry point (the handle stays open for the process). Throws
// Error(unsupported) naming the path and what failed (dlopen's message, a missing symbol, or
// NCCL older than 2.10).
NcclApi load_nccl(const std::string& path);

// The process's NCCL: load_nccl(FP8MLA_NCCL_LIBRARY, else "libnccl.so.2") on first use; a failed
// load is retried on the next call.
const NcclApi& nccl();

// Throws Error(cuda_error, call) with NCCL's message unless result is ncclSuccess (0).
void nccl_check(int result, const char* call);

}  // namespace fp8mla::detail
