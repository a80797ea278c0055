// Token codecs of the three KV formats (include/fp8mla/format.h): FlashMLA's golden 656-byte
// tokens, per-format layouts, round-trip error bounds, NaN policy, argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "tests/common/expect_error.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

constexpr std::array<KvFormat, 3> kFormats = {KvFormat::bf16, KvFormat::fp8_e4m3,
                                              KvFormat::fp8_e4m3_block};

// A tiny reader for the golden JSON: the value of `key` must be an array of arrays of integers.
// Returns false (and leaves `rows` partial) when the key is missing or the value malformed.
bool read_int_rows(const std::string& text, const std::string& key,
                   std::vector<std::vector<long>>& rows) {
  std::size_t pos = text.find("\"" + key + "\"");
  if (pos == std::string::npos) return false;
  pos = text.find(':', pos);
  if (pos == std::string::npos) return false;
  ++pos;
  auto skip_ws = [&] {
    while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
  };
  auto expect = [&](char c) {
    skip_ws();
    if (pos >= text.size() || text[pos] != c) return false;
    ++pos;
    return true;
  };
  if (!expect('[')) return false;
  for (;;) {
    skip_ws();
    if (pos < text.size() && text[pos] == ']') return true;
    if (!expect('[')) return false;
    std::vector<long> row;
    for (;;) {
      skip_ws();
      if (pos < text.size() && text[pos] == ']') {
        ++pos;
        break;
      }
      char* end = nullptr;
      const long v = std::strtol(text.c_str() + pos, &end, 10);
      if (end == text.c_str() + pos) return false;
      row.push_back(v);
      pos = static_cast<std::size_t>(end - text.c_str());
      skip_ws();
      if (pos < text.size() && text[pos] == ',') ++pos;
    }
    rows.push_back(std::move(row));
    skip_ws();
    if (pos < text.size() && text[pos] == ',') ++pos;
  }
}

std::uint32_t bits_of(float x) {
  return std::bit_cast<std::uint32_t>(x);
}

