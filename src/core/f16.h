// Internal: IEEE binary16 (fp16) <-> float32 and float64, bit-exact in software so the result
// does not depend on the compiler or the CPU. fp16 carries FlashInfer's fp16 queries and outputs
// through the CPU backend.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace fp8mla::detail {

// Exact: every fp16 value is a float32 (NaN payloads kept in the top mantissa bits).
inline float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0)
    return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal (or zero): mantissa x 2^-24, exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign != 0 ? -magnitude : magnitude;
}

// Round to nearest even; overflow gives +-inf, NaN stays a quiet NaN with its sign.
inline std::uint16_t float_to_f16_bits(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  // NaN
  // 65520 = 0x477ff000 and above round to infinity (65504 is the largest finite value).
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;
  const int exponent = static_cast<int>(magnitude >> 23) - 127 + 15;  // fp16's biased exponent
  std::uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;       // 24 significant bits
  // A normal result keeps 11 significant bits (shift 13); a subnormal one counts units of 2^-24.
  const int shift = exponent >= 1 ? 13 : 14 - exponent;
  if (shift > 25) return sign;  // below half the smallest subnormal: zero
  std::uint32_t h = mantissa >> shift;
  const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u) != 0)) ++h;  // may carry into the exponent
  if (exponent >= 1) h += static_cast<std::uint32_t>(exponent - 1) << 10;  // h holds the hidden 1
  return static_cast<std::uint16_t>(sign | h);
}

// Correct RNE of a float64 to fp16. Rounding to float32 first could round twice; rounding to
// float32 by round-to-odd keeps what decides the second rounding (float32 has 13 more mantissa
// bits than fp16; 2 would be enough).
inline std::uint16_t double_to_f16_bits(double x) {
  float f = static_cast<float>(x);
  if (std::isnan(x) || std::isinf(f) || static_cast<double>(f) == x) return float_to_f16_bits(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  return float_to_f16_bits(std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u));
}

}  // namespace fp8mla::detail
