// fill_page_table (include/fp8mla/page_table.h): checks, the host fill, and the CUDA dispatch.
#include "fp8mla/page_table.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "fp8mla/error.h"
#include "fp8mla/attention.h"
#include "src/core/backend.h"
#include "src/core/check.h"

namespace fp8mla {

namespace {

// The host fill, a plain loop: request r's pages at kv_indptr[r] + k.
template <class Row>
void fill_host(const TensorView& tokens, const Row* rows, std::span<const std::int32_t> pages,
               int page_size, std::int32_t* table) {
  const auto* t = tokens.as<const std::int32_t>();
  const std::int64_t n_rows = tokens.shape[0];
  for (std::size_t r = 0; r < pages.size(); ++r) {  // every row checked before any write
    detail::require(rows[r] >= 0 && rows[r] < n_rows, detail::join("rows[", r, "]"), rows[r],
                    " is outside the token table's ", n_rows, " rows");
  }
  std::int64_t at = 0;
  for (std::size_t r = 0; r < pages.size(); ++r) {
    const std::int32_t* src = t + static_cast<std::int64_t>(rows[r]) * tokens.stride[0];
    for (std::int32_t k = 0; k < pages[r]; ++k) {
      table[at++] = src[static_cast<std::int64_t>(k) * page_size] / page_size;
    }
  }
}

}  // namespace

void fill_page_table(const TensorView& tokens, const TensorView& rows,
                     std::span<const std::int32_t> kv_len, int page_size,
                     const TensorView& table, void* stream,
                     std::span<std::int32_t> kv_indptr) try {
  detail::require(page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0,
                  "page_size", page_size, " must be a power of two in [1, ", kMaxPageSize, "]");
  const DeviceKind device = tokens.device;
  const int device_id = tokens.device_id;
  detail::check_tensor(tokens, "tokens", {DType::i32}, {-1, -1}, device, device_id);
  const auto batch = static_cast<std::int64_t>(kv_len.size());
  detail::check_tensor(rows, "rows", {DType::i32, DType::i64}, {batch}, device, device_id);
  detail::check_tensor(table, "table", {DType::i32}, {-1}, device, device_id, detail::kOutput);
  detail::require(table.numel() == 0 || table.is_contiguous(), "table",
                  "must be contiguous, got ", table.describe());
  detail::require(batch == 0 || rows.is_contiguous(), "rows", "must be contiguous, got ",
                  rows.describe());
  detail::require(kv_indptr.empty() || std::ssize(kv_indptr) == batch + 1, "kv_indptr.size()",
                  kv_indptr.size(), " must be 0 (not wanted) or the batch's ", batch, " + 1");
  const std::int64_t width = tokens.shape[1];
  std::vector<std::int32_t> pages(kv_len.size());
  // The last page's first token must be a column of the row.
  const std::int64_t limit = (width + page_size - 1) / page_size * page_size;
  std::int64_t total = 0;
  for (std::size_t r = 0; r < kv_len.size(); ++r) {
    const std::int64_t len = kv_len[r];
    detail::require(len >= 0 && len <= limit, detail::join("kv_len[", r, "]"), len,
                    " must be in [0, ", limit, "]: a request's pages start inside its row of ",
                    width, " tokens");
    pages[r] = static_cast<std::int32_t>((len + page_size - 1) / page_size);
    total += pages[r];
  }
  detail::require(total <= table.shape[0], "table.shape[0]", table.shape[0],
                  " entries hold fewer than the batch's ", total, " pages");
  detail::require(total <= std::numeric_limits<std::int32_t>::max(), "kv_len",
                  "the batch's ", total, " pages exceed an int32 page table's 2^31 - 1 entries");
  if (total > 0 && device == DeviceKind::cuda) {
    const detail::CurrentDeviceGuard keep(true);
    detail::cuda_fill_page_table(tokens, rows, pages, page_size, table, stream);
  } else if (total > 0) {
    auto* out = table.as<std::int32_t>();
    if (rows.dtype == DType::i32) {
      fill_host(tokens, rows.as<const std::int32_t>(), pages, page_size, out);
    } else {
      fill_host(tokens, rows.as<const std::int64_t>(), pages, page_size, out);
    }
  }
  if (!kv_indptr.empty()) {  // last: a refused fill (a row out of range) writes none of it
    kv_indptr[0] = 0;
    for (std::size_t r = 0; r < pages.size(); ++r) kv_indptr[r + 1] = kv_indptr[r] + pages[r];
  }
} catch (...) {
  detail::rethrow_as_error("fill_page_table");
}

}  // namespace fp8mla
