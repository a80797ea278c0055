// PagedLatentCache (include/fp8mla/cache.h): config checks, the page free list, quantizing
// append, views, token reads, and (when a GPU is visible) a CUDA cache against the host one.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/cache.h"
#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "src/core/backend.h"
#include "tests/common/expect_error.h"

namespace fp8mla {
namespace {

constexpr std::array<KvFormat, 3> kFormats = {KvFormat::bf16, KvFormat::fp8_e4m3,
                                              KvFormat::fp8_e4m3_block};
constexpr std::array<DType, 3> kInputDtypes = {DType::f32, DType::bf16, DType::f16};

CacheConfig make_config(KvFormat format, std::int64_t num_pages, int page_size,
                        float scale = 1.0f) {
  CacheConfig c;
  c.format = format;
  c.num_pages = num_pages;
  c.page_size = page_size;
  c.scale = scale;
  return c;
}

using test::error_of;

std::vector<std::uint8_t> snapshot(const PagedLatentCache& cache) {
  const TensorView s = cache.storage();
  const auto* p = s.as<const std::uint8_t>();
  return std::vector<std::uint8_t>(p, p + s.numel());
}

bool same_value(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) ||
         std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

// n tokens of append input in `dtype`, rows padded (strided) and the padding set to NaN, so a
// reader that strays into it is caught. `values` holds what the rows mean as float32.
struct Rows {
  DType dtype;
  std::int64_t n;
  std::int64_t ckv_stride = kDimCkv + 24;
  std::int64_t kpe_stride = kDimKpe + 8;
  std::vector<std::uint8_t> ckv_buf, kpe_buf;
  std::vector<float> values;  // [n, 576]

  Rows(DType d, std::int64_t count, std::mt19937& rng) : dtype(d), n(count) {
    const std::size_t elem = dtype_size(d);
    ckv_buf.resize(static_cast<std::size_t>(n * ckv_stride) * elem);
    kpe_buf.resize(static_cast<std::size_t>(n * kpe_stride) * elem);
    for (std::int64_t i = 0; i < n * ckv_stride; ++i) store_nan(ckv_buf, i);
    for (std::int64_t i = 0; i < n * kpe_stride; ++i) store_nan(kpe_buf, i);
    values.resize(static_cast<std::size_t>(n) * kDimQk);
    std::uniform_real_distribution<float> log_mag(-6.0f, 6.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      const float mag = std::exp2(log_mag(rng));
      for (int j = 0; j < kDimQk; ++j) {
        const bool in_ckv = j < kDimCkv;
        const std::int64_t at = in_ckv ? i * ckv_stride + j : i * kpe_stride + (j - kDimCkv);
        values[static_cast<std::size_t>(i * kDimQk + j)] =
            store_random(in_ckv ? ckv_buf : kpe_buf, at, mag, rng);
      }
    }
  }

  // Makes value j of token i (j >= 512: kpe[i, j - 512]) a NaN or an infinity, v.
  void set_special(std::int64_t i, int j, float v) {
    const bool in_ckv = j < kDimCkv;
    auto& buf = in_ckv ? ckv_buf : kpe_buf;
    const std::int64_t at = in_ckv ? i * ckv_stride + j : i * kpe_stride + (j - kDimCkv);
    if (dtype == DType::f32) std::memcpy(buf.data() + at * 4, &v, 4);
    if (dtype == DType::bf16) store_u16(buf, at, std::isnan(v) ? 0x7fc0 : v > 0 ? 0x7f80 : 0xff80);
    if (dtype == DType::f16) store_u16(buf, at, std::isnan(v) ? 0x7e00 : v > 0 ? 0x7c00 : 0xfc00);
    values[static_cast<std::size_t>(i * kDimQk + j)] = v;
  }
  void set_nan(std::int64_t i, int j) {
    set_special(i, j, std::numeric_limits<float>::quiet_NaN());
  }

  TensorView ckv() {
    return make_strided_view(ckv_buf.data(), dtype, {n, kDimCkv}, {ckv_stride, 1});
  }
  TensorView kpe() {
    return make_strided_view(kpe_buf.data(), dtype, {n, kDimKpe}, {kpe_stride, 1});
  }
  std::span<const float> token(std::int64_t i) const {
    return std::span<const float>(values.data() + i * kDimQk, kDimQk);
  }