float load_f32(const std::uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
std::uint16_t load_u16(const std::uint8_t* p) {
  std::uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 576 random values: normal with a random per-token magnitude, so block scales vary.
std::vector<float> random_token(std::mt19937& rng) {
  std::uniform_real_distribution<float> log_mag(-8.0f, 8.0f);
  const float mag = std::exp2(log_mag(rng));
  std::normal_distribution<float> normal(0.0f, mag);
  std::vector<float> x(kDimQk);
  for (float& v : x) v = normal(rng);
  return x;
}

TEST(FormatGolden, Block656MatchesFlashMlaByteForByte) {
  const std::string path = test::golden_dir() + "/block656_flashmla.json";
  std::ifstream file(path);
  ASSERT_TRUE(file.good()) << "missing golden file " << path;
  std::stringstream ss;
  ss << file.rdbuf();
  const std::string text = ss.str();
  std::vector<std::vector<long>> inputs, outputs;
  ASSERT_TRUE(read_int_rows(text, "input_bf16_bits", inputs)) << "bad input_bf16_bits in " << path;
  ASSERT_TRUE(read_int_rows(text, "output_bytes", outputs)) << "bad output_bytes in " << path;
  ASSERT_EQ(inputs.size(), 16u);
  ASSERT_EQ(outputs.size(), 16u);
  for (std::size_t t = 0; t < inputs.size(); ++t) {
    ASSERT_EQ(inputs[t].size(), 576u) << "token " << t;
    ASSERT_EQ(outputs[t].size(), 656u) << "token " << t;
    std::vector<float> x(kDimQk);
    for (int i = 0; i < kDimQk; ++i) {
      ASSERT_GE(inputs[t][i], 0);
      ASSERT_LE(inputs[t][i], 0xffff);
      x[i] = bf16_to_float(static_cast<std::uint16_t>(inputs[t][i]));
    }
    std::vector<std::uint8_t> got(656, 0xcd);
    encode_token(KvFormat::fp8_e4m3_block, 1.0f, x, got);
    int mismatches = 0;
    for (int b = 0; b < 656; ++b) {
      if (got[b] != outputs[t][b] && ++mismatches <= 5) {
        ADD_FAILURE() << "token " << t << " byte " << b << ": got " << int{got[b]}
                      << ", FlashMLA wrote " << outputs[t][b];
      }
    }
    EXPECT_EQ(mismatches, 0) << "token " << t;

    // Decoding the reference bytes gives code * scale for ckv and the input bits for the rope.
    std::vector<std::uint8_t> ref(656);
    for (int b = 0; b < 656; ++b) ref[b] = static_cast<std::uint8_t>(outputs[t][b]);
    std::vector<float> y(kDimQk);
    decode_token(KvFormat::fp8_e4m3_block, 1.0f, ref, y);
    for (int i = 0; i < kDimCkv; ++i) {
      const float s = load_f32(ref.data() + kBlockScaleOffset + 4 * (i / kBlockGroup));
      ASSERT_EQ(bits_of(y[i]), bits_of(fp8_e4m3_to_float(ref[i]) * s)) << t << ", " << i;
    }
    for (int i = 0; i < kDimKpe; ++i) {
      ASSERT_EQ(float_to_bf16(y[kDimCkv + i]), inputs[t][kDimCkv + i]) << t << ", rope " << i;
    }
  }
  // Token 3's first block is all zero: amax / 448 = 0 is clamped to 1e-4, so the scale is
  // 2^ceil(log2(1e-4)) = 2^-13 and every code is 0.
  std::vector<float> x3(kDimQk);
  for (int i = 0; i < kDimQk; ++i) x3[i] = bf16_to_float(static_cast<std::uint16_t>(inputs[3][i]));
  std::vector<std::uint8_t> got3(656);
  encode_token(KvFormat::fp8_e4m3_block, 1.0f, x3, got3);
  EXPECT_EQ(load_f32(got3.data() + kBlockScaleOffset), std::ldexp(1.0f, -13));
  EXPECT_TRUE(std::all_of(got3.begin(), got3.begin() + kBlockGroup, [](auto c) { return c == 0; }));
}

TEST(Format, TokenBytesAndNames) {
  EXPECT_EQ(token_bytes(KvFormat::bf16), 1152);
  EXPECT_EQ(token_bytes(KvFormat::fp8_e4m3), 576);
  EXPECT_EQ(token_bytes(KvFormat::fp8_e4m3_block), 656);
  EXPECT_EQ(kBlockScaleOffset, 512);
  EXPECT_EQ(kBlockRopeOffset, 528);
  for (KvFormat f : kFormats) EXPECT_EQ(parse_format(format_name(f)), f);
  EXPECT_STREQ(format_name(KvFormat::bf16), "bf16");
  EXPECT_STREQ(format_name(KvFormat::fp8_e4m3), "fp8_e4m3");
  EXPECT_STREQ(format_name(KvFormat::fp8_e4m3_block), "fp8_e4m3_block");
  EXPECT_EQ(parse_format("fp8"), KvFormat::fp8_e4m3);
  EXPECT_EQ(parse_format("fp8_block"), KvFormat::fp8_e4m3_block);
  EXPECT_EQ(parse_format("block656"), KvFormat::fp8_e4m3_block);
  for (const char* bad : {"", "FP8", "fp16", "bf16 ", "e4m3"}) {
    SCOPED_TRACE(::testing::Message() << "parse_format(\"" << bad << "\")");
    test::expect_error([&] { parse_format(bad); }, {"fp8_e4m3_block"});
  }
}

TEST(Format, Bf16TokenLayout) {
  std::mt19937 rng(11);
  const std::vector<float> x = random_token(rng);
  std::vector<std::uint8_t> out(1152);
  encode_token(KvFormat::bf16, 1.0f, x, out);
  for (int i = 0; i < kDimQk; ++i) {
    ASSERT_EQ(load_u16(out.data() + 2 * i), float_to_bf16(x[i])) << i;
  }
  std::vector<float> y(kDimQk);
  decode_token(KvFormat::bf16, 1.0f, out, y);
  for (int i = 0; i < kDimQk; ++i)
    ASSERT_EQ(bits_of(y[i]), bits_of(bf16_to_float(float_to_bf16(x[i]))));
}

TEST(Format, Fp8TokenLayoutUsesTheScale) {
  std::mt19937 rng(12);
  const std::vector<float> x = random_token(rng);
  for (const float scale : {1.0f, 0.037f, 3.5f}) {
    std::vector<std::uint8_t> out(576);
    encode_token(KvFormat::fp8_e4m3, scale, x, out);
    std::vector<float> y(kDimQk);
    decode_token(KvFormat::fp8_e4m3, scale, out, y);
    for (int i = 0; i < kDimQk; ++i) {
      ASSERT_EQ(out[i], float_to_fp8_e4m3(x[i] / scale)) << i;
      ASSERT_EQ(bits_of(y[i]), bits_of(fp8_e4m3_to_float(out[i]) * scale)) << i;
    }
  }
}

// The per-tensor encoder divides by the scale in float32, as the spec (and a framework's
// x.float() / k_scale) does. Multiplying by a rounded reciprocal is off by an ulp now and then,
// which flips values next to a tie between two codes: collect such inputs (within 8 float ulps
// of a tie) and check the encoder follows the division.
TEST(Format, Fp8EncoderDividesByTheScale) {
  for (const float scale : {0.3f, 1.7f, 5.0f / 3.0f, 0.011f, 7.0f}) {
    std::vector<float> x;
    for (int c = 0; c < 0x7e && x.size() < static_cast<std::size_t>(kDimQk); ++c) {
      const float tie = (fp8_e4m3_to_float(static_cast<std::uint8_t>(c)) +
                         fp8_e4m3_to_float(static_cast<std::uint8_t>(c + 1))) /
                        2;
      float v = tie * scale;
      for (int k = 0; k < 8; ++k) v = std::nextafter(v, 0.0f);
      for (int k = 0; k < 17; ++k, v = std::nextafter(v, 1e9f)) {
        if (float_to_fp8_e4m3(v / scale) != float_to_fp8_e4m3(v * (1.0f / scale))) x.push_back(v);
      }
    }
    ASSERT_GE(x.size(), 10u) << "too few telling inputs for scale " << scale;
    x.resize(kDimQk, 0.0f);  // one token per scale, padded with zeros
    std::vector<std::uint8_t> out(576);
    encode_token(KvFormat::fp8_e4m3, scale, x, out);
    for (int i = 0; i < kDimQk; ++i) {
      ASSERT_EQ(out[i], float_to_fp8_e4m3(x[i] / scale)) << "scale " << scale << " x " << x[i];
    }
  }
}

TEST(Format, BlockTokenLayout) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> x = random_token(rng);
    // Give each group its own magnitude, so the four scales differ.
    for (int g = 0; g < kBlockScales; ++g) {
      for (int i = 0; i < kBlockGroup; ++i) x[g * kBlockGroup + i] *= std::exp2(float(3 * g));
    }
    std::vector<std::uint8_t> out(656);
    encode_token(KvFormat::fp8_e4m3_block, 1.0f, x, out);
    for (int g = 0; g < kBlockScales; ++g) {
      const float s = load_f32(out.data() + kBlockScaleOffset + 4 * g);
      float amax = 0;
      for (int i = 0; i < kBlockGroup; ++i)
        amax = std::max(amax, std::fabs(x[g * kBlockGroup + i]));
      // A power of two, the smallest with amax / s <= 448 (unless the 1e-4 floor binds).
      int e = 0;
      ASSERT_EQ(std::frexp(s, &e), 0.5f) << "scale " << s << " is not a power of two";
      EXPECT_LE(amax / s, 448.0f);
      if (amax / 448.0f > 1e-4f) {
        EXPECT_GT(amax / s, 224.0f) << "scale one step too large";
      }
      for (int i = 0; i < kBlockGroup; ++i) {
        const int k = g * kBlockGroup + i;
        ASSERT_EQ(out[k], float_to_fp8_e4m3(x[k] / s)) << k;
      }
    }
    for (int i = 0; i < kDimKpe; ++i) {
      ASSERT_EQ(load_u16(out.data() + kBlockRopeOffset + 2 * i), float_to_bf16(x[kDimCkv + i]));
    }
  }
}

