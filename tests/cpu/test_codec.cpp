// Scalar codecs: e4m3fn <-> float32 and bf16 <-> float32 (include/fp8mla/format.h).
//
// Three oracles: PyTorch's golden tables (../shared/golden, written by code nobody here wrote),
// a brute-force nearest-code search written independently of the bit-manipulating encoder, and
// hand-picked edge cases (ties, subnormals, zeros, NaN, saturation).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fp8mla/format.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

// Reads a golden TSV: rows of tab-separated fields, '#' lines are comments. A missing file is a
// failure (the golden vectors are the point of these tests), reported through `ok`.
std::vector<std::vector<std::string>> read_tsv(const std::string& name, bool& ok) {
  const std::string path = test::golden_dir() + "/" + name;
  std::ifstream file(path);
  ok = file.good();
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(file, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> fields;
    std::stringstream ss(line);
    std::string field;
    while (std::getline(ss, field, '\t')) fields.push_back(field);
    rows.push_back(fields);
  }
  return rows;
}

std::uint32_t parse_hex(const std::string& s) {
  return static_cast<std::uint32_t>(std::stoul(s, nullptr, 16));
}

std::uint32_t bits_of(float x) {
  return std::bit_cast<std::uint32_t>(x);
}

// Independent reference for e4m3fn RNE with saturation: the nearest of all finite codes by
// exhaustive search in double precision, ties to the code with an even mantissa.
std::uint8_t reference_e4m3(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 448.0) return static_cast<std::uint8_t>(sign | 0x7e);
  int best = 0;
  double best_err = a;
  for (int c = 1; c <= 0x7e; ++c) {
    const int e = c >> 3;
    const int m = c & 7;
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    const double err = std::fabs(v - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

// Independent reference for float -> bf16 RNE: compare the two neighbouring bf16 values.
std::uint16_t reference_bf16(float x) {
  const std::uint32_t bits = bits_of(x);
  if (std::isinf(x)) return static_cast<std::uint16_t>(bits >> 16);
  const auto lo = static_cast<std::uint16_t>(bits >> 16);  // truncation: toward zero
  const auto hi = static_cast<std::uint16_t>(lo + 1);      // next magnitude up
  const double lo_v = std::fabs(static_cast<double>(std::bit_cast<float>(std::uint32_t{lo} << 16)));
  const double hi_v =
      (hi & 0x7fff) == 0x7f80
          ? std::ldexp(1.0, 128)  // rounding past the largest finite: infinity
          : std::fabs(static_cast<double>(std::bit_cast<float>(std::uint32_t{hi} << 16)));
  const double a = std::fabs(static_cast<double>(x));
  if (a - lo_v < hi_v - a) return lo;
  if (a - lo_v > hi_v - a) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

TEST(CodecGolden, DecodeMatchesPyTorchForEveryCode) {
  bool ok = false;
  const auto rows = read_tsv("e4m3fn_decode.tsv", ok);
  ASSERT_TRUE(ok) << "missing golden file " << test::golden_dir() << "/e4m3fn_decode.tsv";
  ASSERT_EQ(rows.size(), 256u);
  std::vector<bool> seen(256, false);
  for (const auto& row : rows) {
    ASSERT_EQ(row.size(), 2u);
    const std::uint32_t code = parse_hex(row[0]);
    ASSERT_LT(code, 256u);
    seen[code] = true;
    const float got = fp8_e4m3_to_float(static_cast<std::uint8_t>(code));
    if (row[1] == "nan") {
      EXPECT_TRUE(std::isnan(got)) << row[0];
      EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << row[0];
      continue;
    }
    const float want = std::strtof(row[1].c_str(), nullptr);
    // Bitwise, so -0.0 must decode as -0.0.
    EXPECT_EQ(bits_of(got), bits_of(want)) << row[0] << ": got " << got << ", want " << row[1];
  }
  for (int c = 0; c < 256; ++c) EXPECT_TRUE(seen[c]) << "code " << c << " missing from the file";
}

TEST(CodecGolden, EncodeMatchesPyTorchRne) {
  bool ok = false;
  const auto rows = read_tsv("e4m3fn_encode_rne.tsv", ok);
  ASSERT_TRUE(ok) << "missing golden file " << test::golden_dir() << "/e4m3fn_encode_rne.tsv";
  ASSERT_EQ(rows.size(), 3756u);
  int mismatches = 0;
  for (const auto& row : rows) {
    ASSERT_EQ(row.size(), 3u);
    const float x = std::bit_cast<float>(parse_hex(row[0]));
    // The decimal column must describe the same float (guards against misreading the file).
    ASSERT_EQ(bits_of(std::strtof(row[1].c_str(), nullptr)), bits_of(x)) << row[0];
    const std::uint32_t want = parse_hex(row[2]);
    const std::uint8_t got = float_to_fp8_e4m3(x);
    if (got != want && ++mismatches <= 10) {
      ADD_FAILURE() << "x = " << row[1] << " (" << row[0] << "): got 0x" << std::hex << int{got}
                    << ", PyTorch 0x" << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Codec, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if (c == 0x7f || c == 0xff) continue;  // NaN: checked separately
    const auto code = static_cast<std::uint8_t>(c);
    EXPECT_EQ(float_to_fp8_e4m3(fp8_e4m3_to_float(code)), code) << "code " << c;
  }
}

TEST(Codec, DecodeIsMonotonicAndExact) {
  // Positive codes increase strictly; subnormals are m * 2^-9; normals (8 + m) * 2^(e - 10).
  for (int c = 0; c <= 0x7e; ++c) {
    const int e = c >> 3;
    const int m = c & 7;
    const double want = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    EXPECT_EQ(static_cast<double>(fp8_e4m3_to_float(static_cast<std::uint8_t>(c))), want) << c;
    EXPECT_EQ(static_cast<double>(fp8_e4m3_to_float(static_cast<std::uint8_t>(c | 0x80))), -want)
        << c;
    if (c > 0) {
      EXPECT_LT(fp8_e4m3_to_float(static_cast<std::uint8_t>(c - 1)),
                fp8_e4m3_to_float(static_cast<std::uint8_t>(c)));
    }
  }
}

TEST(Codec, TiesBetweenAdjacentCodesRoundToEven) {
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = fp8_e4m3_to_float(static_cast<std::uint8_t>(c));
    const float hi = fp8_e4m3_to_float(static_cast<std::uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;  // exact: a 5-bit significand fits a float32
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + static_cast<double>(hi)) / 2.0);
    // The low bit of a code is its mantissa's low bit, so "even" is the even code.
    const int even = (c % 2 == 0) ? c : c + 1;
    for (const float sign : {1.0f, -1.0f}) {
      const int s = sign < 0 ? 0x80 : 0;
      EXPECT_EQ(float_to_fp8_e4m3(sign * mid), even | s) << "tie at " << sign * mid;
      EXPECT_EQ(float_to_fp8_e4m3(sign * std::nextafter(mid, 0.0f)), c | s)
          << "just below " << sign * mid;
      EXPECT_EQ(float_to_fp8_e4m3(sign * std::nextafter(mid, 1000.0f)), (c + 1) | s)
          << "just above " << sign * mid;
    }
  }
}

TEST(Codec, Subnormals) {
  for (int m = 1; m < 8; ++m) {
    EXPECT_EQ(fp8_e4m3_to_float(static_cast<std::uint8_t>(m)), std::ldexp(1.0f, -9) * float(m));
  }
  const float q = std::ldexp(1.0f, -10);  // half the smallest subnormal
  EXPECT_EQ(float_to_fp8_e4m3(q), 0x00);  // tie between 0 and 1: to even 0
  EXPECT_EQ(float_to_fp8_e4m3(std::nextafter(q, 1.0f)), 0x01);
  EXPECT_EQ(float_to_fp8_e4m3(3 * q), 0x02);  // tie between 1 and 2: to even 2
  EXPECT_EQ(float_to_fp8_e4m3(-3 * q), 0x82);
  EXPECT_EQ(float_to_fp8_e4m3(15 * q), 0x08);  // tie between 7 and the smallest normal
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -6)), 0x08);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(-std::numeric_limits<float>::denorm_min()), 0x80);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::min()), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.0f, -12)), 0x00);
}