 private:
  static void store_u16(std::vector<std::uint8_t>& buf, std::int64_t at, std::uint16_t v) {
    std::memcpy(buf.data() + at * 2, &v, 2);
  }
  void store_nan(std::vector<std::uint8_t>& buf, std::int64_t at) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    if (dtype == DType::f32) std::memcpy(buf.data() + at * 4, &nan, 4);
    if (dtype == DType::bf16) store_u16(buf, at, 0x7fc0);
    if (dtype == DType::f16) store_u16(buf, at, 0x7e00);
  }
  // Stores a random value of magnitude ~mag and returns it exactly as float32.
  float store_random(std::vector<std::uint8_t>& buf, std::int64_t at, float mag,
                     std::mt19937& rng) {
    std::normal_distribution<float> normal(0.0f, mag);
    if (dtype == DType::f32) {
      const float v = normal(rng);
      std::memcpy(buf.data() + at * 4, &v, 4);
      return v;
    }
    if (dtype == DType::bf16) {
      const std::uint16_t b = float_to_bf16(normal(rng));
      store_u16(buf, at, b);
      return bf16_to_float(b);
    }
    // f16 built from its fields, its value computed independently of the library's decoder:
    // normal (1024 + m) * 2^(e - 25), or subnormal m * 2^-24 when e = 0.
    std::uniform_int_distribution<int> exponent(0, 22);
    std::uniform_int_distribution<int> mantissa(0, 1023);
    std::uniform_int_distribution<int> sign(0, 1);
    const int e = exponent(rng);
    const int m = mantissa(rng);
    const int s = sign(rng);
    store_u16(buf, at, static_cast<std::uint16_t>(s << 15 | e << 10 | m));
    const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
    return static_cast<float>(s ? -v : v);
  }
};

std::vector<float> decode_of_encode(KvFormat f, float scale, std::span<const float> x) {
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(token_bytes(f)));
  encode_token(f, scale, x, bytes);
  std::vector<float> y(kDimQk);
  decode_token(f, scale, bytes, y);
  return y;
}

TEST(Cache, BadConfigNamesTheField) {
  const auto arg = [](CacheConfig c) {
    const Error e = error_of([&] { PagedLatentCache cache(c); });
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.argument();
  };
  for (const std::int64_t pages : {0, -1}) {
    EXPECT_EQ(arg(make_config(KvFormat::fp8_e4m3, pages, 1)), "config.num_pages");
  }
  // Slots are int32, so the pool must have < 2^31 slots (and this must fail before allocating).
  EXPECT_EQ(arg(make_config(KvFormat::bf16, std::int64_t{1} << 25, 64)), "config.num_pages");
  for (const int ps : {0, -4, 3, 12, 96, 256, 1024}) {
    EXPECT_EQ(arg(make_config(KvFormat::fp8_e4m3, 4, ps)), "config.page_size") << ps;
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (const float scale : {0.0f, -1.0f, inf, std::numeric_limits<float>::quiet_NaN()}) {
    EXPECT_EQ(arg(make_config(KvFormat::fp8_e4m3, 4, 16, scale)), "config.scale") << scale;
  }
  for (const int ps : {1, 2, 64, 128}) {
    EXPECT_NO_THROW(PagedLatentCache(make_config(KvFormat::fp8_e4m3, 2, ps)));
  }
}

TEST(Cache, NewCacheIsZeroFilledAndAllFree) {
  for (KvFormat f : kFormats) {
    PagedLatentCache cache(make_config(f, 6, 16, 0.5f));
    EXPECT_EQ(cache.free_pages(), 6);
    EXPECT_EQ(cache.capacity_tokens(), 96);
    EXPECT_EQ(cache.config().format, f);
    EXPECT_EQ(cache.config().scale, 0.5f);
    const auto bytes = snapshot(cache);
    EXPECT_EQ(static_cast<std::int64_t>(bytes.size()), 96 * token_bytes(f));
    EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](auto b) { return b == 0; }));
    for (std::int32_t p = 0; p < 6; ++p) EXPECT_FALSE(cache.is_allocated(p));
    EXPECT_FALSE(cache.is_allocated(-1));
    EXPECT_FALSE(cache.is_allocated(6));
  }
}

