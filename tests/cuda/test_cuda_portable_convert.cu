// The one architecture-dependent step of the portable family's fp16 products: sm_80 and sm_86
// convert e4m3 codes by shifts (values 2^-8 of the codes', NaN mapped to NaN), sm_89 and newer
// by the conversion instruction. This test runs both on the device at hand for every pair of
// codes and requires the shift form times 2^8 to equal the instruction bit for bit (NaN for NaN),
// so the kernels compiled for sm_80 / sm_86 compute what the tested ones compute. And
// portable_f16_exact's split of fp16 values into two bf16 terms, for every fp16 value. And the
// Q row exponent the fp16 and e4m3 Q forms share (ops::q_row_exponent, from the float's bits)
// against frexpf and ldexpf, for every float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#include "src/cuda/decode/portable/convert.cuh"
#include "src/cuda/ops/convert.cuh"
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

__global__ void split_terms(std::uint32_t* out) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;  // fp16 bits i, twice
  std::uint32_t hi, lo;
  detail::ops::half2_to_bf16x2_terms(i | i << 16, hi, lo);
  out[2 * i] = hi, out[2 * i + 1] = lo;
}

float bf16_bits(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

// hi = bf16(x) and lo = bf16(x - hi) sum to x exactly for every finite fp16 x (both halves of the
// word), hi is x rounded to bf16, and an infinite x keeps hi infinite.
TEST(CudaPortable, F16SplitsIntoTwoBf16TermsExactly) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer out(std::size_t{65536} * 2 * 4);
  split_terms<<<256, 256>>>(static_cast<std::uint32_t*>(out.ptr));
  check_cuda(cudaGetLastError());
  check_cuda(cudaDeviceSynchronize());
  const std::vector<std::uint32_t> w = out.to_host<std::uint32_t>();
  int finite = 0;
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const float x = half_bits(static_cast<std::uint16_t>(i));
    for (int half = 0; half < 2; ++half) {
      const float hi = bf16_bits(static_cast<std::uint16_t>(w[2 * i] >> (16 * half)));
      const float lo = bf16_bits(static_cast<std::uint16_t>(w[2 * i + 1] >> (16 * half)));
      if (std::isnan(x)) continue;
      if (std::isinf(x)) {
        ASSERT_EQ(hi, x) << "fp16 bits " << i;
        continue;
      }
      ++finite;
      ASSERT_EQ(static_cast<double>(hi) + static_cast<double>(lo), static_cast<double>(x))
          << "fp16 bits " << i << " half " << half;
      ASSERT_EQ(hi, __bfloat162float(__float2bfloat16_rn(x))) << "fp16 bits " << i;
    }
  }
  EXPECT_EQ(finite, 2 * 63488);  // every fp16 but the 2 infinities and 2046 NaNs
}

// The plain form of ops::q_row_exponent: max |q| * 2^e in [2^14, 2^15), clamped to [-120, 120];
// 0 for zero, inf, NaN and negative values.
__device__ int q_row_exponent_frexp(float amax) {
  int e = 0;
  if (amax > 0.0f && amax <= FLT_MAX) {
    frexpf(amax, &e);
    e = min(max(15 - e, -120), 120);
  }
  return e;
}

// Every float's bits: the exponent against the plain form, and the scales wide_rows takes from
// it (2^e, 2^-e and a ratio times 2^e) against ldexpf. bad[0]: mismatches; bad[1]: the first
// mismatching bits seen.
__global__ void row_exponents(float ratio, unsigned long long* bad) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const float x = __uint_as_float(static_cast<std::uint32_t>(i));
    const int e = detail::ops::q_row_exponent(x);
    const bool ok = e == q_row_exponent_frexp(x) && detail::ops::exp2i(e) == ldexpf(1.0f, e) &&
                    detail::ops::exp2i(-e) == ldexpf(1.0f, -e) &&
                    ratio * detail::ops::exp2i(e) == ldexpf(ratio, e);
    if (!ok && atomicAdd(bad, 1ull) == 0) bad[1] = i;
  }
}

TEST(CudaOps, QRowExponentMatchesFrexpForEveryFloat) {
  SKIP_WITHOUT_GPU();
  // Ratios (kpe_scale / ckv_scale) whose products with 2^e reach fp32's subnormals and its
  // largest values, where one rounding must match ldexpf's.
  for (const float ratio : {1.0f, 0.3f, 3.0e-30f, 7.0e30f}) {
    DeviceBuffer bad(2 * sizeof(unsigned long long));
    check_cuda(cudaMemset(bad.ptr, 0, 2 * sizeof(unsigned long long)));
    row_exponents<<<1056, 256>>>(ratio, static_cast<unsigned long long*>(bad.ptr));
    check_cuda(cudaGetLastError());
    check_cuda(cudaDeviceSynchronize());
    const std::vector<unsigned long long> b = bad.to_host<unsigned long long>();
    EXPECT_EQ(b[0], 0u) << "ratio " << ratio << ": first mismatch at float bits 0x" << std::hex
                        << b[1];
  }
}

}  // namespace
}  // namespace fp8mla::gputest
