// e4m3 codes -> fp16 mma operands, on every architecture the portable family targets.
// sm_89 and newer convert a pair in one instruction (cvt.rn.f16x2.e4m3x2), exactly. sm_80 and
// sm_86 have no such instruction: their codes move into fp16 bit fields by shifts (the value is
// then code * 2^-8, exact, subnormals included, since fp16's exponent range holds e4m3's shifted
// by 8), and the kernel multiplies its sums by kCodeScale = 2^8 at the end. The NaN code
// (S.1111.111) is mapped to an fp16 NaN explicitly, so NaN in the cache reaches the output as
// the reference says.
#pragma once

#include <cstdint>

#include "src/cuda/ops/convert.cuh"

namespace fp8mla::detail::portable {

// The shift form of four codes: two f16x2 words (codes 0, 1 -> lo; 2, 3 -> hi), values code *
// 2^-8. Compiled on every architecture (the GPU tests run it on sm_90 against the instruction).
__device__ __forceinline__ void e4m3x4_to_half2x2_shift(std::uint32_t codes, std::uint32_t& lo,
                                                        std::uint32_t& hi) {
  // Spread bytes 0, 1 (and 2, 3) into the low bytes of two 16-bit lanes.
  const std::uint32_t a = __byte_perm(codes, 0u, 0x4140);  // [c0, 0, c1, 0]
  const std::uint32_t b = __byte_perm(codes, 0u, 0x4342);  // [c2, 0, c3, 0]
  auto spread = [](std::uint32_t v) {
    const std::uint32_t mag = v & 0x007f007fu;
    // 0x80 in a lane whose magnitude bits are all ones (the NaN code).
    const std::uint32_t nan = (mag + 0x00010001u) & 0x00800080u;
    // magnitude << 7 puts the e4m3 exponent and mantissa in fp16's fields (bias 7 against 15:
    // the value is 2^-8 of the code's); the NaN lanes get their exponent field filled.
    return (mag << 7) | ((v & 0x00800080u) << 8) | (nan << 7) | (nan << 6);
  };
  lo = spread(a);
  hi = spread(b);
}

// Codes -> fp16 as the architecture can: the instruction (exact values) or the shift form
// (values 2^-8 of the codes'; multiply sums by kCodeScale).
__device__ __forceinline__ void e4m3x4_to_half2x2(std::uint32_t codes, std::uint32_t& lo,
                                                  std::uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  e4m3x4_to_half2x2_shift(codes, lo, hi);
#else
  fp8x4_to_half2x2(codes, lo, hi);
#endif
}

// What the converted codes' sums are multiplied by (device code only).
__device__ __forceinline__ constexpr float code_scale() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  return 256.0f;
#else
  return 1.0f;
#endif
}

}  // namespace fp8mla::detail::portable