TEST(Cache, AllocateHandsOutLowestIdsFirst) {
  PagedLatentCache cache(make_config(KvFormat::fp8_e4m3, 8, 4));
  EXPECT_EQ(cache.allocate(3), (std::vector<std::int32_t>{0, 1, 2}));
  EXPECT_EQ(cache.allocate(0), std::vector<std::int32_t>{});
  EXPECT_EQ(cache.free_pages(), 5);
  const std::vector<std::int32_t> back = {2, 0};
  cache.release(back);
  EXPECT_FALSE(cache.is_allocated(0));
  EXPECT_TRUE(cache.is_allocated(1));
  EXPECT_EQ(cache.allocate(4), (std::vector<std::int32_t>{0, 2, 3, 4}));
  EXPECT_EQ(cache.free_pages(), 3);
  const Error e = error_of([&] { cache.allocate(-1); });
  EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
  EXPECT_EQ(e.argument(), "n");
}

TEST(Cache, ExhaustionTakesNothingAndKeepsData) {
  std::mt19937 rng(21);
  PagedLatentCache cache(make_config(KvFormat::fp8_e4m3_block, 4, 2));
  const auto pages = cache.allocate(3);
  Rows rows(DType::f32, 6, rng);
  std::vector<std::int32_t> slots(6);
  std::iota(slots.begin(), slots.end(), 0);  // pages 0..2, both offsets
  cache.append(make_view(slots.data(), DType::i32, {6}), rows.ckv(), rows.kpe());
  const auto before = snapshot(cache);

  const Error e = error_of([&] { cache.allocate(2); });
  EXPECT_EQ(e.code(), ErrorCode::out_of_memory) << e.what();
  EXPECT_EQ(cache.free_pages(), 1);
  for (std::int32_t p : pages) EXPECT_TRUE(cache.is_allocated(p));
  EXPECT_FALSE(cache.is_allocated(3));
  EXPECT_EQ(snapshot(cache), before);
  // The one free page is still available afterwards.
  EXPECT_EQ(cache.allocate(1), std::vector<std::int32_t>{3});
  EXPECT_EQ(error_of([&] { cache.allocate(1); }).code(), ErrorCode::out_of_memory);
}

TEST(Cache, ReleaseIsAllOrNothing) {
  PagedLatentCache cache(make_config(KvFormat::bf16, 8, 1));
  cache.allocate(5);  // pages 0..4
  const std::vector<std::int32_t> first = {4};
  cache.release(first);
  struct Case {
    std::vector<std::int32_t> ids;
    std::string argument;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{0, 1, 4}, "pages[2]", "not allocated"},   // double release
      {{0, 5}, "pages[1]", "not allocated"},      // never allocated
      {{1, -1}, "pages[1]", "outside the pool"},  // foreign ids
      {{2, 8}, "pages[1]", "outside the pool"},
      {{0, 1, 2, 1}, "pages[3]", "more than once"},  // repeated
      {{3, 3}, "pages[1]", "more than once"},
  };
  for (const Case& c : cases) {
    const Error e = error_of([&] { cache.release(c.ids); });
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), c.argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
    // Nothing was released, not even the valid ids listed before the bad one.
    EXPECT_EQ(cache.free_pages(), 4);
    for (std::int32_t p = 0; p < 4; ++p) EXPECT_TRUE(cache.is_allocated(p)) << p;
  }
  const std::vector<std::int32_t> all = {3, 1, 0, 2};
  cache.release(all);
  EXPECT_EQ(cache.free_pages(), 8);
}

