// The latent KV formats and their scalar codecs (include/fp8mla/format.h).
//
// Everything here is integer bit manipulation rather than float tricks or libm calls, so the
// result does not depend on the floating-point environment (rounding mode, flush-to-zero) or on
// the platform's log2f, and the CUDA kernels can reproduce it bit for bit.
#include "fp8mla/format.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "fp8mla/error.h"
#include "src/core/check.h"

namespace fp8mla {
namespace {

constexpr float e4m3_value(std::uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  if (exponent == 0xf && mantissa == 0x7) {
    return std::bit_cast<float>(negative ? 0xffc00000u : 0x7fc00000u);
  }
  float magnitude = 0.0f;
  if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) / 512.0f;  // subnormal: mantissa * 2^-9
  } else {
    // Normal: 1.mmm * 2^(exponent - 7); rebias the exponent into a float32 bit pattern.
    const std::uint32_t bits = static_cast<std::uint32_t>(exponent - 7 + 127) << 23 |
                               static_cast<std::uint32_t>(mantissa) << 20;
    magnitude = std::bit_cast<float>(bits);
  }
  return negative ? -magnitude : magnitude;
}

constexpr std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> table{};
  for (int c = 0; c < 256; ++c) table[c] = e4m3_value(static_cast<std::uint8_t>(c));
  return table;
}

constexpr std::array<float, 256> kE4m3Table = make_e4m3_table();

// Shifts `m` right by `shift` (1..31) rounding to nearest, ties to even.
constexpr std::uint32_t shift_rne(std::uint32_t m, int shift) {
  const std::uint32_t kept = m >> shift;
  const std::uint32_t rest = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

bool valid_scale(float scale) {
  return std::isfinite(scale) && scale > 0.0f;
}

// The smallest power of two >= v, for finite v > 0, capped at 2^127 (the largest power of two a
// float32 holds). Exact, unlike pow(2, ceil(log2f(v))): a log2f that rounds k + tiny down to k
// would pick a scale one step too small. For bf16 inputs (what FlashMLA's writer takes) v =
// amax / 448 is never within a few ulps above a power of two unless it equals one, so both
// give the same scale there and the golden vectors match.
float pow2_ceil(float v) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
  const std::uint32_t exponent = bits >> 23;        // v > 0: no sign bit
  const std::uint32_t mantissa = bits & 0x7fffffu;  // v >= 1e-4: never subnormal
  if (exponent >= 254 && mantissa != 0) return std::bit_cast<float>(254u << 23);
  return std::bit_cast<float>((exponent + (mantissa != 0 ? 1u : 0u)) << 23);
}

// The block scale of 128 values, as DeepSeek's writer computes it in float32:
// 2^ceil(log2(max(amax / 448, 1e-4))). NaNs do not take part in amax (they are stored as NaN
// codes, or rejected earlier under NanPolicy::error). An infinity makes amax infinite and the
// scale 2^127: the infinity saturates to 448 * 2^127, which decodes back to infinity, and the
// finite values of its block flush to zero; the block still decodes without NaN.
float block_scale(const float* x) {
  float amax = 0.0f;
  for (int i = 0; i < kBlockGroup; ++i) {
    const float a = std::fabs(x[i]);
    if (a > amax) amax = a;  // false for NaN
  }
  float v = amax / kFp8Max;
  if (!(v >= 1e-4f)) v = 1e-4f;
  if (std::isinf(v)) return std::bit_cast<float>(254u << 23);
  return pow2_ceil(v);
}

void store_u16(std::uint8_t* dst, std::uint16_t v) {
  std::memcpy(dst, &v, sizeof v);
}
std::uint16_t load_u16(const std::uint8_t* src) {
  std::uint16_t v;
  std::memcpy(&v, src, sizeof v);
  return v;
}

}  // namespace

float fp8_e4m3_to_float(std::uint8_t code) noexcept {
  return kE4m3Table[code];
}

std::uint8_t float_to_fp8_e4m3(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const std::uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return static_cast<std::uint8_t>(0x7f | sign);  // NaN
  // Beyond 448 (also +-inf) saturate. Inputs in (448, 464) would round to 448 anyway; from 464
  // on, plain rounding would produce the NaN code, which saturation replaces.
  if (abs_bits > std::bit_cast<std::uint32_t>(kFp8Max))
    return static_cast<std::uint8_t>(0x7e | sign);
  const std::uint32_t exponent = abs_bits >> 23;
  std::uint32_t code = 0;
  if (exponent >= 127u - 6u) {
    // Normal e4m3 (>= 2^-6): keep 3 of the 23 mantissa bits and rebias the exponent from 127 to
    // 7. A carry out of the mantissa correctly bumps the exponent.
    code = shift_rne(abs_bits, 20) - ((127u - 7u) << 3);
  } else if (exponent != 0) {
    // e4m3 subnormal range: code = RNE(|x| * 2^9). |x| = (2^23 + mantissa) * 2^(exponent - 150),
    // so |x| * 2^9 is the 24-bit significand shifted right by 141 - exponent (>= 21).
    const int shift = 141 - static_cast<int>(exponent);
    const std::uint32_t significand = (abs_bits & 0x7fffffu) | 0x800000u;
    code = shift >= 26 ? 0u : shift_rne(significand, shift);  // below 2^-11: rounds to 0
  }  // float32 zeros and subnormals are far below 2^-10 and give code 0
  return static_cast<std::uint8_t>(code | sign);
}

