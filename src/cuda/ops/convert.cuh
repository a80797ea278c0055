// Number conversions the kernels multiply with: e4m3 codes to fp16 / float (exact), floats to
// bf16 / fp16 pairs, fp16 queries to bf16, block-format dequantization, and the per-row
// power-of-two scale that puts a bf16 q row into fp16's range.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

namespace fp8mla::detail {

// Four e4m3 codes (one 32-bit word, lowest byte first) -> four exact fp16 values as two f16x2
// words, one conversion instruction per pair (every e4m3 value, NaN included, is an fp16).
__device__ __forceinline__ void fp8x4_to_half2x2(std::uint32_t codes, std::uint32_t& lo,
                                                 std::uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(codes));
}

// Two e4m3 codes -> two exact floats (via the f16x2 conversion instruction).
__device__ __forceinline__ float2 fp8x2_to_float2(std::uint16_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(codes, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
__device__ __forceinline__ std::uint32_t float2_to_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}
__device__ __forceinline__ std::uint32_t float2_to_half2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&v);
}
// Both halves of a bf16x2 word as floats: a bf16 is a float's high half (a shift and a mask;
// __bfloat1622float2 spends a PRMT on each).
__device__ __forceinline__ float2 bf16x2_to_float2(std::uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}

namespace ops {

// 8 query values (16 bytes as loaded) as bf16: as given, or fp16 rounded to bf16 (nearest even;
// every fp16 is in bf16's range, so only the low 3 mantissa bits go) when f16, the plan's
// q_dtype. Both results are made and the bits selected, as store_out2 does.
__device__ __forceinline__ uint4 q_as_bf16(uint4 v, bool f16) {
  std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
    const std::uint32_t b = float2_to_bf16x2(f.x, f.y);
    w[k] = f16 ? b : w[k];
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// An fp16 pair as two bf16 pairs hi = bf16(x) and lo = bf16(x - hi) whose sum is x exactly: x - hi
// is a multiple of x's fp16 ulp smaller than half of hi's bf16 ulp (at most 3 significant bits),
// and bf16 has float's exponent range. Products of both terms with bf16 operands, summed in fp32,
// are the fp16 products. (An infinite x gives lo = NaN.)
__device__ __forceinline__ void half2_to_bf16x2_terms(std::uint32_t h2, std::uint32_t& hi,
                                                      std::uint32_t& lo) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
  hi = float2_to_bf16x2(f.x, f.y);
  const float2 h = bf16x2_to_float2(hi);
  lo = float2_to_bf16x2(f.x - h.x, f.y - h.y);
}

// 16 e4m3 codes times a (power-of-two) scale -> 16 bf16 values, codes 0-7 in lo, 8-15 in hi
// (exact: bf16 holds every code times every block scale; 448 x 2^127 becomes inf, as the float
// reference's product does).
__device__ __forceinline__ void dequantize16(uint4 codes, float scale, uint4& lo, uint4& hi) {
  const std::uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  std::uint32_t out[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = fp8x2_to_float2(static_cast<std::uint16_t>(w[k] & 0xffff));
    const float2 b = fp8x2_to_float2(static_cast<std::uint16_t>(w[k] >> 16));
    out[2 * k] = float2_to_bf16x2(a.x * scale, a.y * scale);
    out[2 * k + 1] = float2_to_bf16x2(b.x * scale, b.y * scale);
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}
// The same into 32 contiguous bytes at dst.
__device__ __forceinline__ void dequantize16(uint4 codes, float scale, std::uint8_t* dst) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  dequantize16(codes, scale, d[0], d[1]);
}

// Two f16x2 words multiplied lane by lane (one rounding; exact for a power-of-two factor whose
// product stays in fp16's range).
__device__ __forceinline__ std::uint32_t hmul2(std::uint32_t a, std::uint32_t b) {
  std::uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// |x| of 8 bf16 values as the bits of a non-negative float (orders like the value; NaN above inf).
__device__ __forceinline__ std::uint32_t abs_max_bits(uint4 v) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
  std::uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) m = max(m, max(w[k] & 0x7fffu, (w[k] >> 16) & 0x7fffu));
  return m << 16;
}

// fp16 tiles scale q row r by 2^e with max|q_r| * 2^e in [2^14, 2^15): exact for every bf16 value
// above 2^-29 of the row maximum (smaller ones round at 2^-25 of it); 2^-e is undone on the
// scores. Rows of zeros, inf or NaN keep e = 0. Taken from amax's exponent field alone (e in
// [-113, 120]), without frexpf's branches.
__device__ __forceinline__ int q_row_exponent(float amax) {
  const std::uint32_t b = __float_as_uint(amax);
  const int biased = static_cast<int>(b >> 23);  // > 255 when negative
  if (b == 0 || biased >= 255) return 0;         // zero, inf, NaN (or a negative value)
  // Normal: amax in [2^(biased - 127), 2^(biased - 126)); subnormal (biased 0): 120.
  return min(141 - biased, 120);
}

// 2^e as a float, for e in [-126, 127].
__device__ __forceinline__ float exp2i(int e) {
  return __int_as_float((127 + e) << 23);
}

// Two bf16 values times `scale` as an f16x2 word.
__device__ __forceinline__ std::uint32_t scale_to_half2(std::uint32_t bf16x2, float scale) {
  const float2 f = bf16x2_to_float2(bf16x2);
  return float2_to_half2(f.x * scale, f.y * scale);
}

}  // namespace ops

}  // namespace fp8mla::detail