TEST(Cache, AppendQuantizesAtTheGivenSlots) {
  std::mt19937 rng(22);
  for (KvFormat f : kFormats) {
    for (DType dtype : kInputDtypes) {
      for (const int ps : {1, 16, 64}) {
        const float scale = f == KvFormat::fp8_e4m3 ? 0.0625f : 1.0f;
        PagedLatentCache cache(make_config(f, 8, ps, scale));
        cache.allocate(5);
        const std::vector<std::int32_t> hole = {1};
        cache.release(hole);
        // Every slot on the allocated pages 0, 2, 3, 4, in random order; write some of them.
        std::vector<std::int32_t> all;
        for (std::int32_t p : {0, 2, 3, 4}) {
          for (int o = 0; o < ps; ++o) all.push_back(p * ps + o);
        }
        std::shuffle(all.begin(), all.end(), rng);
        const auto n = static_cast<std::int64_t>(std::min<std::size_t>(all.size(), 37));
        std::vector<std::int32_t> slots(all.begin(), all.begin() + n);
        Rows rows(dtype, n, rng);
        cache.append(make_view(slots.data(), DType::i32, {n}), rows.ckv(), rows.kpe(),
                     NanPolicy::error);
        std::vector<float> got(kDimQk);
        std::vector<bool> written(static_cast<std::size_t>(cache.capacity_tokens()), false);
        for (std::int64_t i = 0; i < n; ++i) {
          written[static_cast<std::size_t>(slots[i])] = true;
          cache.read_token(slots[i], got);
          const auto want = decode_of_encode(f, scale, rows.token(i));
          for (int j = 0; j < kDimQk; ++j) {
            ASSERT_TRUE(same_value(got[j], want[j]))
                << format_name(f) << " " << dtype_name(dtype) << " ps=" << ps << " token " << i
                << " [" << j << "]: " << got[j] << " vs " << want[j];
          }
        }
        // Slots not written keep their zero bytes.
        const auto bytes = snapshot(cache);
        const auto tb = static_cast<std::size_t>(token_bytes(f));
        for (std::size_t s = 0; s < written.size(); ++s) {
          if (written[s]) continue;
          ASSERT_TRUE(std::all_of(bytes.begin() + s * tb, bytes.begin() + (s + 1) * tb,
                                  [](auto b) { return b == 0; }))
              << "slot " << s << " was written";
        }
      }
    }
  }
}

TEST(Cache, AppendRejectsBadSlotsAndWritesNothing) {
  std::mt19937 rng(23);
  PagedLatentCache cache(make_config(KvFormat::fp8_e4m3, 4, 8));
  cache.allocate(3);
  const std::vector<std::int32_t> hole = {1};
  cache.release(hole);  // page 1 (slots 8..15) is free again
  struct Case {
    std::vector<std::int32_t> slots;
    std::string argument;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{0, 3, 9}, "slots[2]", "not allocated"},   // the valid slots before it are not written
      {{30, 2}, "slots[0]", "not allocated"},     // page 3 was never allocated
      {{1, 32}, "slots[1]", "outside the pool"},  // capacity
      {{-1}, "slots[0]", "outside the pool"},
      {{4, 5, std::numeric_limits<std::int32_t>::max()}, "slots[2]", "outside the pool"},
  };
  for (const Case& c : cases) {
    const auto n = static_cast<std::int64_t>(c.slots.size());
    Rows rows(DType::f32, n, rng);
    const auto before = snapshot(cache);
    const Error e = error_of([&] {
      cache.append(make_view(const_cast<std::int32_t*>(c.slots.data()), DType::i32, {n}),
                   rows.ckv(), rows.kpe());
    });
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), c.argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what();
    EXPECT_EQ(snapshot(cache), before) << "bytes written despite " << e.what();
  }
}