TEST(Codec, SignedZeros) {
  EXPECT_EQ(float_to_fp8_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_fp8_e4m3(-0.0f), 0x80);
  EXPECT_EQ(bits_of(fp8_e4m3_to_float(0x00)), bits_of(0.0f));
  EXPECT_EQ(bits_of(fp8_e4m3_to_float(0x80)), bits_of(-0.0f));
}

TEST(Codec, NaN) {
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xff)));
  EXPECT_FALSE(std::signbit(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_float(0xff)));
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_fp8_e4m3(qnan), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(-qnan), 0xff);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::signaling_NaN()), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(std::bit_cast<float>(0x7f800001u)), 0x7f);  // smallest payload
  EXPECT_EQ(float_to_fp8_e4m3(std::bit_cast<float>(0xffffffffu)), 0xff);
}

TEST(Codec, SaturatesBeyond448) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x : {448.0f, std::nextafter(448.0f, 1e9f), 449.0f, 463.99f, 464.0f, 480.0f, 1e6f,
                        std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(float_to_fp8_e4m3(x), 0x7e) << x;
    EXPECT_EQ(float_to_fp8_e4m3(-x), 0xfe) << -x;
  }
  EXPECT_EQ(float_to_fp8_e4m3(432.0f), 0x7e);  // tie 416 | 448: to even 448 (mantissa 110)
  EXPECT_EQ(float_to_fp8_e4m3(std::nextafter(432.0f, 0.0f)), 0x7d);
}

