// Internal: one-line input checks that throw fp8mla::Error naming the argument and the bound.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "fp8mla/error.h"
#include "fp8mla/tensor.h"

namespace fp8mla::detail {

// Builds a message from streamable parts: msg("kv_len[", i, "] = ", v, " > ", bound).
template <class... Parts>
std::string msg(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}

// Throws Error(invalid_argument, argument, message) unless `ok`.
template <class... Parts>
void require(bool ok, const std::string& argument, Parts&&... message) {
  if (!ok) throw Error(ErrorCode::invalid_argument, argument, msg(std::forward<Parts>(message)...));
}

// Narrows a 64-bit count to int32 for device structures; fails loudly instead of wrapping.
inline std::int32_t narrow_i32(std::int64_t v, const std::string& argument) {
  require(v >= std::numeric_limits<std::int32_t>::min() &&
              v <= std::numeric_limits<std::int32_t>::max(),
          argument, "value ", v, " does not fit in int32");
  return static_cast<std::int32_t>(v);
}

// Causal attention over kv_len tokens: query token i of qo_len sees [0, kv_len - qo_len + i], so
// qo_len <= kv_len unless kv_len = 0 (those rows get o = 0, lse = -inf). Throws
// Error(invalid_argument, "name[index]") otherwise.
inline void require_causal_fits(const char* name, std::int64_t index, std::int64_t kv_len,
                                std::int64_t qo_len) {
  if (kv_len > 0 && qo_len > kv_len)
    throw Error(ErrorCode::invalid_argument, msg(name, "[", index, "]"),
                msg(kv_len, " is less than qo_len = ", qo_len,
                    " (causal attention needs qo_len <= kv_len, or kv_len = 0)"));
}

// A CUDA kernel whose warpgroups move registers with setmaxnreg needs exactly the per-thread
// register count its split adds up to: with fewer, a warpgroup's raise would wait for registers
// that never come (a hang). `built` is the compiled count (cudaFuncAttributes::numRegs). Throws
// Error(cuda_error, kernel) naming both counts when they differ.
inline void require_register_count(const std::string& kernel, int built, int required) {
  if (built != required)
    throw Error(
        ErrorCode::cuda_error, kernel,
        msg("built with ", built,
            " registers a thread; its warpgroups' register split needs exactly ", required));
}

// Checks a tensor argument: defined, dtype one of `dtypes`, ndim and extents (-1 = any), the
// innermost stride 1, non-negative strides, and the device.
void check_tensor(const TensorView& t, const std::string& name, std::initializer_list<DType> dtypes,
                  std::initializer_list<std::int64_t> shape, DeviceKind device, int device_id);

}  // namespace fp8mla::detail