TEST(Cache, AppendNanPolicy) {
  std::mt19937 rng(24);
  for (DType dtype : kInputDtypes) {
    PagedLatentCache cache(make_config(KvFormat::fp8_e4m3_block, 2, 4));
    cache.allocate(2);
    std::vector<std::int32_t> slots = {5, 0, 7};
    const TensorView sv = make_view(slots.data(), DType::i32, {3});
    Rows rows(dtype, 3, rng);
    rows.set_nan(2, 7);
    const auto before = snapshot(cache);
    Error e = error_of([&] { cache.append(sv, rows.ckv(), rows.kpe(), NanPolicy::error); });
    EXPECT_EQ(e.argument(), "ckv[2, 7]") << e.what();
    EXPECT_EQ(snapshot(cache), before);

    Rows rope(dtype, 3, rng);
    rope.set_nan(1, kDimCkv + 3);
    e = error_of([&] { cache.append(sv, rope.ckv(), rope.kpe(), NanPolicy::error); });
    EXPECT_EQ(e.argument(), "kpe[1, 3]") << e.what();
    EXPECT_EQ(snapshot(cache), before);

    // propagate stores the NaN: it reads back as NaN there and only there.
    cache.append(sv, rows.ckv(), rows.kpe(), NanPolicy::propagate);
    std::vector<float> got(kDimQk);
    cache.read_token(7, got);
    for (int j = 0; j < kDimQk; ++j)
      EXPECT_EQ(std::isnan(got[j]), j == 7) << dtype_name(dtype) << j;
  }
}

TEST(Cache, AppendChecksTensors) {
  std::mt19937 rng(25);
  PagedLatentCache cache(make_config(KvFormat::bf16, 2, 4));
  cache.allocate(2);
  std::vector<std::int32_t> slots = {0, 1};
  Rows rows(DType::f32, 2, rng);
  Rows bf(DType::bf16, 2, rng);
  const TensorView sv = make_view(slots.data(), DType::i32, {2});
  const auto arg = [&](const TensorView& s, const TensorView& c, const TensorView& k) {
    return error_of([&] { cache.append(s, c, k); }).argument();
  };
  EXPECT_EQ(arg(make_view(slots.data(), DType::f32, {2}), rows.ckv(), rows.kpe()), "slots.dtype");
  EXPECT_EQ(arg(make_view(slots.data(), DType::i32, {2, 1}), rows.ckv(), rows.kpe()), "slots.ndim");
  EXPECT_EQ(arg(sv, TensorView{}, rows.kpe()), "ckv");
  EXPECT_EQ(
      arg(sv, make_strided_view(rows.ckv_buf.data(), DType::f32, {2, 511}, {536, 1}), rows.kpe()),
      "ckv.shape[1]");
  EXPECT_EQ(
      arg(sv, make_strided_view(rows.ckv_buf.data(), DType::f32, {1, 512}, {536, 1}), rows.kpe()),
      "ckv.shape[0]");
  EXPECT_EQ(
      arg(sv, make_strided_view(rows.ckv_buf.data(), DType::u8, {2, 512}, {536, 1}), rows.kpe()),
      "ckv.dtype");
  EXPECT_EQ(arg(sv, rows.ckv(), bf.kpe()), "kpe.dtype");  // ckv and kpe must share a dtype
  EXPECT_EQ(
      arg(sv, rows.ckv(), make_strided_view(rows.kpe_buf.data(), DType::f32, {2, 64}, {72, 2})),
      "kpe.stride[1]");
  TensorView on_gpu = rows.ckv();
  on_gpu.device = DeviceKind::cuda;
  EXPECT_EQ(arg(sv, on_gpu, rows.kpe()), "ckv.device");
  EXPECT_EQ(cache.free_pages(), 0);
  const auto bytes = snapshot(cache);
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](auto b) { return b == 0; }));
}

