// fill_page_table on a CUDA device: the pages of a batch's token-table rows against a plain loop
// (batches past one launch's 1024 requests too), on a stream; a row outside the token table gets
// pages of -1, which the kernels skip. They GTEST_SKIP when no CUDA device is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "fp8mla/page_table.h"
#include "src/core/backend.h"
#include "tests/common/page_table_cases.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using namespace gputest;  // NOLINT: the GPU test helpers

std::vector<std::int32_t> fill_on_device(test::TokenTableCase& c, int ps, bool wide,
                                         cudaStream_t stream, std::size_t extra = 4) {
  DeviceBuffer tokens(c.tokens);
  std::vector<std::int32_t> rows32(c.rows.begin(), c.rows.end());
  DeviceBuffer rows = wide ? DeviceBuffer(c.rows) : DeviceBuffer(rows32);
  std::vector<std::int32_t> poison(c.want.size() + extra, -7);
  DeviceBuffer table(poison);
  const auto batch = static_cast<std::int64_t>(c.kv_len.size());
  std::vector<std::int32_t> indptr(c.kv_len.size() + 1, -7);
  fill_page_table(
      make_strided_view(tokens.ptr, DType::i32, {c.n_rows, c.width}, {c.stride, 1},
                        DeviceKind::cuda),
      make_view(rows.ptr, wide ? DType::i64 : DType::i32, {batch}, DeviceKind::cuda), c.kv_len, ps,
      make_view(table.ptr, DType::i32, {std::int64_t(poison.size())}, DeviceKind::cuda), stream,
      indptr);
  EXPECT_EQ(indptr, c.want_indptr);  // written on the host before the fill completes
  check_cuda(cudaStreamSynchronize(stream));
  return table.to_host<std::int32_t>();
}

TEST(CudaPageTableFill, WritesTheBatchPagesInOrder) {
  SKIP_WITHOUT_GPU();
  TestStream stream;
  std::vector<std::int32_t> many(2500);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = static_cast<std::int32_t>(1 + i % 300);
  for (int ps : {1, 16, 64}) {
    for (const auto& lens : std::vector<std::vector<std::int32_t>>{
             {5, 0, 17, 1}, {1300, 7, 600}, {32768, 33, 16, 0, 250}, many}) {
      auto c = test::make_token_table(static_cast<std::uint32_t>(ps * 7 + lens.size()), ps, lens);
      for (bool wide : {true, false}) {
        const auto got = fill_on_device(c, ps, wide, stream.s);
        ASSERT_EQ(std::vector<std::int32_t>(got.begin(), got.begin() + c.want.size()), c.want)
            << "page size " << ps << ", " << lens.size() << " requests";
        for (std::size_t i = c.want.size(); i < got.size(); ++i) ASSERT_EQ(got[i], -7);
      }
    }
  }
}

TEST(CudaPageTableFill, ARowOutsideTheTokenTableGetsPagesTheKernelsSkip) {
  SKIP_WITHOUT_GPU();
  TestStream stream;
  auto c = test::make_token_table(11, 16, {40, 20, 33});
  c.rows[1] = c.n_rows + 5;  // the device cannot be checked from the host without a sync
  const auto got = fill_on_device(c, 16, true, stream.s);
  // Request 0: 3 pages, request 1: 2 pages of -1, request 2: 3 pages.
  for (int k = 0; k < 3; ++k) EXPECT_EQ(got[k], c.want[k]);
  EXPECT_EQ(got[3], -1);
  EXPECT_EQ(got[4], -1);
  for (int k = 5; k < 8; ++k) EXPECT_EQ(got[k], c.want[k]);
}

}  // namespace
}  // namespace fp8mla
