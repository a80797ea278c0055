// Internal (CPU backend): strided element access and decoding of cached tokens to float32.
//
// Both CPU paths read the cache through KvReader, so the reference and the fast path see
// bit-identical dequantized values and their difference measures accumulation only. Decoded
// values equal decode_token's: e4m3 and bf16 decode exactly, a per-tensor scale multiplies in
// float32 (code * scale), and a block scale multiplies the exact e4m3 value in float32.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>

#include "fp8mla/cache.h"
#include "fp8mla/format.h"
#include "fp8mla/tensor.h"

namespace fp8mla::detail {

// ---- strided views ----

// Address of element (i0, i1, i2) of `t` (strides in elements); unused trailing indices are 0.
template <class T>
T* element_ptr(const TensorView& t, std::int64_t i0, std::int64_t i1 = 0, std::int64_t i2 = 0) {
  return static_cast<T*>(t.data) + i0 * t.stride[0] + i1 * t.stride[1] + i2 * t.stride[2];
}

// bf16 is the upper half of a float32, so widening is a shift (the same value bf16_to_float
// returns, NaN payloads included). Inline so the decode loops vectorise.
inline float bf16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// ---- token decoding ----

// Exact e4m3fn -> float32 of n codes times `scale` (one float32 rounding, as decode_token
// does: fp8_e4m3_to_float(code) * scale). Branch-free bit arithmetic rather than a table, so
// the loop vectorises (a 256-entry table costs one scalar load per value):
//   normal (exponent e > 0): the float with exponent e + 120 and the 3 mantissa bits on top;
//   subnormal (e = 0):       m * 2^-9, through an integer conversion (no float denormals, so a
//                            caller's flush-to-zero mode cannot change it);
//   0x7f / 0xff:             NaN; the sign bit is copied in every case (-0.0 for 0x80).
// tests/cpu/test_cpu_backend.cpp checks all 256 codes against fp8_e4m3_to_float.
[[gnu::always_inline]] inline void decode_fp8(const std::uint8_t* src, int n, float scale,
                                              float* dst) {
  for (int i = 0; i < n; ++i) {
    const std::uint32_t code = src[i];
    const std::uint32_t mag = code & 0x7fu;
    const std::uint32_t normal = (mag << 20) + (120u << 23);
    const std::uint32_t subnormal =
        std::bit_cast<std::uint32_t>(static_cast<float>(static_cast<std::int32_t>(mag)) * 0x1p-9f);
    const std::uint32_t sub_mask = 0u - static_cast<std::uint32_t>(mag < 8u);
    const std::uint32_t nan_mask = 0u - static_cast<std::uint32_t>(mag == 0x7fu);
    std::uint32_t bits = (subnormal & sub_mask) | (normal & ~sub_mask);
    bits = (0x7fc00000u & nan_mask) | (bits & ~nan_mask);
    dst[i] = std::bit_cast<float>(bits | (code & 0x80u) << 24) * scale;
  }
}

[[gnu::always_inline]] inline void decode_bf16(const std::uint8_t* src, int n, float* dst) {
  for (int i = 0; i < n; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, src + 2 * i, sizeof(bits));
    dst[i] = bf16_bits_to_float(bits);
  }
}

// Reads token (page, offset) of a KvCacheView, honouring its strides and format:
//   bf16:           ckv bf16 [P, ps, 512], kpe bf16 [P, ps, 64]
//   fp8_e4m3:       ckv / kpe fp8_e4m3 or u8 [P, ps, 512] / [P, ps, 64]; real = code * scale
//   fp8_e4m3_block: ckv u8 [P, ps, 656]: 512 e4m3 | 4 float32 scales at byte 512 | 64 bf16 at
//                   byte 528; real = code * scale of its group of 128
// The view must have been validated (run() checks dtypes and shapes). Cheap to copy; const
// methods are safe to call from many threads.
class KvReader {
 public:
  explicit KvReader(const KvCacheView& kv)
      : format_(kv.format),
        ckv_(static_cast<const std::uint8_t*>(kv.ckv.data)),
        ckv_page_stride_(byte_stride(kv.ckv, 0)),
        ckv_token_stride_(byte_stride(kv.ckv, 1)),
        ckv_bytes_(kv.format == KvFormat::fp8_e4m3_block
                       ? static_cast<int>(token_bytes(kv.format))
                       : kDimCkv * static_cast<int>(dtype_size(kv.ckv.dtype))),
        ckv_scale_(kv.format == KvFormat::fp8_e4m3 ? kv.ckv_scale : 1.0f),
        kpe_scale_(kv.format == KvFormat::fp8_e4m3 ? kv.kpe_scale : 1.0f) {
    if (format_ != KvFormat::fp8_e4m3_block) {
      kpe_ = static_cast<const std::uint8_t*>(kv.kpe.data);
      kpe_page_stride_ = byte_stride(kv.kpe, 0);
      kpe_token_stride_ = byte_stride(kv.kpe, 1);
      kpe_bytes_ = kDimKpe * static_cast<int>(dtype_size(kv.kpe.dtype));
    }
  }