TEST(Cache, ViewShapesAndStrides) {
  std::mt19937 rng(26);
  for (KvFormat f : kFormats) {
    for (const int ps : {1, 64, 128}) {
      const float scale = 0.25f;
      PagedLatentCache cache(make_config(f, 3, ps, scale));
      const std::int64_t tb = token_bytes(f);
      const TensorView s = cache.storage();
      EXPECT_EQ(s.dtype, DType::u8);
      EXPECT_EQ(s.ndim, 3);
      EXPECT_EQ(s.shape, (std::array<std::int64_t, 4>{3, ps, tb, 0}));
      EXPECT_EQ(s.stride, (std::array<std::int64_t, 4>{ps * tb, tb, 1, 0}));
      EXPECT_TRUE(s.is_contiguous());
      EXPECT_EQ(s.device, DeviceKind::cpu);

      const KvCacheView v = cache.view();
      EXPECT_EQ(v.format, f);
      EXPECT_EQ(v.ckv_scale, scale);
      EXPECT_EQ(v.kpe_scale, scale);
      EXPECT_EQ(v.ckv.data, s.data);
      const auto* base = s.as<const std::uint8_t>();
      if (f == KvFormat::fp8_e4m3_block) {
        EXPECT_EQ(v.ckv.dtype, DType::u8);
        EXPECT_EQ(v.ckv.shape, s.shape);
        EXPECT_EQ(v.ckv.stride, s.stride);
        EXPECT_FALSE(v.kpe.defined());
      } else {
        const DType want = f == KvFormat::bf16 ? DType::bf16 : DType::fp8_e4m3;
        // Strides count elements of the view's dtype: a token is 576 of them in both formats.
        for (const TensorView* t : {&v.ckv, &v.kpe}) {
          EXPECT_EQ(t->dtype, want);
          EXPECT_EQ(t->ndim, 3);
          EXPECT_EQ(t->stride, (std::array<std::int64_t, 4>{ps * 576, 576, 1, 0}));
        }
        EXPECT_EQ(v.ckv.shape, (std::array<std::int64_t, 4>{3, ps, 512, 0}));
        EXPECT_EQ(v.kpe.shape, (std::array<std::int64_t, 4>{3, ps, 64, 0}));
        EXPECT_EQ(static_cast<const std::uint8_t*>(v.kpe.data) - base,
                  512 * static_cast<std::int64_t>(dtype_size(want)));
        EXPECT_FALSE(v.ckv.is_contiguous());
      }

      // Element (page, offset, j) read through the view is byte j of the encoded token.
      cache.allocate(3);
      std::int32_t slot = 2 * ps + ps / 2;
      Rows rows(DType::f32, 1, rng);
      cache.append(make_view(&slot, DType::i32, {1}), rows.ckv(), rows.kpe());
      std::vector<std::uint8_t> enc(static_cast<std::size_t>(tb));
      encode_token(f, scale, rows.token(0), enc);
      const std::int64_t page = slot / ps, offset = slot % ps;
      const std::int64_t e = page * v.ckv.stride[0] + offset * v.ckv.stride[1];
      if (f == KvFormat::bf16) {
        for (int j = 0; j < kDimCkv; ++j) {
          ASSERT_EQ(std::memcmp(v.ckv.as<const std::uint16_t>() + e + j, &enc[2 * j], 2), 0) << j;
        }
        for (int j = 0; j < kDimKpe; ++j) {
          ASSERT_EQ(std::memcmp(v.kpe.as<const std::uint16_t>() + e + j, &enc[2 * (512 + j)], 2),
                    0);
        }
      } else {
        const auto width = f == KvFormat::fp8_e4m3 ? kDimCkv : tb;
        for (std::int64_t j = 0; j < width; ++j) {
          ASSERT_EQ(v.ckv.as<const std::uint8_t>()[e + j], enc[j]) << j;
        }
        if (f == KvFormat::fp8_e4m3) {
          for (int j = 0; j < kDimKpe; ++j)
            ASSERT_EQ(v.kpe.as<const std::uint8_t>()[e + j], enc[512 + j]);
        }
      }
    }
  }
}

TEST(Cache, ReadTokenErrors) {
  PagedLatentCache cache(make_config(KvFormat::fp8_e4m3, 2, 4));
  std::vector<float> out(kDimQk), short_out(kDimQk - 1);
  EXPECT_EQ(error_of([&] { cache.read_token(-1, out); }).argument(), "slot");
  EXPECT_EQ(error_of([&] { cache.read_token(8, out); }).argument(), "slot");
  EXPECT_EQ(error_of([&] { cache.read_token(0, short_out); }).argument(), "out");
  EXPECT_NO_THROW(cache.read_token(7, out));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 0.0f; }));
}

