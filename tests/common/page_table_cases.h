// A token table as engines keep one (SGLang's req_to_token: each row the pool slots of a request's
// tokens, a page's tokens together, pages shuffled) and the page table fill_page_table must write
// for a batch of its rows, by a plain loop. Shared by the CPU and GPU suites.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace fp8mla::test {

struct TokenTableCase {
  std::int64_t n_rows = 0, width = 0, stride = 0;  // stride >= width: rows may be padded
  std::vector<std::int32_t> tokens;                // [n_rows, stride]
  std::vector<std::int64_t> rows;                  // the batch's rows
  std::vector<std::int32_t> kv_len;
  std::vector<std::int32_t> want;        // the CSR page ids
  std::vector<std::int32_t> want_indptr;  // [0, running sum of the requests' pages]
};

inline TokenTableCase make_token_table(std::uint32_t seed, int page_size,
                                       const std::vector<std::int32_t>& kv_len,
                                       std::int64_t pad = 3) {
  std::mt19937 gen(seed);
  TokenTableCase c;
  c.kv_len = kv_len;
  const std::int64_t longest = kv_len.empty() ? 0 : *std::max_element(kv_len.begin(), kv_len.end());
  c.width = std::max<std::int64_t>(longest, 1);
  c.stride = c.width + pad;
  c.n_rows = static_cast<std::int64_t>(kv_len.size()) + 2;
  const std::int64_t row_pages = (c.stride + page_size - 1) / page_size;
  std::vector<std::int32_t> pages(static_cast<std::size_t>(c.n_rows * row_pages));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), gen);
  c.tokens.resize(static_cast<std::size_t>(c.n_rows * c.stride));
  for (std::int64_t i = 0; i < c.n_rows * c.stride; ++i) {
    const std::int64_t row = i / c.stride, col = i % c.stride;
    c.tokens[static_cast<std::size_t>(i)] =
        pages[static_cast<std::size_t>(row * row_pages + col / page_size)] * page_size +
        static_cast<std::int32_t>(col % page_size);
  }
  std::vector<std::int64_t> order(static_cast<std::size_t>(c.n_rows));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), gen);
  c.rows.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kv_len.size()));
  c.want_indptr.push_back(0);
  for (std::size_t r = 0; r < kv_len.size(); ++r) {
    const std::int32_t pages_r = (kv_len[r] + page_size - 1) / page_size;
    c.want_indptr.push_back(c.want_indptr.back() + pages_r);
    for (std::int32_t k = 0; k < pages_r; ++k) {
      c.want.push_back(c.tokens[static_cast<std::size_t>(c.rows[r] * c.stride + k * page_size)] /
                       page_size);
    }
  }
  return c;
}

}  // namespace fp8mla::test
