// fill_page_table's device fill (include/fp8mla/page_table.h): one CTA a request, its start and
// page count passed in the launch's parameters (no upload, no device prefix sum), so a call is
// one launch (one a chunk of kChunk requests).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>

#include "src/core/backend.h"
#include "src/cuda/cuda_check.h"

namespace fp8mla::detail {

namespace page_table {

constexpr int kChunk = 1024;  // requests a launch: 8 KB of parameters (sm_70+: up to 32 KB)
constexpr int kThreads = 128;

struct Chunk {
  std::int32_t start[kChunk];  // the request's first entry of the table
  std::int32_t pages[kChunk];
};

template <class Row>
__global__ void __launch_bounds__(kThreads)
    fill_kernel(const Chunk chunk, const std::int32_t* tokens, std::int64_t token_stride,
                std::int64_t n_rows, const Row* rows, int page_size, std::int32_t* table) {
  const int r = blockIdx.x;
  const std::int64_t row = rows[r];
  const std::int32_t pages = chunk.pages[r];
  std::int32_t* out = table + chunk.start[r];
  if (row < 0 || row >= n_rows) {  // outside the token table: pages the kernels skip
    for (std::int32_t k = threadIdx.x; k < pages; k += kThreads) out[k] = -1;
    return;
  }
  const std::int32_t* src = tokens + row * token_stride;
  for (std::int32_t k = threadIdx.x; k < pages; k += kThreads) {
    out[k] = src[static_cast<std::int64_t>(k) * page_size] / page_size;
  }
}

}  // namespace page_table

void cuda_fill_page_table(const TensorView& tokens, const TensorView& rows,
                          std::span<const std::int32_t> pages, int page_size,
                          const TensorView& table, void* stream) {
  using page_table::Chunk;
  using page_table::kChunk;
  FP8MLA_CUDA_CHECK(cudaSetDevice(tokens.device_id));
  const auto s = static_cast<cudaStream_t>(stream);
  auto* out = table.as<std::int32_t>();
  std::int32_t start = 0;
  for (std::size_t first = 0; first < pages.size(); first += kChunk) {
    const std::size_t n = std::min<std::size_t>(kChunk, pages.size() - first);
    Chunk chunk{};
    for (std::size_t i = 0; i < n; ++i) {
      chunk.start[i] = start;
      chunk.pages[i] = pages[first + i];
      start += pages[first + i];
    }
    const auto launch = [&](const auto* r) {
      page_table::fill_kernel<<<static_cast<unsigned>(n), page_table::kThreads, 0, s>>>(
          chunk, tokens.as<const std::int32_t>(), tokens.stride[0], tokens.shape[0], r + first,
          page_size, out);
      FP8MLA_CUDA_CHECK_LAUNCH("page_table::fill_kernel");
    };
    if (rows.dtype == DType::i32) {
      launch(rows.as<const std::int32_t>());
    } else {
      launch(rows.as<const std::int64_t>());
    }
  }
}

}  // namespace fp8mla::detail