float bf16_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_bf16(float x) noexcept {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // Truncating a NaN could leave an all-zero mantissa (infinity); force the quiet bit.
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  }
  // RNE on the low 16 bits; a carry into the exponent rounds large values up to infinity, as
  // IEEE rounding does.
  const std::uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

const char* format_name(KvFormat f) {
  switch (f) {
    case KvFormat::bf16:
      return "bf16";
    case KvFormat::fp8_e4m3:
      return "fp8_e4m3";
    case KvFormat::fp8_e4m3_block:
      return "fp8_e4m3_block";
  }
  return "unknown_format";
}

KvFormat parse_format(std::string_view name) {
  if (name == "bf16") return KvFormat::bf16;
  if (name == "fp8_e4m3" || name == "fp8") return KvFormat::fp8_e4m3;
  if (name == "fp8_e4m3_block" || name == "fp8_block" || name == "block656") {
    return KvFormat::fp8_e4m3_block;
  }
  throw Error(ErrorCode::invalid_argument, "format",
              detail::msg("unknown KV format '", name,
                          "'; expected bf16, fp8_e4m3 (or fp8), fp8_e4m3_block (or fp8_block, "
                          "block656)"));
}

void encode_token(KvFormat format, float scale, std::span<const float> in,
                  std::span<std::uint8_t> out, NanPolicy nan) {
  detail::require(in.size() == static_cast<std::size_t>(kDimQk), "in", "expected ", kDimQk,
                  " values (ckv then kpe), got ", in.size());
  detail::require(format == KvFormat::bf16 || format == KvFormat::fp8_e4m3 ||
                      format == KvFormat::fp8_e4m3_block,
                  "format", "unknown KvFormat value ", static_cast<int>(format));
  detail::require(out.size() == static_cast<std::size_t>(token_bytes(format)), "out", "expected ",
                  token_bytes(format), " bytes for ", format_name(format), ", got ", out.size());
  if (format == KvFormat::fp8_e4m3) {
    detail::require(valid_scale(scale), "scale", "must be finite and > 0, got ", scale);
  }
  if (nan == NanPolicy::error) {
    // Checked up front so that a rejected token leaves `out` untouched.
    for (std::size_t i = 0; i < in.size(); ++i) {
      detail::require(!std::isnan(in[i]), detail::join("in[", i, "]"), "is NaN (NanPolicy::error)");
    }
  }
  const float* x = in.data();
  std::uint8_t* dst = out.data();
  switch (format) {
    case KvFormat::bf16:
      for (int i = 0; i < kDimQk; ++i) store_u16(dst + 2 * i, float_to_bf16(x[i]));
      return;
    case KvFormat::fp8_e4m3:
      // Divide (not multiply by 1/scale) in float32: that is RNE(x / scale) as specified, and what
      // a framework's x.float() / k_scale computes.
      for (int i = 0; i < kDimQk; ++i) dst[i] = float_to_fp8_e4m3(x[i] / scale);
      return;
    case KvFormat::fp8_e4m3_block:
      for (int g = 0; g < kBlockScales; ++g) {
        const float* group = x + g * kBlockGroup;
        const float s = block_scale(group);
        std::memcpy(dst + kBlockScaleOffset + 4 * g, &s, sizeof s);
        // s is a power of two, so x / s is exact (barring float32 underflow, where it rounds
        // as the reference's float32 division does).
        for (int i = 0; i < kBlockGroup; ++i) {
          dst[g * kBlockGroup + i] = float_to_fp8_e4m3(group[i] / s);
        }
      }
      for (int i = 0; i < kDimKpe; ++i) {
        store_u16(dst + kBlockRopeOffset + 2 * i, float_to_bf16(x[kDimCkv + i]));
      }
      return;
  }
}

void decode_token(KvFormat format, float scale, std::span<const std::uint8_t> in,
                  std::span<float> out) {
  detail::require(out.size() == static_cast<std::size_t>(kDimQk), "out", "expected ", kDimQk,
                  " values, got ", out.size());
  detail::require(format == KvFormat::bf16 || format == KvFormat::fp8_e4m3 ||
                      format == KvFormat::fp8_e4m3_block,
                  "format", "unknown KvFormat value ", static_cast<int>(format));
  detail::require(in.size() == static_cast<std::size_t>(token_bytes(format)), "in", "expected ",
                  token_bytes(format), " bytes for ", format_name(format), ", got ", in.size());
  if (format == KvFormat::fp8_e4m3) {
    detail::require(valid_scale(scale), "scale", "must be finite and > 0, got ", scale);
  }
  const std::uint8_t* src = in.data();
  float* y = out.data();
  switch (format) {
    case KvFormat::bf16:
      for (int i = 0; i < kDimQk; ++i) y[i] = bf16_to_float(load_u16(src + 2 * i));
      return;
    case KvFormat::fp8_e4m3:
      for (int i = 0; i < kDimQk; ++i) y[i] = kE4m3Table[src[i]] * scale;
      return;
    case KvFormat::fp8_e4m3_block:
      for (int g = 0; g < kBlockScales; ++g) {
        float s;
        std::memcpy(&s, src + kBlockScaleOffset + 4 * g, sizeof s);
        for (int i = 0; i < kBlockGroup; ++i) {
          y[g * kBlockGroup + i] = kE4m3Table[src[g * kBlockGroup + i]] * s;
        }
      }
      for (int i = 0; i < kDimKpe; ++i) {
        y[kDimCkv + i] = bf16_to_float(load_u16(src + kBlockRopeOffset + 2 * i));
      }
      return;
  }
}

}  // namespace fp8mla