TEST(Cache, MoveKeepsStorageAndPages) {
  std::mt19937 rng(27);
  PagedLatentCache a(make_config(KvFormat::bf16, 4, 2));
  a.allocate(2);
  std::int32_t slot = 3;
  Rows rows(DType::f32, 1, rng);
  a.append(make_view(&slot, DType::i32, {1}), rows.ckv(), rows.kpe());
  const void* data = a.storage().data;
  PagedLatentCache b(std::move(a));
  EXPECT_EQ(b.storage().data, data);
  EXPECT_EQ(b.free_pages(), 2);
  std::vector<float> got(kDimQk);
  b.read_token(3, got);
  const auto want = decode_of_encode(KvFormat::bf16, 1.0f, rows.token(0));
  for (int j = 0; j < kDimQk; ++j) ASSERT_TRUE(same_value(got[j], want[j])) << j;
}

TEST(Cache, CudaConfigWithoutCudaIsUnsupported) {
  if (detail::cuda_built()) GTEST_SKIP() << "built with CUDA";
  CacheConfig c = make_config(KvFormat::fp8_e4m3, 2, 4);
  c.device = DeviceKind::cuda;
  EXPECT_EQ(error_of([&] { PagedLatentCache cache(c); }).code(), ErrorCode::unsupported);
}

// The device append must produce the bytes the host encoder does.
TEST(Cache, CudaCacheMatchesHostEncoder) {
  if (detail::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  std::mt19937 rng(28);
  // Frees device buffers even when an assertion returns early.
  struct DeviceBuffer {
    void* ptr;
    explicit DeviceBuffer(std::size_t bytes) : ptr(detail::cuda_malloc(bytes, 0)) {}
    ~DeviceBuffer() { detail::cuda_free(ptr); }
  };
  for (KvFormat f : kFormats) {
    for (DType dtype : kInputDtypes) {
      const float scale = f == KvFormat::fp8_e4m3 ? 0.125f : 1.0f;
      CacheConfig c = make_config(f, 4, 64, scale);
      c.device = DeviceKind::cuda;
      PagedLatentCache cache(c);
      EXPECT_EQ(cache.storage().device, DeviceKind::cuda);
      cache.allocate(3);
      const std::int64_t n = 50;
      std::vector<std::int32_t> slots(n);
      for (std::int64_t i = 0; i < n; ++i) slots[i] = static_cast<std::int32_t>(3 * i + 7);
      Rows rows(dtype, n, rng);
      // Special values must come out bit-identical too: NaN in ckv and kpe, +-inf (which, in
      // the block format, sets its group's scale to 2^127).
      const float inf = std::numeric_limits<float>::infinity();
      rows.set_nan(3, 10);
      rows.set_nan(4, kDimCkv + 5);
      rows.set_special(5, 300, inf);
      rows.set_special(6, kDimCkv + 1, -inf);
      DeviceBuffer d_slots(slots.size() * 4), d_ckv(rows.ckv_buf.size()),
          d_kpe(rows.kpe_buf.size());
      detail::cuda_copy_to_device(d_slots.ptr, slots.data(), slots.size() * 4);
      detail::cuda_copy_to_device(d_ckv.ptr, rows.ckv_buf.data(), rows.ckv_buf.size());
      detail::cuda_copy_to_device(d_kpe.ptr, rows.kpe_buf.data(), rows.kpe_buf.size());
      const auto on_gpu = [](TensorView t, void* p) {
        t.data = p;
        t.device = DeviceKind::cuda;
        t.device_id = 0;
        return t;
      };
      cache.append(on_gpu(make_view(slots.data(), DType::i32, {n}), d_slots.ptr),
                   on_gpu(rows.ckv(), d_ckv.ptr), on_gpu(rows.kpe(), d_kpe.ptr));
      detail::cuda_synchronize(0);
      std::vector<float> got(kDimQk);
      for (std::int64_t i = 0; i < n; ++i) {
        cache.read_token(slots[i], got);
        const auto want = decode_of_encode(f, scale, rows.token(i));
        for (int j = 0; j < kDimQk; ++j) {
          ASSERT_TRUE(same_value(got[j], want[j]))
              << format_name(f) << " " << dtype_name(dtype) << " token " << i << " [" << j
              << "]: " << got[j] << " vs " << want[j];
        }
      }
    }
  }
}

}  // namespace
}  // namespace fp8mla