TEST(Codec, RandomValuesMatchBruteForceSearch) {
  std::mt19937 rng(20240601);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    // Log-uniform magnitudes over the whole e4m3 range and beyond, random sign.
    float x = std::exp2(exponent(rng)) * ((i & 1) ? -1.0f : 1.0f);
    if (i % 4 == 3) {
      x = std::bit_cast<float>(any_bits(rng));  // any float32 at all, NaN and inf included
    }
    const std::uint8_t want = reference_e4m3(x);
    ASSERT_EQ(float_to_fp8_e4m3(x), want)
        << "x = " << x << " (bits 0x" << std::hex << bits_of(x) << ")";
  }
}

TEST(Codec, Bf16ExpandsExactly) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float x = bf16_to_float(static_cast<std::uint16_t>(b));
    ASSERT_EQ(bits_of(x), b << 16);
    if (!std::isnan(x)) {
      ASSERT_EQ(float_to_bf16(x), b) << "bf16 0x" << std::hex << b;
    }
  }
}

TEST(Codec, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between bf16 1.0 (even) and 1 + 2^-7 (odd): rounds down to 1.0.
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f807fffu)), 0x3f80);
  // Halfway between 0x3f81 (odd) and 0x3f82 (even): rounds up.
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0xbf818000u)), 0xbf82);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // The largest float32 is above the largest bf16 by more than half a bf16 ulp: infinity.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x7f7f7fffu)), 0x7f7f);
  // Float32 subnormals round like any other value.
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00008000u)), 0x0000);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x00018000u)), 0x0002);

  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    const float x = std::bit_cast<float>(any_bits(rng));
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16(x), reference_bf16(x)) << "bits 0x" << std::hex << bits_of(x);
  }
}

TEST(Codec, Bf16NaNStaysQuietNaN) {
  // A NaN whose payload sits only in the low 16 bits must not truncate to infinity.
  for (const std::uint32_t bits :
       {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu, 0xffc00000u}) {
    const std::uint16_t b = float_to_bf16(std::bit_cast<float>(bits));
    EXPECT_TRUE(std::isnan(bf16_to_float(b))) << std::hex << bits;
    EXPECT_NE(b & 0x0040, 0) << "not quiet: " << std::hex << b;
    EXPECT_EQ(b >> 15, bits >> 31) << "sign lost";
  }
}

}  // namespace
}  // namespace fp8mla
