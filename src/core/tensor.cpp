// Element types and strided tensor views (include/fp8mla/tensor.h).
#include "fp8mla/tensor.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "fp8mla/error.h"
#include "src/core/check.h"

namespace fp8mla {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::u8:
    case DType::fp8_e4m3:
      return 1;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::i32:
    case DType::f32:
      return 4;
    case DType::i64:
      return 8;
  }
  throw Error(ErrorCode::invalid_argument, "dtype",
              detail::msg("unknown DType value ", static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::u8:
      return "u8";
    case DType::i32:
      return "i32";
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::fp8_e4m3:
      return "fp8_e4m3";
    case DType::i64:
      return "i64";
  }
  // Names feed error messages, which must not themselves throw.
  return "unknown_dtype";
}

const char* device_name(DeviceKind device) {
  switch (device) {
    case DeviceKind::cpu:
      return "cpu";
    case DeviceKind::cuda:
      return "cuda";
  }
  return "unknown_device";
}

// numel(), is_contiguous() and describe() read only the kMaxDims entries a view has, whatever its
// ndim says: a hand-made view with ndim outside [0, kMaxDims] reaches them in error messages.
namespace {
int dims_of(const TensorView& t) {
  return std::clamp(t.ndim, 0, kMaxDims);
}
}  // namespace

std::int64_t TensorView::numel() const noexcept {
  // An undefined view (an optional tensor left out) holds no elements, so size checks such as
  // numel() == rows fail for it instead of seeing the empty product 1.
  if (!defined()) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < dims_of(*this); ++i) {
    if (shape[i] <= 0) return 0;
    if (__builtin_mul_overflow(n, shape[i], &n)) return std::numeric_limits<std::int64_t>::max();
  }
  return n;
}

bool TensorView::is_contiguous() const noexcept {
  // No elements: nothing to lay out (numpy and nanobind give empty arrays stride 0). An extent of
  // 1 takes any stride (torch's rule): its stride is never multiplied by an index above 0.
  const int dims = dims_of(*this);
  for (int i = 0; i < dims; ++i) {
    if (shape[i] < 0) return false;
    if (shape[i] == 0) return true;
  }
  std::int64_t expected = 1;
  for (int i = dims - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    if (__builtin_mul_overflow(expected, shape[i], &expected)) return false;
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  const int dims = dims_of(*this);
  for (int i = 0; i < dims; ++i) os << (i ? ", " : "") << shape[i];
  if (ndim != dims)
    os << (dims ? ", " : "") << "...: ndim " << ndim << " is outside [0, " << kMaxDims << "]";
  os << "] strides [";
  for (int i = 0; i < dims; ++i) os << (i ? ", " : "") << stride[i];
  os << "] on " << device_name(device);
  if (device != DeviceKind::cpu) os << ":" << device_id;
  return os.str();
}

namespace {

TensorView view_with_shape(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                           DeviceKind device, int device_id) {
  detail::require(shape.size() <= static_cast<std::size_t>(kMaxDims), "shape", "has ", shape.size(),
                  " dimensions, at most ", kMaxDims, " are supported");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int>(shape.size());
  t.device = device;
  t.device_id = device_id;
  int i = 0;
  for (std::int64_t extent : shape) {
    detail::require(extent >= 0, detail::join("shape[", i, "]"), "extent ", extent, " is negative");
    t.shape[i++] = extent;
  }
  return t;
}

}  // namespace

TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     DeviceKind device, int device_id) {
  TensorView t = view_with_shape(data, dtype, shape, device, device_id);
  std::int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.stride[i] = stride;
    stride *= t.shape[i];
  }
  return t;
}

TensorView make_strided_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                             std::initializer_list<std::int64_t> stride, DeviceKind device,
                             int device_id) {
  TensorView t = view_with_shape(data, dtype, shape, device, device_id);
  detail::require(stride.size() == shape.size(), "stride", "has ", stride.size(),
                  " entries but shape has ", shape.size());
  int i = 0;
  for (std::int64_t s : stride) {
    detail::require(s >= 0, detail::join("stride[", i, "]"), "stride ", s,
                    " is negative (not supported)");
    t.stride[i++] = s;
  }
  return t;
}

}  // namespace fp8mla