// Round-trip bounds. RNE to a format with p explicit mantissa bits is off by at most half an
// ulp, 2^-(p+1) * 2^e for a value in [2^e, 2^(e+1)), so the relative error is <= 2^-(p+1):
//   bf16 (p = 7):                       |y - x| <= 2^-8 |x|
//     (not 2^-9: bf16's ulp in [1, 2) is 2^-7, half of it is 2^-8; the test fails at 2^-9)
//   e4m3 (p = 3), after scaling:        |y - x| <= 2^-4 |x|, for |x / scale| in [2^-6, 448]
//   e4m3 subnormals (|x / scale| < 2^-6): absolute, half of 2^-9: |y - x| <= 2^-10 * scale
// The float32 division and product around the e4m3 rounding add ~2^-24 relative, covered by the
// slack between 2^-(p+1) / (1 + 2^-(p+1)) (the true worst case) and 2^-(p+1).
TEST(Format, RoundTripErrorBounds) {
  std::mt19937 rng(14);
  std::uniform_real_distribution<float> log_scale(-6.0f, 4.0f);
  // Largest relative errors seen: they must come close to the bounds, or the bounds (or the
  // data) would be too loose to catch a codec that rounds coarser than it should.
  double worst_bf16 = 0, worst_fp8 = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::vector<float> x = random_token(rng);
    const float tensor_scale = std::exp2(log_scale(rng)) * 1.3f;
    for (KvFormat f : kFormats) {
      std::vector<std::uint8_t> bytes(static_cast<std::size_t>(token_bytes(f)));
      std::vector<float> y(kDimQk);
      // The per-tensor scale must keep x / scale within +-448, as a caller picks it.
      float amax = 0;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      const float scale =
          f == KvFormat::fp8_e4m3 ? std::max(tensor_scale, amax / 448.0f * 1.001f) : 1.0f;
      encode_token(f, scale, x, bytes);
      decode_token(f, scale, bytes, y);
      for (int i = 0; i < kDimQk; ++i) {
        const double xi = x[i];
        const double err = std::fabs(static_cast<double>(y[i]) - xi);
        const bool bf16_value =
            f == KvFormat::bf16 || (f == KvFormat::fp8_e4m3_block && i >= kDimCkv);
        if (bf16_value) {
          ASSERT_LE(err, std::ldexp(std::fabs(xi), -8)) << format_name(f) << " i=" << i;
          worst_bf16 = std::max(worst_bf16, err / std::fabs(xi));
          continue;
        }
        double s = scale;
        if (f == KvFormat::fp8_e4m3_block) {
          s = load_f32(bytes.data() + kBlockScaleOffset + 4 * (i / kBlockGroup));
        }
        const double scaled = std::fabs(xi) / s;
        ASSERT_LE(scaled, 448.0) << format_name(f) << " i=" << i;
        const double bound =
            scaled >= std::ldexp(1.0, -6) ? std::ldexp(std::fabs(xi), -4) : std::ldexp(s, -10);
        ASSERT_LE(err, bound) << format_name(f) << " i=" << i << " x=" << xi << " y=" << y[i]
                              << " scale=" << s;
        if (scaled >= std::ldexp(1.0, -6)) worst_fp8 = std::max(worst_fp8, err / std::fabs(xi));
      }
    }
  }
  EXPECT_GT(worst_bf16, 0.9 * std::ldexp(1.0, -8));
  EXPECT_GT(worst_fp8, 0.9 * std::ldexp(1.0, -4));
}

