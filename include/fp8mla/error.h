// fp8mla: errors.
//
// Every function of the library reports failure by throwing fp8mla::Error, and no other
// exception type leaves it (a failed host allocation is Error(out_of_memory), not
// std::bad_alloc). The message names the argument, the offending value or index, and the bound
// it broke, e.g.
//   "kv_indices[17] = 4096 is outside the pool [0, 4096)".
// code() tells bad input (ErrorCode::invalid_argument: the caller can fix the call) from
// everything else; the Python module maps it to ValueError (invalid_argument), MemoryError
// (out_of_memory) or RuntimeError. The bounds a call's work and memory must keep are in
// fp8mla/limits.h.
#pragma once

#include <stdexcept>
#include <string>

namespace fp8mla {

enum class ErrorCode {
  invalid_argument,  // bad shape, dtype, stride, index, length, scale, ...
  unsupported,       // valid request this build or device cannot serve (e.g. CUDA not built)
  out_of_memory,     // a pool, host or device allocation could not be satisfied
  cuda_error,        // a CUDA call failed
  internal,          // a broken invariant inside the library (a bug: please report)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string argument, const std::string& message)
      : std::runtime_error(argument.empty() ? message : argument + ": " + message),
        code_(code),
        argument_(std::move(argument)) {}

  ErrorCode code() const noexcept { return code_; }
  // The name of the argument at fault ("kv_indices", "q_nope.shape[1]", ...); may be empty.
  const std::string& argument() const noexcept { return argument_; }

 private:
  ErrorCode code_;
  std::string argument_;
};

}  // namespace fp8mla
