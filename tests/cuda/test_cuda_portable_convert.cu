// The one architecture-dependent step of the portable family's fp16 products: sm_80 and sm_86
// convert e4m3 codes by shifts (values 2^-8 of the codes', NaN mapped to NaN), sm_89 and newer
// by the conversion instruction. This test runs both on the device at hand for every pair of
// codes and requires the shift form times 2^8 to equal the instruction bit for bit (NaN for NaN),
// so the kernels compiled for sm_80 / sm_86 compute what the tested ones compute.
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "src/cuda/decode/portable/convert.cuh"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla::gputest {
namespace {

__global__ void convert_both(std::uint32_t* out) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;  // codes: i's two bytes, twice
  const std::uint32_t codes = (i & 0xffffu) | (i & 0xffffu) << 16;
  std::uint32_t lo = 0, hi = 0, slo, shi;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890  // the instruction; the test skips below
  detail::fp8x4_to_half2x2(codes, lo, hi);
#endif
  detail::portable::e4m3x4_to_half2x2_shift(codes, slo, shi);
  out[4 * i] = lo, out[4 * i + 1] = hi, out[4 * i + 2] = slo, out[4 * i + 3] = shi;
}

float half_bits(std::uint16_t b) {
  __half_raw r;
  r.x = b;
  return __half2float(__half(r));
}

TEST(CudaPortable, ShiftConversionMatchesTheInstruction) {
  SKIP_WITHOUT_GPU();
  int major = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  int minor = 0;
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  if (10 * major + minor < 89) GTEST_SKIP() << "the conversion instruction needs sm_89";
  DeviceBuffer out(std::size_t{65536} * 4 * 4);
  convert_both<<<256, 256>>>(static_cast<std::uint32_t*>(out.ptr));
  check_cuda(cudaGetLastError());
  check_cuda(cudaDeviceSynchronize());
  const std::vector<std::uint32_t> w = out.to_host<std::uint32_t>();
  int nan_codes = 0, checked = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    for (int k = 0; k < 2; ++k) {        // lo and hi word
      for (int half = 0; half < 2; ++half) {  // the two codes of the word
        const auto hw = static_cast<std::uint16_t>(w[4 * i + k] >> (16 * half));
        const auto sh = static_cast<std::uint16_t>(w[4 * i + 2 + k] >> (16 * half));
        const float a = half_bits(hw), b = half_bits(sh) * 256.0f;
        ++checked;
        if (std::isnan(a)) {
          ++nan_codes;
          ASSERT_TRUE(std::isnan(b)) << "word " << i << ": NaN code became " << b;
        } else {
          ASSERT_EQ(a, b) << "word " << i << " k " << k << " half " << half;
          ASSERT_EQ(std::signbit(a), std::signbit(b)) << "word " << i;
        }
      }
    }
  }
  EXPECT_EQ(checked, 65536 * 4);
  EXPECT_GT(nan_codes, 0);  // 0x7f and 0xff were among the codes
}

}  // namespace
}  // namespace fp8mla::gputest