TEST(Format, NanPolicyErrorThrowsAndWritesNothing) {
  std::mt19937 rng(15);
  std::vector<float> x = random_token(rng);
  for (const int index : {0, 300, 511, 512, 575}) {
    std::vector<float> bad = x;
    bad[index] = std::numeric_limits<float>::quiet_NaN();
    for (KvFormat f : kFormats) {
      std::vector<std::uint8_t> out(static_cast<std::size_t>(token_bytes(f)), 0xab);
      {
        SCOPED_TRACE(::testing::Message() << format_name(f) << ": NaN at " << index);
        const Error e = test::error_of([&] { encode_token(f, 1.0f, bad, out, NanPolicy::error); });
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        EXPECT_EQ(e.argument(), "in[" + std::to_string(index) + "]") << e.what();
      }
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](auto b) { return b == 0xab; }))
          << format_name(f) << ": bytes written despite the error";
      // The same token without NaN encodes fine under NanPolicy::error.
      EXPECT_NO_THROW(encode_token(f, 1.0f, x, out, NanPolicy::error));
    }
  }
}

TEST(Format, NanPolicyPropagateStoresNaN) {
  std::mt19937 rng(16);
  std::vector<float> x = random_token(rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  x[5] = nan;
  x[200] = -nan;
  x[530] = nan;
  for (KvFormat f : kFormats) {
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(token_bytes(f)));
    std::vector<float> y(kDimQk);
    encode_token(f, 1.0f, x, bytes, NanPolicy::propagate);
    decode_token(f, 1.0f, bytes, y);
    for (int i = 0; i < kDimQk; ++i) {
      EXPECT_EQ(std::isnan(y[i]), std::isnan(x[i])) << format_name(f) << " i=" << i;
    }
    if (f != KvFormat::bf16) {
      EXPECT_EQ(bytes[5], 0x7f);
      EXPECT_EQ(bytes[200], 0xff);
    }
  }
  // Block format: a NaN does not take part in its group's amax, so the other 127 values are
  // encoded exactly as they would be without it, wherever in the group the NaN sits. The group
  // is scaled so that the 1e-4 floor does not bind (it would hide a NaN amax).
  std::vector<float> base = random_token(rng);
  float amax = 0;
  for (int i = 0; i < kBlockGroup; ++i) amax = std::max(amax, std::fabs(base[i]));
  for (int i = 0; i < kBlockGroup; ++i) base[i] *= 10.0f / amax;
  for (const int at : {0, 5, 126, 127}) {
    std::vector<float> with = base, clean = base;
    with[at] = nan;
    clean[at] = 0.0f;
    std::vector<std::uint8_t> with_nan(656), without(656);
    encode_token(KvFormat::fp8_e4m3_block, 1.0f, with, with_nan);
    encode_token(KvFormat::fp8_e4m3_block, 1.0f, clean, without);
    EXPECT_EQ(with_nan[at], 0x7f);
    for (int i = 0; i < 656; ++i) {
      if (i != at) {
        EXPECT_EQ(with_nan[i], without[i]) << "NaN at " << at << ", byte " << i;
      }
    }
  }
}

