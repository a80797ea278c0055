// Internal: every CUDA runtime call and launch is checked; a failure becomes fp8mla::Error
// (out_of_memory for allocations, cuda_error otherwise) naming the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "fp8mla/error.h"

namespace fp8mla::detail {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(
        status == cudaErrorMemoryAllocation ? ErrorCode::out_of_memory : ErrorCode::cuda_error,
        what, std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
  }
}
// Every CUDA call goes through this; `what` names the call in the error.
#define FP8MLA_CUDA_CHECK(call) ::fp8mla::detail::cuda_check((call), #call)
// After every launch: configuration errors surface here, not at the next unrelated call.
#define FP8MLA_CUDA_CHECK_LAUNCH(name) ::fp8mla::detail::cuda_check(cudaGetLastError(), name)

}  // namespace fp8mla::detail