  // Decodes one token into ckv[0, 512) and kpe[0, 64).
  [[gnu::always_inline]] void read(std::int64_t page, std::int64_t offset, float* ckv,
                                   float* kpe) const {
    const std::uint8_t* c = ckv_at(page, offset);
    switch (format_) {
      case KvFormat::bf16:
        decode_bf16(c, kDimCkv, ckv);
        decode_bf16(kpe_at(page, offset), kDimKpe, kpe);
        return;
      case KvFormat::fp8_e4m3:
        decode_fp8(c, kDimCkv, ckv_scale_, ckv);
        decode_fp8(kpe_at(page, offset), kDimKpe, kpe_scale_, kpe);
        return;
      case KvFormat::fp8_e4m3_block: {
        // The scales sit at a 4-byte offset of a possibly unaligned token: memcpy, not a cast.
        std::array<float, kBlockScales> scales;
        std::memcpy(scales.data(), c + kBlockScaleOffset, sizeof(scales));
        for (int g = 0; g < kBlockScales; ++g) {
          decode_fp8(c + g * kBlockGroup, kBlockGroup, scales[g], ckv + g * kBlockGroup);
        }
        decode_bf16(c + kBlockRopeOffset, kDimKpe, kpe);
        return;
      }
    }
  }

  // Asks the caches for token (page, offset) ahead of its read: pages sit anywhere in the pool
  // (SGLang's page 1 scatters every token), which no hardware prefetcher predicts.
  [[gnu::always_inline]] void prefetch(std::int64_t page, std::int64_t offset) const {
    const std::uint8_t* c = ckv_at(page, offset);
    for (int b = 0; b < ckv_bytes_; b += 64) __builtin_prefetch(c + b);
    const std::uint8_t* k = kpe_at(page, offset);  // unused for block (kpe_bytes_ 0)
    for (int b = 0; b < kpe_bytes_; b += 64) __builtin_prefetch(k + b);
  }

  // Decodes one token into a contiguous 576-float row (ckv then kpe).
  [[gnu::always_inline]] void read(std::int64_t page, std::int64_t offset, float* token) const {
    read(page, offset, token, token + kDimCkv);
  }

 private:
  static std::int64_t byte_stride(const TensorView& t, int dim) {
    return t.stride[dim] * static_cast<std::int64_t>(dtype_size(t.dtype));
  }
  const std::uint8_t* ckv_at(std::int64_t page, std::int64_t offset) const {
    return ckv_ + page * ckv_page_stride_ + offset * ckv_token_stride_;
  }
  const std::uint8_t* kpe_at(std::int64_t page, std::int64_t offset) const {
    return kpe_ + page * kpe_page_stride_ + offset * kpe_token_stride_;
  }

  KvFormat format_;
  const std::uint8_t* ckv_;            // byte address of ckv[0, 0, 0] (the whole token for block)
  std::int64_t ckv_page_stride_ = 0;   // bytes
  std::int64_t ckv_token_stride_ = 0;  // bytes
  const std::uint8_t* kpe_ = nullptr;  // byte address of kpe[0, 0, 0]; unused for block
  std::int64_t kpe_page_stride_ = 0;
  std::int64_t kpe_token_stride_ = 0;
  int ckv_bytes_;      // a token's ckv bytes (the whole token for block), for prefetch
  int kpe_bytes_ = 0;  // its kpe bytes (0 for block: inside the token)
  float ckv_scale_;    // fp8_e4m3 per-tensor scales (1 for the other formats)
  float kpe_scale_;
};

}  // namespace fp8mla::detail
