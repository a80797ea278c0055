// Internal: one-line input checks that throw fp8mla::Error naming the argument and the bound.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
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

// Message parts streamed only when a check fails, so that a passing check formats nothing (an
// ostringstream costs ~1 us; plan() and run() make dozens of checks a call):
//   join(name, ".shape[", i, "]")  streams as its parts, held by reference for the call;
//   lazy([&] { return t.describe(); })  streams f()'s result.
template <class... Parts>
struct Joined {
  std::tuple<const Parts&...> parts;
};
template <class... Parts>
Joined<Parts...> join(const Parts&... parts) {
  return {{parts...}};
}
template <class... Parts>
std::ostream& operator<<(std::ostream& os, const Joined<Parts...>& j) {
  std::apply([&os](const auto&... p) { (os << ... << p); }, j.parts);
  return os;
}
template <class F>
struct Lazy {
  F f;
};
template <class F>
Lazy<F> lazy(F f) {
  return {std::move(f)};
}
template <class F>
std::ostream& operator<<(std::ostream& os, const Lazy<F>& l) {
  return os << l.f();
}

// Throws Error(invalid_argument, argument, message) unless `ok`. The argument and the message are
// anything msg() streams (a name, a std::string, join(...)), formatted only on failure.
template <class Argument, class... Parts>
void require(bool ok, const Argument& argument, const Parts&... message) {
  if (!ok) [[unlikely]]
    throw Error(ErrorCode::invalid_argument, msg(argument), msg(message...));
}

// Narrows a 64-bit count to int32 for device structures; fails loudly instead of wrapping.
template <class Argument>
std::int32_t narrow_i32(std::int64_t v, const Argument& argument) {
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

// How check_tensor judges a view's strides (flags, or-ed).
enum TensorUse : unsigned {
  kInput = 0,
  // Written: no two elements may share an address (a broadcast view, stride 0 over an extent
  // above 1, or rows shorter than their stride would have several results land on one element).
  kOutput = 1,
  // Any innermost stride (values read one at a time, e.g. lse as a permuted view).
  kAnyInnerStride = 2,
};

// Checks a tensor argument: ndim in [0, kMaxDims] and non-negative extents (before anything
// reads them), defined (a null pointer is accepted for a view with no elements), dtype one of
// `dtypes`, ndim and extents (-1 = any), and the device; for a view with elements also
// non-negative strides, the innermost stride 1 (unless kAnyInnerStride), every element's offset
// in bytes within int64, and for kOutput distinct elements. A view with no elements is accepted
// whatever its strides (numpy and nanobind give empty arrays stride 0): nothing is read or
// written through it.
void check_tensor(const TensorView& t, std::string_view name, std::initializer_list<DType> dtypes,
                  std::initializer_list<std::int64_t> shape, DeviceKind device, int device_id,
                  unsigned use = kInput);

// The ndim and extents of a view are in range: ndim in [0, kMaxDims], every extent >= 0 (what
// check_tensor checks first; for views whose shape is checked by hand).
void check_rank(const TensorView& t, std::string_view name);

// Only fp8mla::Error leaves the library. Called from a catch (...) block of a public entry point
// (`function` names it), rethrows the exception being handled: an Error as it is,
// std::bad_alloc and std::length_error (a container asked for more than it can hold) as
// Error(out_of_memory), anything else as Error(internal) with its what().
[[noreturn]] void rethrow_as_error(const char* function);

// Rethrows `e` with `prefix` put before its argument's name ("kv_len[3]" -> "problem.kv_len[3]"),
// for checks shared by entry points that name their arguments differently.
[[noreturn]] void rethrow_with_prefix(const Error& e, const std::string& prefix);

}  // namespace fp8mla::detail