TEST(Format, BlockInfinitySaturatesWithoutNaN) {
  // Documented choice: an infinity makes its group's scale 2^127; it is stored as 448 and decodes
  // back to infinity (448 * 2^127 overflows float32), and the rest of that group flushes to 0.
  std::mt19937 rng(17);
  std::vector<float> x = random_token(rng);
  x[130] = -std::numeric_limits<float>::infinity();
  std::vector<std::uint8_t> bytes(656);
  std::vector<float> y(kDimQk);
  encode_token(KvFormat::fp8_e4m3_block, 1.0f, x, bytes);
  decode_token(KvFormat::fp8_e4m3_block, 1.0f, bytes, y);
  EXPECT_EQ(load_f32(bytes.data() + kBlockScaleOffset + 4), std::ldexp(1.0f, 127));
  EXPECT_EQ(bytes[130], 0xfe);
  EXPECT_EQ(y[130], -std::numeric_limits<float>::infinity());
  for (int i = 0; i < kDimQk; ++i) EXPECT_FALSE(std::isnan(y[i])) << i;
  // Other groups are untouched by the infinity.
  std::vector<float> clean = x;
  clean[130] = 1.0f;
  std::vector<std::uint8_t> ref(656);
  encode_token(KvFormat::fp8_e4m3_block, 1.0f, clean, ref);
  for (int i = 0; i < kBlockGroup; ++i) EXPECT_EQ(bytes[i], ref[i]) << i;
}

TEST(Format, BadScaleErrors) {
  std::mt19937 rng(18);
  const std::vector<float> x = random_token(rng);
  std::vector<std::uint8_t> out(576, 0x11);
  std::vector<float> y(kDimQk);
  const float inf = std::numeric_limits<float>::infinity();
  for (const float scale :
       {0.0f, -0.0f, -1.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN()}) {
    SCOPED_TRACE(::testing::Message() << "scale " << scale);
    const Error e = test::error_of([&] { encode_token(KvFormat::fp8_e4m3, scale, x, out); });
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), "scale") << "encode";
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](auto b) { return b == 0x11; }));
    EXPECT_EQ(test::error_of([&] { decode_token(KvFormat::fp8_e4m3, scale, out, y); }).argument(),
              "scale")
        << "decode";
    // The other formats ignore the scale.
    std::vector<std::uint8_t> b16(1152), blk(656);
    EXPECT_NO_THROW(encode_token(KvFormat::bf16, scale, x, b16));
    EXPECT_NO_THROW(encode_token(KvFormat::fp8_e4m3_block, scale, x, blk));
  }
}

TEST(Format, BadSizeErrors) {
  std::vector<float> x(kDimQk, 0.5f), short_x(kDimQk - 1, 0.5f), y(kDimQk), short_y(kDimQk - 1);
  for (KvFormat f : kFormats) {
    const auto tb = static_cast<std::size_t>(token_bytes(f));
    std::vector<std::uint8_t> out(tb), wrong(tb + 1);
    EXPECT_EQ(test::error_of([&] { encode_token(f, 1.0f, short_x, out); }).argument(), "in");
    EXPECT_EQ(test::error_of([&] { encode_token(f, 1.0f, x, wrong); }).argument(), "out");
    EXPECT_EQ(test::error_of([&] { decode_token(f, 1.0f, wrong, y); }).argument(), "in");
    EXPECT_EQ(test::error_of([&] { decode_token(f, 1.0f, out, short_y); }).argument(), "out");
  }
}

}  // namespace
}  // namespace fp8mla
