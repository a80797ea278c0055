// The CPU strategies against the library's own decode: every token they write must be exactly
// float_to_bf16(read_token(...)), for every format and page size, and bad views must fail with
// an error naming the view.
#include "tools/fp8mla/strategies/strategies.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "fp8mla/cache.h"
#include "fp8mla/error.h"
#include "fp8mla/format.h"

namespace fp8mla::strategies {
namespace {

struct Case {
  KvFormat format;
  int page_size;
};
// Formats x page sizes (1 = SGLang's MLA default, 64 = FlashMLA's, 128 = the largest).
const Case kCases[] = {{KvFormat::fp8_e4m3, 1},       {KvFormat::fp8_e4m3, 64},
                       {KvFormat::fp8_e4m3_block, 1}, {KvFormat::fp8_e4m3_block, 16},
                       {KvFormat::bf16, 1},           {KvFormat::bf16, 128}};

// A bf16 pool laid out as SGLang does: one [pages, page_size, 576] buffer, two strided views.
struct Bf16Pool {
  Bf16Pool(std::int64_t pages, int page_size)
      : data(static_cast<std::size_t>(pages * page_size * kDimQk), 0xffff) {
    view.format = KvFormat::bf16;
    const std::int64_t ps = std::int64_t{page_size} * kDimQk;
    view.ckv =
        make_strided_view(data.data(), DType::bf16, {pages, page_size, kDimCkv}, {ps, kDimQk, 1});
    view.kpe = make_strided_view(data.data() + kDimCkv, DType::bf16, {pages, page_size, kDimKpe},
                                 {ps, kDimQk, 1});
  }
  const std::uint16_t* token(std::int64_t page, int offset, int page_size) const {
    return data.data() + (page * page_size + offset) * kDimQk;
  }
  std::vector<std::uint16_t> data;  // poisoned with NaN
  KvCacheView view;
};

PagedLatentCache filled_cache(const Case& c, std::int64_t pages) {
  CacheConfig config;
  config.num_pages = pages;
  config.page_size = c.page_size;
  config.format = c.format;
  config.scale = c.format == KvFormat::fp8_e4m3 ? 0.37f : 1.0f;  // exercise a non-unit scale
  PagedLatentCache cache(config);
  cache.allocate(pages);
  const std::int64_t n = pages * c.page_size;
  std::mt19937 rng(static_cast<unsigned>(c.page_size) * 31u + static_cast<unsigned>(c.format));
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> ckv(static_cast<std::size_t>(n * kDimCkv)),
      kpe(static_cast<std::size_t>(n * kDimKpe));
  for (float& v : ckv) v = normal(rng);
  for (float& v : kpe) v = normal(rng);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
  std::iota(slots.begin(), slots.end(), 0);
  cache.append(make_view(slots.data(), DType::i32, {n}),
               make_view(ckv.data(), DType::f32, {n, kDimCkv}),
               make_view(kpe.data(), DType::f32, {n, kDimKpe}));
  return cache;
}

void expect_token(const PagedLatentCache& cache, std::int64_t slot, const std::uint16_t* got) {
  std::vector<float> expected(kDimQk);
  cache.read_token(slot, expected);
  for (int i = 0; i < kDimQk; ++i) {
    ASSERT_EQ(got[i], float_to_bf16(expected[static_cast<std::size_t>(i)]))
        << "slot " << slot << " value " << i;
  }
}

TEST(Strategies, CastPoolMatchesReadToken) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(format_name(c.format)) + " page " + std::to_string(c.page_size));
    const std::int64_t pages = 4096 / c.page_size + 3;  // enough tokens to use threads
    const PagedLatentCache cache = filled_cache(c, pages);
    Bf16Pool dst(pages, c.page_size);
    cast_pool_to_bf16(cache.view(), dst.view);
    for (std::int64_t p = 0; p < pages; ++p) {
      for (int t = 0; t < c.page_size; ++t) {
        expect_token(cache, p * c.page_size + t, dst.token(p, t, c.page_size));
      }
    }
  }
}

