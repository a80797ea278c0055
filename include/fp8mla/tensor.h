// fp8mla: element types and non-owning strided tensor views.
//
// A TensorView describes memory the caller owns: a pointer, a dtype, up to 4 dimensions and
// strides counted in elements (not bytes), and where the memory lives. Views never own or free
// memory. Strides let a caller pass the ckv and kpe halves of one [pages, page_size, 576] buffer
// as two views (what SGLang does) or two separate buffers (what FlashInfer does).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace fp8mla {

enum class DType : std::uint8_t {
  u8,        // raw bytes (the 656-byte block-scaled token format)
  i32,       // indices
  f32,       // lse, partial outputs, float inputs to append
  bf16,      // queries, outputs, bf16 cache, rope part of the block format
  f16,       // accepted where noted (append input only)
  fp8_e4m3,  // OCP e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; no inf; NaN = 0x7f/0xff
  i64,       // row ids an engine keeps as int64 (fill_page_table's rows)
};

// Size of one element in bytes (1, 4, 4, 2, 2, 1, 8).
std::size_t dtype_size(DType dtype);
// "u8", "i32", "f32", "bf16", "f16", "fp8_e4m3", "i64".
const char* dtype_name(DType dtype);

enum class DeviceKind : std::uint8_t { cpu, cuda };
const char* device_name(DeviceKind device);

inline constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::u8;
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> stride{};  // elements, not bytes
  DeviceKind device = DeviceKind::cpu;
  int device_id = 0;

  bool defined() const noexcept { return data != nullptr; }
  // The product of the extents (0 for an undefined view or a zero extent).
  std::int64_t numel() const noexcept;
  // True when the innermost dimension has stride 1 and each outer stride equals the product of
  // the inner extents (a dense row-major block). Dimensions of extent 1 may have any stride, and
  // a view with no elements is contiguous whatever its strides (numpy gives those stride 0).
  bool is_contiguous() const noexcept;
  // "bf16[4, 8, 512] strides [4096, 512, 1] on cpu". Reads at most kMaxDims entries whatever
  // ndim says (a hand-made view's ndim outside [0, kMaxDims] is named instead).
  std::string describe() const;

  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data);
  }
};

// A dense row-major view. Throws Error(invalid_argument) for more than kMaxDims dimensions or a
// negative extent.
TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     DeviceKind device = DeviceKind::cpu, int device_id = 0);
// A view with explicit strides (elements). Same errors, plus a negative stride.
TensorView make_strided_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                             std::initializer_list<std::int64_t> stride,
                             DeviceKind device = DeviceKind::cpu, int device_id = 0);

}  // namespace fp8mla
