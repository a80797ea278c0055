// Fuzz target: fill_page_table (include/fp8mla/page_table.h) with hostile views of the token
// table, the row ids and the output (fuzz/fuzz_tensor.h: ndim, extents, strides, dtypes, devices,
// null data), hostile lengths, page sizes and kv_indptr sizes, each view backed by exactly the
// memory it describes.
//
// Findings: a crash or sanitizer report (a read or write outside a view), an exception other than
// fp8mla::Error, a refused call that wrote the table or kv_indptr, or an accepted one whose table
// or kv_indptr differs from a plain loop over the views (entries past the batch's pages kept).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "fp8mla/error.h"
#include "fp8mla/page_table.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_tensor.h"

namespace {

using fp8mla::DeviceKind;
using fp8mla::DType;
using fp8mla::Error;
using fp8mla::TensorView;
using fp8mla::fuzz::Input;
using fp8mla::fuzz::require;
using fp8mla::fuzz::Tensor;
using fp8mla::fuzz::tensor;

std::int64_t element(const TensorView& t, std::int64_t i, std::int64_t j = 0) {
  const std::int64_t at = i * t.stride[0] + (t.ndim > 1 ? j * t.stride[1] : 0);
  if (t.dtype == DType::i64) return static_cast<const std::int64_t*>(t.data)[at];
  return static_cast<const std::int32_t*>(t.data)[at];
}

// Row ids from the input where the view is the expected dense one (so the fill gets past the row
// check and writes), else the backing bytes as they are.
void set_rows(Input& in, Tensor& rows, std::int64_t n_rows) {
  const TensorView& v = rows.view;
  if (v.data == nullptr || v.device != DeviceKind::cpu || v.ndim != 1 || v.stride[0] != 1 ||
      v.shape[0] > 64 || (v.dtype != DType::i32 && v.dtype != DType::i64))
    return;
  // Ids in [-1, n_rows]: the table's rows and one past each end (n_rows may be a raw field).
  const auto last = static_cast<std::int32_t>(std::clamp<std::int64_t>(n_rows, 0, 1 << 20));
  for (std::int64_t r = 0; r < v.shape[0]; ++r) {
    const std::int32_t id = in.int_in(-1, last);
    if (v.dtype == DType::i64) {
      static_cast<std::int64_t*>(v.data)[r] = id;
    } else {
      static_cast<std::int32_t*>(v.data)[r] = id;
    }
  }
}

std::vector<std::uint8_t> bytes_of(const Tensor& t) {
  const std::int64_t n = fp8mla::fuzz::reach_bytes(t.view);
  if (t.storage == nullptr || n <= 0) return {};
  return {t.storage.get(), t.storage.get() + n};
}

void fuzz_fill(Input& in) {
  const std::int64_t n_rows = in.int64_in(0, 6), width = in.int64_in(0, 300);
  const int page_size = in.int_in(1, 128);
  const bool wide = in.flag();
  const std::vector<std::int32_t> kv_len =
      in.array(9, -1, static_cast<std::int32_t>(width > 0 && width < 300 ? width : 300) + 70);
  const auto batch = static_cast<std::int64_t>(kv_len.size());
  Tensor tokens = tensor(in, DType::i32, {n_rows, width});
  Tensor rows = tensor(in, wide ? DType::i64 : DType::i32, {batch});
  Tensor table = tensor(in, DType::i32, {in.int64_in(0, 4096)});
  std::vector<std::int32_t> kv_indptr(in.size_in(10), -7);
  for (const Tensor* t : {&tokens, &rows, &table})
    if (!t->safe) return;
  // All three on "cuda" in a CUDA build would reach a kernel with host memory: not a caller's
  // call (a caller's device views hold device memory). Mixed devices are still refused.
  if (tokens.view.device == DeviceKind::cuda && rows.view.device == DeviceKind::cuda &&
      table.view.device == DeviceKind::cuda)
    return;
  set_rows(in, rows, n_rows);

  const std::vector<std::uint8_t> table_before = bytes_of(table);
  try {
    fp8mla::fill_page_table(tokens.view, rows.view, kv_len, page_size, table.view, nullptr,
                            kv_indptr);
  } catch (const Error&) {
    // Refused: nothing of the caller's written.
    require(bytes_of(table) == table_before);
    for (const std::int32_t v : kv_indptr) require(v == -7);
    return;
  }
  // Accepted: the pages by a plain loop, the tail of the table kept.
  const TensorView& tk = tokens.view;
  std::int64_t at = 0;
  const auto* out = static_cast<const std::int32_t*>(table.view.data);
  for (std::size_t r = 0; r < kv_len.size(); ++r) {
    const std::int64_t pages = (kv_len[r] + page_size - 1) / page_size;
    if (!kv_indptr.empty()) require(kv_indptr[r] == at && kv_indptr[r + 1] == at + pages);
    const std::int64_t row = element(rows.view, static_cast<std::int64_t>(r));
    for (std::int64_t k = 0; k < pages; ++k, ++at) {
      require(out[at] == static_cast<std::int32_t>(element(tk, row, k * page_size)) / page_size);
    }
  }
  if (!kv_indptr.empty()) require(kv_indptr.back() == at);
  const std::vector<std::uint8_t> after = bytes_of(table);
  const std::size_t written = static_cast<std::size_t>(at) * sizeof(std::int32_t);
  require(after.size() == table_before.size() && written <= after.size());
  if (written < after.size())
    require(std::memcmp(after.data() + written, table_before.data() + written,
                        after.size() - written) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  fuzz_fill(in);
  return 0;
}
