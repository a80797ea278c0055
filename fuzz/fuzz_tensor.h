// Tensor views for the fuzz targets, each backed by an allocation exactly as large as the
// elements it describes, so AddressSanitizer reports any read or write outside the view.
//
// A view is decoded as valid-looking (the shape the call expects, dense or with fuzzed strides)
// or hostile (fuzzed ndim, extents, strides, dtype, device; extremes included). A hostile view
// the library cannot tell from a valid one (every extent and stride sane, but more memory than
// the fuzzer backs) makes the call unsafe to make: a caller's view must describe memory it owns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>

#include "fp8mla/tensor.h"
#include "fuzz/fuzz_input.h"

namespace fp8mla::fuzz {

inline constexpr std::int64_t kMaxBackedBytes = std::int64_t{4} << 20;

struct Tensor {
  std::unique_ptr<std::uint8_t[]> storage;  // exactly the bytes the view reaches
  TensorView view;
  // False when the view looks valid but reaches more memory than was allocated for it: the call
  // must then not be made (the library rightly trusts a caller's extents and strides).
  bool safe = true;
};

// Bytes from the view's first element to past its last (0 for no elements); -1 when the view is
// malformed (the library must reject it: ndim, extent, stride or dtype out of range) or when the
// offsets leave int64 (likewise).
inline std::int64_t reach_bytes(const TensorView& t) {
  if (t.ndim < 0 || t.ndim > kMaxDims || t.dtype > DType::i64) return -1;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return -1;
  }
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] == 0) return 0;
  std::int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    std::int64_t span = 0;
    if (t.stride[d] < 0 || __builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &span) ||
        __builtin_add_overflow(last, span, &last))
      return -1;
  }
  std::int64_t bytes = 0;
  if (__builtin_add_overflow(last, 1, &last) ||
      __builtin_mul_overflow(last, static_cast<std::int64_t>(dtype_size(t.dtype)), &bytes))
    return -1;
  return bytes;
}

// Backs `t` (its shape, strides, dtype set) with memory filled from `fill` bytes.
inline Tensor back(TensorView t, Input& fill) {
  Tensor out;
  const std::int64_t reach = reach_bytes(t);
  if (reach > kMaxBackedBytes) {
    out.safe = false;  // valid-looking and huge: not callable
  }
  // Malformed (reach -1) or too big: a one-byte buffer the library must never read.
  const std::int64_t bytes = reach >= 0 && reach <= kMaxBackedBytes ? reach : 1;
  const std::uint8_t seed = fill.u8();
  if (bytes > 0) {
    out.storage = std::make_unique<std::uint8_t[]>(static_cast<std::size_t>(bytes));
    for (std::int64_t i = 0; i < bytes; ++i)
      out.storage[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(seed + 37 * i);
  }
  t.data = out.storage.get();  // nullptr for a view of no elements: allowed
  out.view = t;
  return out;
}

// Decodes a view meant to have `shape` and `dtype` on the CPU:
//   mode 0: exactly that, dense;  1: that shape, fuzzed non-negative strides;
//   2: hostile (ndim, extents, strides, dtype, device fuzzed, raw values included);
//   3: not given (null data).
inline Tensor tensor(Input& in, DType dtype, std::initializer_list<std::int64_t> shape) {
  const std::uint8_t mode = in.u8() % 4;
  TensorView t;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t e : shape) t.shape[i++] = e;
  std::int64_t dense = 1;  // saturates: a huge hint shape only needs some stride
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = dense;
    if (__builtin_mul_overflow(dense, t.shape[d], &dense)) dense = INT64_MAX;
  }
  if (mode == 3) return Tensor{nullptr, TensorView{}, true};
  if (mode == 1) {
    for (int d = 0; d < t.ndim; ++d)
      t.stride[d] = in.int64_in(
          0, t.stride[d] >= 0 && t.stride[d] < INT64_MAX / 4 ? 2 * t.stride[d] + 1 : INT64_MAX);
  } else if (mode == 2) {
    t.ndim = in.int_in(-1, 5);
    t.dtype = static_cast<DType>(in.u8() % 8);  // 7: no DType
    t.device = in.u8() % 4 == 0 ? DeviceKind::cuda : DeviceKind::cpu;
    for (int d = 0; d < kMaxDims; ++d) {
      const std::int64_t hint = d < static_cast<int>(shape.size()) ? shape.begin()[d] : 2;
      t.shape[d] = in.int64_in(-1, hint >= 0 && hint < INT64_MAX / 4 ? 2 * hint : 4);
      t.stride[d] = in.int64_in(-1, 1024);
    }
  }
  return back(t, in);
}

}  // namespace fp8mla::fuzz
