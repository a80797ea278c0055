#include "src/core/check.h"

#include <array>
#include <exception>
#include <new>
#include <stdexcept>
#include <utility>

namespace fp8mla::detail {

void check_rank(const TensorView& t, std::string_view name) {
  require(t.ndim >= 0 && t.ndim <= kMaxDims, join(name, ".ndim"), t.ndim, " is outside [0, ",
          kMaxDims, "]");
  for (int i = 0; i < t.ndim; ++i) {
    require(t.shape[i] >= 0, join(name, ".shape[", i, "]"), "extent ", t.shape[i], " is negative");
  }
}

namespace {

// No two elements of a written view share an address: with the dimensions of extent > 1 ordered
// by stride, each stride must step past everything the inner ones span. (This rejects a few
// interleaved layouts that do not overlap; no framework makes those for an output.)
void require_distinct(const TensorView& t, std::string_view name) {
  std::array<int, kMaxDims> order{};
  int n = 0;
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] > 1) order[n++] = d;
  for (int i = 1; i < n; ++i)  // insertion sort by stride (at most kMaxDims entries)
    for (int j = i; j > 0 && t.stride[order[j]] < t.stride[order[j - 1]]; --j)
      std::swap(order[j], order[j - 1]);
  std::int64_t spanned = 0;  // the largest offset the inner dimensions reach (no overflow:
                             // check_tensor bounded every offset first)
  const auto describe = lazy([&t] { return t.describe(); });
  for (int i = 0; i < n; ++i) {
    const int d = order[i];
    require(t.stride[d] > spanned, join(name, ".stride[", d, "]"), "stride ", t.stride[d],
            " makes elements of this output overlap (it must exceed ", spanned,
            ", the offset its inner dimensions reach; ", describe, ")");
    spanned += (t.shape[d] - 1) * t.stride[d];
  }
}

}  // namespace

void check_tensor(const TensorView& t, std::string_view name, std::initializer_list<DType> dtypes,
                  std::initializer_list<std::int64_t> shape, DeviceKind device, int device_id,
                  unsigned use) {
  check_rank(t, name);
  bool empty = false;  // no elements: some extent is 0
  for (int d = 0; d < t.ndim; ++d) empty = empty || t.shape[d] == 0;
  require(t.defined() || empty, name, "is required but was not given (null data pointer)");
  const auto describe = lazy([&t] { return t.describe(); });
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || d == t.dtype;
  const auto expected = lazy([&dtypes] {
    std::string names;
    for (DType d : dtypes) names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
    return names;
  });
  require(dtype_ok, join(name, ".dtype"), "expected ", expected, ", got ", dtype_name(t.dtype));
  require(t.ndim == static_cast<int>(shape.size()), join(name, ".ndim"), "expected ", shape.size(),
          " dimensions, got ", t.ndim, " (", describe, ")");
  int i = 0;
  for (std::int64_t extent : shape) {
    require(extent < 0 || t.shape[i] == extent, join(name, ".shape[", i, "]"), "expected ", extent,
            ", got ", t.shape[i], " (", describe, ")");
    ++i;
  }
  require(t.device == device && (device == DeviceKind::cpu || t.device_id == device_id),
          join(name, ".device"), "expected ", device_name(device), ":", device_id, ", got ",
          device_name(t.device), ":", t.device_id);
  if (empty) return;  // no element is addressed: any strides describe it
  // The largest element offset, in bytes, must be an int64: element addresses are computed as
  // data + sum(index[i] * stride[i]) in 64-bit arithmetic. So must every stride in bytes, also
  // of an extent of 1 (no index reaches it, but the readers turn every stride into bytes).
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype));
  std::int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    require(t.stride[d] >= 0, join(name, ".stride[", d, "]"), "negative strides are not supported");
    std::int64_t span = 0;
    const bool overflow = __builtin_mul_overflow(t.stride[d], size, &span) ||
                          __builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &span) ||
                          __builtin_mul_overflow(span, size, &span) ||
                          __builtin_add_overflow(last, span, &last);
    require(!overflow, join(name, ".stride[", d, "]"), "stride ", t.stride[d],
            " puts elements beyond the int64 byte range (", describe, ")");
  }
  require((use & kAnyInnerStride) != 0 || t.ndim == 0 || t.shape[t.ndim - 1] <= 1 ||
              t.stride[t.ndim - 1] == 1,
          join(name, ".stride[", t.ndim - 1, "]"),
          "the innermost dimension must be contiguous, got ", t.stride[t.ndim - 1]);
  if ((use & kOutput) != 0) require_distinct(t, name);
}

void rethrow_as_error(const char* function) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::out_of_memory, function, "a host memory allocation failed");
  } catch (const std::length_error& e) {
    throw Error(
        ErrorCode::out_of_memory, function,
        msg("a host allocation larger than a container can hold was asked for (", e.what(), ")"));
  } catch (const std::exception& e) {
    throw Error(ErrorCode::internal, function, msg("unexpected exception: ", e.what()));
  } catch (...) {
    throw Error(ErrorCode::internal, function, "unexpected exception of unknown type");
  }
}

void rethrow_with_prefix(const Error& e, const std::string& prefix) {
  const std::string what = e.what();
  const std::string& argument = e.argument();
  const std::string message = argument.empty() ? what : what.substr(argument.size() + 2);
  throw Error(e.code(), prefix + argument, message);
}

}  // namespace fp8mla::detail
