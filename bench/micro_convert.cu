// Micro-benchmark: issue rate of the e4m3 -> f16 conversions the decode kernels use, per SM and
// clock, at the fp8_exact kernel's 16 warps per SM. CUDA builds make it
// (build-cuda/bench/fp8mla_micro_convert); run it on a GPU.
// Modes: cvt (cvt.rn.f16x2.e4m3x2, two per 32-bit word), int (shift / mask / or: the values
// times 2^-8, exact, NaN codes become 480 * 2^-8), mixed (half the words each way), none (the
// loop without conversions). Each word's results feed f16x2 adds so nothing is folded away.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "src/cuda/cuda_check.h"
#include "src/cuda/ops/convert.cuh"

using fp8mla::detail::fp8x4_to_half2x2;  // the kernels' conversion, measured as they issue it

// (b0, b2) and (b1, b3) as f16 times 2^-8.
__device__ __forceinline__ void bits2(std::uint32_t x, std::uint32_t& lo, std::uint32_t& hi) {
  hi = ((x >> 1) & 0x3F803F80u) | (x & 0x80008000u);
  lo = ((x << 7) & 0x3F803F80u) | ((x << 8) & 0x80008000u);
}

template <int kMode>  // 0 cvt, 1 int, 2 mixed, 3 none
__global__ void __launch_bounds__(512, 1) bench(std::uint32_t* out, long long* cycles, int iters) {
  std::uint32_t w[8];
  __half2 acc[8];
  for (int i = 0; i < 8; ++i) {
    w[i] = 0x3C3A3938u + threadIdx.x * 0x01010101u + i;
    acc[i] = __floats2half2_rn(0.f, 0.f);
  }
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      std::uint32_t lo, hi;
      if (kMode == 0 || (kMode == 2 && i % 2 == 0)) {
        fp8x4_to_half2x2(w[i], lo, hi);
      } else if (kMode == 1 || kMode == 2) {
        bits2(w[i], lo, hi);
      } else {
        lo = w[i], hi = w[i] ^ 0x00010001u;
      }
      __half2 a, b;
      std::memcpy(&a, &lo, 4);
      std::memcpy(&b, &hi, 4);
      acc[i] = __hfma2(a, b, acc[i]);
      w[i] = w[i] * 0x00010001u + 0x01030507u;  // IMAD: the FMA pipe, not the ALU
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  std::uint32_t r = 0;
  for (int i = 0; i < 8; ++i) {
    std::uint32_t v;
    std::memcpy(&v, &acc[i], 4);
    r ^= v;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = r;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

// The int path against cvt for every code pair: int * 256 == cvt (NaN codes excepted).
__global__ void check(int* bad) {
  const std::uint32_t b = blockIdx.x * blockDim.x + threadIdx.x;  // 0..65535: bytes b0, b1
  const std::uint32_t x = b | (b << 16);
  std::uint32_t clo, chi, ilo, ihi;
  fp8x4_to_half2x2(x, clo, chi);  // clo = (b0, b1)
  bits2(x, ilo, ihi);             // ilo = (b0, b2) = (b0, b0); ihi = (b1, b1)
  __half2 c, i0, i1;
  std::memcpy(&c, &clo, 4);
  std::memcpy(&i0, &ilo, 4);
  std::memcpy(&i1, &ihi, 4);
  const float c0 = __low2float(c), c1 = __high2float(c);
  const float v0 = __low2float(i0) * 256.f, v1 = __low2float(i1) * 256.f;
  const bool nan0 = (b & 0x7F) == 0x7F, nan1 = ((b >> 8) & 0x7F) == 0x7F;
  if ((!nan0 && c0 != v0) || (!nan1 && c1 != v1)) atomicAdd(bad, 1);
}

template <int kMode>
void run(const char* name, int sms, std::uint32_t* out, long long* cyc, long long* h_cyc) {
  const int iters = 1 << 14;
  bench<kMode><<<sms, 512>>>(out, cyc, 16);
  FP8MLA_CUDA_CHECK(cudaGetLastError());
  bench<kMode><<<sms, 512>>>(out, cyc, iters);
  FP8MLA_CUDA_CHECK(cudaDeviceSynchronize());
  FP8MLA_CUDA_CHECK(cudaMemcpy(h_cyc, cyc, sms * sizeof(long long), cudaMemcpyDeviceToHost));
  double mean = 0;
  for (int i = 0; i < sms; ++i) mean += double(h_cyc[i]) / sms;
  const double words = 512.0 * iters * 8;  // per SM
  std::printf("%-6s %8.0f cycles/SM  %6.2f words/clk/SM  (%6.2f code bytes/clk/SM)\n", name, mean,
              words / mean, 4 * words / mean);
}

int main() {
  int sms = 0;
  FP8MLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::uint32_t* out;
  long long* cyc;
  int* bad;
  FP8MLA_CUDA_CHECK(cudaMalloc(&out, sms * 512 * sizeof(std::uint32_t)));
  FP8MLA_CUDA_CHECK(cudaMalloc(&cyc, sms * sizeof(long long)));
  FP8MLA_CUDA_CHECK(cudaMalloc(&bad, sizeof(int)));
  FP8MLA_CUDA_CHECK(cudaMemset(bad, 0, sizeof(int)));
  check<<<256, 256>>>(bad);
  int h_bad = -1;
  FP8MLA_CUDA_CHECK(cudaMemcpy(&h_bad, bad, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("int path vs cvt over all 65536 code pairs: %d mismatches\n", h_bad);
  long long h_cyc[1024];
  run<0>("cvt", sms, out, cyc, h_cyc);
  run<1>("int", sms, out, cyc, h_cyc);
  run<2>("mixed", sms, out, cyc, h_cyc);
  run<3>("none", sms, out, cyc, h_cyc);
  return 0;
}
