#include "src/core/check.h"

namespace fp8mla::detail {

void check_tensor(const TensorView& t, const std::string& name, std::initializer_list<DType> dtypes,
                  std::initializer_list<std::int64_t> shape, DeviceKind device, int device_id) {
  require(t.defined(), name, "is required but was not given (null data pointer)");
  bool dtype_ok = false;
  std::string expected;
  for (DType d : dtypes) {
    dtype_ok = dtype_ok || d == t.dtype;
    expected += (expected.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  require(dtype_ok, name + ".dtype", "expected ", expected, ", got ", dtype_name(t.dtype));
  require(t.ndim == static_cast<int>(shape.size()), name + ".ndim", "expected ", shape.size(),
          " dimensions, got ", t.ndim, " (", t.describe(), ")");
  int i = 0;
  for (std::int64_t extent : shape) {
    require(extent < 0 || t.shape[i] == extent, msg(name, ".shape[", i, "]"), "expected ", extent,
            ", got ", t.shape[i], " (", t.describe(), ")");
    require(t.stride[i] >= 0, msg(name, ".stride[", i, "]"), "negative strides are not supported");
    ++i;
  }
  require(t.ndim == 0 || t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1,
          msg(name, ".stride[", t.ndim - 1, "]"),
          "the innermost dimension must be contiguous, got ", t.stride[t.ndim - 1]);
  require(t.device == device && (device == DeviceKind::cpu || t.device_id == device_id),
          name + ".device", "expected ", device_name(device), ":", device_id, ", got ",
          device_name(t.device), ":", t.device_id);
}

}  // namespace fp8mla::detail
