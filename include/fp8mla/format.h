// fp8mla: the latent KV formats and the scalar codecs behind them.
//
// MLA in absorbed form caches one 576-value vector per token: the 512-wide latent c_kv ("ckv")
// followed by the 64-wide rotary key k_pe ("kpe"). The three formats:
//
//   KvFormat          bytes/token  per-token layout                                   scale
//   bf16                   1152    512 bf16 ckv | 64 bf16 kpe                          none
//   fp8_e4m3                576    512 e4m3 ckv | 64 e4m3 kpe                          one float
//   per
//                                                                                      cache (real
//                                                                                      = code *
//                                                                                      scale)
//   fp8_e4m3_block          656    512 e4m3 ckv | 4 float32 scales (one per 128 ckv   per token and
//                                  values, little endian) | 64 bf16 kpe               128 values
//
// fp8_e4m3_block is DeepSeek V3.2 / FlashMLA's layout. Its writer picks, per group of 128
// values, scale = 2^ceil(log2(max(amax / 448, 1e-4))) (a power of two, so dividing by it is
// exact) and stores RNE(x / scale). The rope part stays bf16 (RNE from float input).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace fp8mla {

inline constexpr int kDimCkv = 512;      // latent width, also the V / output width
inline constexpr int kDimKpe = 64;       // rotary width
inline constexpr int kDimQk = 576;       // kDimCkv + kDimKpe: the score dot-product width
inline constexpr int kBlockGroup = 128;  // values per scale in fp8_e4m3_block
inline constexpr int kBlockScales = kDimCkv / kBlockGroup;
inline constexpr float kFp8Max = 448.0f;  // largest finite e4m3fn magnitude

enum class KvFormat : std::uint8_t { bf16, fp8_e4m3, fp8_e4m3_block };

// Bytes one token occupies: 1152, 576 or 656.
constexpr std::int64_t token_bytes(KvFormat f) {
  return f == KvFormat::bf16 ? 2 * kDimQk : f == KvFormat::fp8_e4m3 ? kDimQk : 656;
}
// Byte offsets inside a token of the block format.
inline constexpr std::int64_t kBlockScaleOffset = kDimCkv;                    // 512
inline constexpr std::int64_t kBlockRopeOffset = kDimCkv + 4 * kBlockScales;  // 528

// "bf16", "fp8_e4m3", "fp8_e4m3_block".
const char* format_name(KvFormat f);
// Inverse of format_name (also accepts "fp8" for fp8_e4m3 and "fp8_block"/"block656").
// Throws Error(invalid_argument) naming the accepted spellings.
KvFormat parse_format(std::string_view name);

// What an encoder does with a NaN input.
//  propagate: store NaN (e4m3 0x7f with the input's sign; bf16 quiet NaN). A NaN in the cache
//             then turns every score that reads it into NaN: the attention output shows it.
//  error:     throw Error(invalid_argument) naming the value's index; nothing is written.
enum class NanPolicy : std::uint8_t { propagate, error };

// ---- scalar codecs (exact, host side; the CUDA kernels use bit-identical device versions) ----

// Exact value of an e4m3fn code; NaN for 0x7f and 0xff. Subnormals are 2^-9 * mantissa.
float fp8_e4m3_to_float(std::uint8_t code) noexcept;
// Round to nearest, ties to even; magnitudes beyond 448 (including +-inf) saturate to +-448;
// NaN gives 0x7f | sign. -0.0 gives 0x80.
std::uint8_t float_to_fp8_e4m3(float x) noexcept;
// bf16 <-> float32: bf16 is the upper half of a float32; rounding is RNE, NaN stays quiet NaN.
float bf16_to_float(std::uint16_t bits) noexcept;
std::uint16_t float_to_bf16(float x) noexcept;

// ---- token codec ----

// Encode one token (576 floats: ckv then kpe) into `out` (token_bytes(format) bytes, the
// layout above). `scale` is the per-cache scale of fp8_e4m3 (real = code * scale; the encoder
// stores RNE(x / scale)); it must be finite and > 0 and is ignored by the other formats.
// Errors: out.size() != token_bytes, bad scale, NaN under NanPolicy::error (nothing written).
void encode_token(KvFormat format, float scale, std::span<const float> in,
                  std::span<std::uint8_t> out, NanPolicy nan = NanPolicy::propagate);
// Decode one token's bytes into 576 floats (exact: every e4m3, bf16 and product with a
// power-of-two block scale is a float32; a per-tensor scale multiplies in float32).
void decode_token(KvFormat format, float scale, std::span<const std::uint8_t> in,
                  std::span<float> out);

}  // namespace fp8mla
