// fill_page_table on the host: the pages of a batch's token-table rows against a plain loop, and
// every bad argument refused by name before anything is written.
#include "fp8mla/page_table.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "fp8mla/error.h"
#include "tests/common/expect_error.h"
#include "tests/common/page_table_cases.h"

namespace fp8mla {
namespace {

using test::expect_error;
using test::make_token_table;

TensorView tokens_view(test::TokenTableCase& c) {
  return make_strided_view(c.tokens.data(), DType::i32, {c.n_rows, c.width}, {c.stride, 1});
}

TEST(PageTableFill, WritesTheBatchPagesInOrder) {
  for (int ps : {1, 16, 64}) {
    for (const auto& lens : std::vector<std::vector<std::int32_t>>{
             {5, 0, 17, 1}, {1300, 7, 600}, {33, 16, 0, 1, 250, 47, 9}, {4096, 65, 63, 1}}) {
      auto c = make_token_table(static_cast<std::uint32_t>(ps + lens.size()), ps, lens);
      std::vector<std::int32_t> table(c.want.size() + 4, -7);  // poisoned, with a tail
      std::vector<std::int32_t> rows32(c.rows.begin(), c.rows.end());
      for (bool wide : {true, false}) {
        std::fill(table.begin(), table.end(), -7);
        std::vector<std::int32_t> indptr(lens.size() + 1, -7);
        const TensorView rows = wide ? make_view(c.rows.data(), DType::i64, {std::int64_t(lens.size())})
                                     : make_view(rows32.data(), DType::i32, {std::int64_t(lens.size())});
        const TensorView out = make_view(table.data(), DType::i32, {std::int64_t(table.size())});
        if (wide) {
          fill_page_table(tokens_view(c), rows, c.kv_len, ps, out, nullptr, indptr);
          EXPECT_EQ(indptr, c.want_indptr) << "page size " << ps;
        } else {
          fill_page_table(tokens_view(c), rows, c.kv_len, ps, out);  // kv_indptr not wanted
        }
        EXPECT_EQ(std::vector<std::int32_t>(table.begin(), table.begin() + c.want.size()), c.want)
            << "page size " << ps;
        for (std::size_t i = c.want.size(); i < table.size(); ++i) EXPECT_EQ(table[i], -7);
      }
    }
  }
}

TEST(PageTableFill, BadArgumentsAreRefusedByNameBeforeAnyWrite) {
  auto c = make_token_table(7, 16, {40, 20});
  std::vector<std::int32_t> table(8, -7);
  const TensorView out = make_view(table.data(), DType::i32, {8});
  const TensorView rows = make_view(c.rows.data(), DType::i64, {2});
  const TensorView tokens = tokens_view(c);
  expect_error([&] { fill_page_table(tokens, rows, c.kv_len, 24, out); }, {"page_size", "24"});
  expect_error([&] { fill_page_table(tokens, rows, c.kv_len, 256, out); }, {"page_size", "256"});
  std::vector<float> f(c.tokens.size());
  expect_error([&] {
    fill_page_table(make_view(f.data(), DType::f32, {c.n_rows, c.stride}), rows, c.kv_len, 16, out);
  }, {"tokens"});
  expect_error([&] { fill_page_table(tokens, make_view(c.rows.data(), DType::i64, {1}), c.kv_len, 16, out); },
               {"rows"});
  expect_error([&] {
    fill_page_table(tokens, rows, c.kv_len, 16, make_view(table.data(), DType::i32, {4}));
  }, {"table.shape[0]", "4", "5 pages"});
  std::vector<std::int32_t> bad_len{40, -1};
  expect_error([&] { fill_page_table(tokens, rows, bad_len, 16, out); }, {"kv_len[1]", "-1"});
  std::vector<std::int32_t> long_len{49, 1};  // the row holds 40 tokens: 3 pages of 16 at most
  expect_error([&] { fill_page_table(tokens, rows, long_len, 16, out); }, {"kv_len[0]", "49", "48"});
  std::vector<std::int64_t> far{0, c.n_rows};
  std::vector<std::int32_t> indptr(3, -7);
  expect_error([&] {
    fill_page_table(tokens, make_view(far.data(), DType::i64, {2}), c.kv_len, 16, out, nullptr, indptr);
  }, {"rows[1]", "outside"});
  expect_error([&] {
    fill_page_table(tokens, rows, c.kv_len, 16, out, nullptr, std::span(indptr).first(2));
  }, {"kv_indptr.size()", "2", "batch's 2 + 1"});
  for (std::int32_t v : table) EXPECT_EQ(v, -7);
  for (std::int32_t v : indptr) EXPECT_EQ(v, -7);
}

TEST(PageTableFill, MorePagesThanAnInt32TableHoldsAreRefused) {
  // Views only: the check comes before anything is read or written.
  std::int32_t cell = 0;
  const std::int64_t wide = std::int64_t{1} << 31;
  const TensorView tokens = make_strided_view(&cell, DType::i32, {1, wide}, {wide, 1});
  std::vector<std::int64_t> rows{0, 0};
  std::vector<std::int32_t> lens{2147483647, 2147483647};
  const TensorView table = make_view(&cell, DType::i32, {std::int64_t{1} << 32});
  expect_error([&] { fill_page_table(tokens, make_view(rows.data(), DType::i64, {2}), lens, 1, table); },
               {"kv_len", "4294967294 pages", "2^31 - 1"});
  EXPECT_EQ(cell, 0);
}

TEST(PageTableFill, AnEmptyBatchWritesNothingButKvIndptr) {
  auto c = make_token_table(3, 1, {});
  std::vector<std::int32_t> table(2, -7), indptr(1, -7);
  fill_page_table(tokens_view(c), make_view(c.rows.data(), DType::i64, {0}), c.kv_len, 1,
                  make_view(table.data(), DType::i32, {2}), nullptr, indptr);
  EXPECT_EQ(table, (std::vector<std::int32_t>{-7, -7}));
  EXPECT_EQ(indptr, std::vector<std::int32_t>{0});
  auto z = make_token_table(4, 16, {0, 0});  // requests with no tokens: no pages, a zero indptr
  std::vector<std::int32_t> zeros(3, -7);
  fill_page_table(tokens_view(z), make_view(z.rows.data(), DType::i64, {2}), z.kv_len, 16,
                  make_view(table.data(), DType::i32, {2}), nullptr, zeros);
  EXPECT_EQ(table, (std::vector<std::int32_t>{-7, -7}));
  EXPECT_EQ(zeros, (std::vector<std::int32_t>{0, 0, 0}));
}

}  // namespace
}  // namespace fp8mla