TEST(Strategies, GatherCastMatchesReadToken) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(std::string(format_name(c.format)) + " page " + std::to_string(c.page_size));
    const std::int64_t pages = 40;
    const PagedLatentCache cache = filled_cache(c, pages);
    const std::vector<std::int32_t> gather = {7, 0, 39, 12, 7};  // repeats are allowed
    Bf16Pool dst(static_cast<std::int64_t>(gather.size()) + 1, c.page_size);
    gather_cast_to_bf16(cache.view(), gather.data(), static_cast<std::int64_t>(gather.size()),
                        dst.view);
    for (std::size_t i = 0; i < gather.size(); ++i) {
      for (int t = 0; t < c.page_size; ++t) {
        expect_token(cache, std::int64_t{gather[i]} * c.page_size + t,
                     dst.token(static_cast<std::int64_t>(i), t, c.page_size));
      }
    }
    // The page after the gathered ones is untouched (still the NaN poison).
    EXPECT_EQ(*dst.token(static_cast<std::int64_t>(gather.size()), 0, c.page_size), 0xffff);
  }
}

template <class Fn>
void expect_error(Fn&& fn, ErrorCode code, const std::string& argument) {
  try {
    fn();
    ADD_FAILURE() << "no error, expected one naming " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_EQ(e.argument(), argument) << e.what();
  }
}

TEST(Strategies, BadViewsNameTheArgument) {
  const Case c{KvFormat::fp8_e4m3, 16};
  const PagedLatentCache cache = filled_cache(c, 8);
  Bf16Pool ok(8, 16);
  Bf16Pool fewer_pages(7, 16);
  Bf16Pool other_page_size(16, 8);
  Bf16Pool small(2, 16);
  KvCacheView not_bf16 = ok.view;
  not_bf16.format = KvFormat::fp8_e4m3;

  expect_error([&] { cast_pool_to_bf16(cache.view(), not_bf16); }, ErrorCode::invalid_argument,
               "dst.format");
  expect_error([&] { cast_pool_to_bf16(cache.view(), fewer_pages.view); },
               ErrorCode::invalid_argument, "dst.ckv.shape[0]");
  expect_error([&] { cast_pool_to_bf16(cache.view(), other_page_size.view); },
               ErrorCode::invalid_argument, "dst.ckv.shape[1]");
  const std::int32_t outside[] = {1, 8};
  expect_error([&] { gather_cast_to_bf16(cache.view(), outside, 2, ok.view); },
               ErrorCode::invalid_argument, "pages[1]");
  const std::int32_t three[] = {0, 1, 2};
  expect_error([&] { gather_cast_to_bf16(cache.view(), three, 3, small.view); },
               ErrorCode::invalid_argument, "dst.ckv.shape[0]");
  expect_error([&] { gather_cast_to_bf16(cache.view(), nullptr, 1, ok.view); },
               ErrorCode::invalid_argument, "pages");
  KvCacheView no_ckv = cache.view();
  no_ckv.ckv = TensorView{};
  expect_error([&] { cast_pool_to_bf16(no_ckv, ok.view); }, ErrorCode::invalid_argument, "src.ckv");
}

#ifndef FP8MLA_WITH_CUDA
TEST(Strategies, DeviceViewsNeedCuda) {
  const Case c{KvFormat::fp8_e4m3, 16};
  const PagedLatentCache cache = filled_cache(c, 4);
  Bf16Pool dst(4, 16);
  KvCacheView src = cache.view();
  for (TensorView* t : {&src.ckv, &src.kpe, &dst.view.ckv, &dst.view.kpe}) {
    t->device = DeviceKind::cuda;
  }
  expect_error([&] { cast_pool_to_bf16(src, dst.view); }, ErrorCode::unsupported, "src.ckv.device");
}
#endif

}  // namespace
}  // namespace fp8mla::strategies
