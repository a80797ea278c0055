// Tensor views (include/fp8mla/tensor.h, src/core/tensor.cpp): how every array crosses the API.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fp8mla/tensor.h"
#include "tests/common/expect_error.h"

namespace fp8mla {
namespace {

using test::error_of;

// make_view / make_strided_view: strides, element counts, contiguity and descriptions, the
// errors naming the bad shape or stride entry; dtype sizes and names; device names.
TEST(TensorView, MakeViewAndDescribe) {
  std::vector<std::uint16_t> buf(2 * 3 * 4);
  const TensorView t = make_view(buf.data(), DType::bf16, {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.stride, (std::array<std::int64_t, 4>{12, 4, 1, 0}));
  EXPECT_EQ(t.numel(), 24);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "bf16[2, 3, 4] strides [12, 4, 1] on cpu");
  const TensorView s =
      make_strided_view(buf.data(), DType::fp8_e4m3, {2, 3}, {8, 1}, DeviceKind::cuda, 1);
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(s.numel(), 6);
  EXPECT_EQ(s.describe(), "fp8_e4m3[2, 3] strides [8, 1] on cuda:1");
  EXPECT_EQ(TensorView{}.numel(), 0);  // an undefined (optional, left out) tensor holds nothing
  EXPECT_EQ(make_view(buf.data(), DType::f32, {}).numel(), 1);
  EXPECT_EQ(make_view(buf.data(), DType::f32, {5, 0}).numel(), 0);
  EXPECT_EQ(error_of([&] {
              make_view(buf.data(), DType::u8, {1, 2, 3, 4, 5});
            }).argument(),
            "shape");
  EXPECT_EQ(error_of([&] { make_view(buf.data(), DType::u8, {2, -1}); }).argument(), "shape[1]");
  EXPECT_EQ(error_of([&] {
              make_strided_view(buf.data(), DType::u8, {2, 2}, {-2, 1});
            }).argument(),
            "stride[0]");
  EXPECT_EQ(error_of([&] {
              make_strided_view(buf.data(), DType::u8, {2, 2}, {1});
            }).argument(),
            "stride");
  const std::array<std::size_t, 7> sizes = {1, 4, 4, 2, 2, 1, 8};
  const std::array<const char*, 7> names = {"u8", "i32", "f32", "bf16", "f16", "fp8_e4m3", "i64"};
  for (int d = 0; d < 7; ++d) {
    EXPECT_EQ(dtype_size(static_cast<DType>(d)), sizes[d]);
    EXPECT_STREQ(dtype_name(static_cast<DType>(d)), names[d]);
  }
  EXPECT_STREQ(device_name(DeviceKind::cpu), "cpu");
  EXPECT_STREQ(device_name(DeviceKind::cuda), "cuda");
}

}  // namespace
}  // namespace fp8mla
