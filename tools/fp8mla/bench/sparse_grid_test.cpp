// `fp8mla bench --sparse`'s grid (sparse_grid.h): the issue's axes, the quick subset, the top-k
// rows a call reads, and the floors, checked against figures worked out by hand.
#include "tools/fp8mla/bench/sparse_grid.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <vector>

#include "fp8mla/error.h"

namespace fp8mla::bench {
namespace {

template <class F>
std::set<int> axis(const std::vector<SparseCase>& cases, F field) {
  std::set<int> v;
  for (const SparseCase& c : cases) v.insert(field(c));
  return v;
}

TEST(SparseGrid, DefaultGridHasTheIssuesAxes) {
  const std::vector<SparseCase> cases = sparse_grid({});
  // k 2048 and 512, heads 8/16/64/128, batch 1/16/64/128, qo 1 and 2, pages 1 and 64, both
  // FP8 formats: every combination once.
  EXPECT_EQ(cases.size(), 2u * 4 * 4 * 2 * 2 * 2);
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.topk; }), (std::set<int>{512, 2048}));
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.heads; }),
            (std::set<int>{8, 16, 64, 128}));
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.batch; }),
            (std::set<int>{1, 16, 64, 128}));
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.qo_len; }), (std::set<int>{1, 2}));
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.page_size; }), (std::set<int>{1, 64}));
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return static_cast<int>(c.format); }),
            (std::set<int>{static_cast<int>(KvFormat::fp8_e4m3_block),
                           static_cast<int>(KvFormat::fp8_e4m3)}));
  std::set<std::vector<int>> distinct;
  for (const SparseCase& c : cases) {
    distinct.insert({c.topk, c.heads, c.batch, c.qo_len, c.page_size, static_cast<int>(c.format)});
  }
  EXPECT_EQ(distinct.size(), cases.size());
  // Format outermost (the pool is filled once a format), the 656-byte one first.
  EXPECT_EQ(cases.front().format, KvFormat::fp8_e4m3_block);
  EXPECT_EQ(cases.back().format, KvFormat::fp8_e4m3);
}

TEST(SparseGrid, QuickIsTheFiveCasesAtBothQoLensAndFormats) {
  SparseGridAxes a;
  a.quick = true;
  const std::vector<SparseCase> cases = sparse_grid(a);
  EXPECT_EQ(cases.size(), 5u * 2 * 2);
  for (const SparseCase& c : cases) EXPECT_EQ(c.page_size, 64);
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.heads; }),
            (std::set<int>{8, 16, 64, 128}));
  EXPECT_EQ(axis(cases, [](const SparseCase& c) { return c.qo_len; }), (std::set<int>{1, 2}));
  // GLM-5 at TP8 (8 heads), top-2048, batch 128: the issue's first target.
  EXPECT_TRUE(std::any_of(cases.begin(), cases.end(), [](const SparseCase& c) {
    return c.topk == 2048 && c.heads == 8 && c.batch == 128;
  }));
}

TEST(SparseGrid, GivenAxesReplaceTheirDefaults) {
  SparseGridAxes a;
  a.quick = true;  // a given axis turns the quick triples into the cross product
  a.topks = {512};
  a.heads = {8};
  a.qo_lens = {2};
  a.formats = {KvFormat::fp8_e4m3};
  const std::vector<SparseCase> cases = sparse_grid(a);
  ASSERT_EQ(cases.size(), 4u);  // the four default batches, quick's one page size
  for (const SparseCase& c : cases) {
    EXPECT_EQ(c.topk, 512);
    EXPECT_EQ(c.heads, 8);
    EXPECT_EQ(c.qo_len, 2);
    EXPECT_EQ(c.page_size, 64);
    EXPECT_EQ(c.format, KvFormat::fp8_e4m3);
  }
  a.quick = false;
  a.page_sizes = {16};
  a.batches = {3, 5};
  EXPECT_EQ(sparse_grid(a).size(), 2u);
}

TEST(SparseGrid, FloorsCountTheListedTokensInTheFormatsBytes) {
  EXPECT_EQ(sparse_invalid_per_row(2048), 102);
  EXPECT_EQ(sparse_valid_per_row(2048), 1946);
  EXPECT_EQ(sparse_valid_per_row(512), 487);
  SparseCase c;
  c.topk = 2048;
  c.heads = 8;
  c.batch = 128;
  c.qo_len = 2;
  c.format = KvFormat::fp8_e4m3_block;
  // 128 requests x 2 query tokens x (2048 - 102) slots x 656 bytes.
  EXPECT_DOUBLE_EQ(sparse_floor_bytes(c), 326803456.0);
  // ... x 8 heads x 2 x (576 + 512) flops.
  EXPECT_DOUBLE_EQ(sparse_flops(c), 256.0 * 1946 * 8 * 2176);
  c.format = KvFormat::fp8_e4m3;
  c.topk = 512;
  c.batch = 1;
  c.qo_len = 1;
  EXPECT_DOUBLE_EQ(sparse_floor_bytes(c), 487.0 * 576);  // 280,512 bytes
  EXPECT_DOUBLE_EQ(sparse_flops(c), 8477696.0);
}

TEST(SparseGrid, RowsAreDistinctSlotsOverThePoolWithKOver20Skipped) {
  const std::int64_t pool = std::int64_t{1} << 20, rows = 6;
  const int k = 2048;
  const std::vector<std::int32_t> idx = draw_sparse_rows(rows, k, pool, 42);
  ASSERT_EQ(idx.size(), static_cast<std::size_t>(rows * k));
  std::set<std::vector<int>> skipped_positions;
  double sum = 0, n = 0;
  std::int32_t hi = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<std::int32_t> valid;
    std::vector<int> skipped;
    for (int j = 0; j < k; ++j) {
      const std::int32_t s = idx[static_cast<std::size_t>(r * k + j)];
      if (s == -1) {
        skipped.push_back(j);
        continue;
      }
      ASSERT_GE(s, 0);
      ASSERT_LT(s, pool);
      valid.push_back(s);
      sum += s;
      n += 1;
      hi = std::max(hi, s);
    }
    EXPECT_EQ(skipped.size(), 102u) << "row " << r;
    std::sort(valid.begin(), valid.end());
    EXPECT_EQ(std::adjacent_find(valid.begin(), valid.end()), valid.end()) << "row " << r;
    skipped_positions.insert(skipped);
  }
  EXPECT_EQ(skipped_positions.size(), static_cast<std::size_t>(rows));  // placed anew a row
  // Uniform over the whole pool: the mean near the middle, the largest near the end.
  EXPECT_NEAR(sum / n / static_cast<double>(pool), 0.5, 0.02);
  EXPECT_GT(hi, pool * 99 / 100);
  // The same seed draws the same rows; another seed, others.
  EXPECT_EQ(draw_sparse_rows(rows, k, pool, 42), idx);
  EXPECT_NE(draw_sparse_rows(rows, k, pool, 43), idx);
}

TEST(SparseGrid, PoolsOutsideInt32SlotsOrSmallerThanKAreRefused) {
  try {
    (void)draw_sparse_rows(1, 2048, 1000, 1);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "pool_tokens");
    EXPECT_NE(std::string(e.what()).find("1000 tokens"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)draw_sparse_rows(1, 16, std::int64_t{1} << 31, 1), Error);
  // Every slot of a pool exactly k long: a permutation less the skipped ones.
  const std::vector<std::int32_t> all = draw_sparse_rows(1, 40, 40, 5);
  std::set<std::int32_t> s(all.begin(), all.end());
  EXPECT_EQ(std::count(all.begin(), all.end(), -1), 2);
  EXPECT_EQ(s.size(), 39u);  // 38 distinct slots and -1
}

}  // namespace
}  // namespace fp8mla::bench
