// GPU tests of sparse top-k decode (DeepSeek sparse attention) over the FP8 formats
// `fp8mla bench --sparse` times: fp8_e4m3_block (FlashMLA's 656-byte tokens) and fp8_e4m3 at 8,
// 16, 64 and 128 heads, one and two query tokens a request (MTP), rows with -1 entries, slots
// listed twice and three times, a row of nothing but -1, and slots past 2^31 bytes into the pool;
// each against the float64 reference on poisoned outputs (check_case: NaN in every output
// element and guards around them, NaN in the pool's unlisted tokens, a second run bit for bit).
// They GTEST_SKIP when no CUDA device is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "src/core/backend.h"
#include "tests/common/test_util.h"
#include "tests/cuda/decode_cases.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using namespace gputest;  // NOLINT: the GPU test helpers

struct SparseGpuCase {
  KvFormat format;
  int heads, qo_len, page_size, topk;
};

// Every (format, heads, query tokens) of the bench's sparse grid; pages of 64 and 1 and k of
// 2048 and 512 spread over them (k 2048 where the reference's cost allows).
std::vector<SparseGpuCase> sparse_cases() {
  std::vector<SparseGpuCase> cases;
  for (const KvFormat f : {BL, F8})
    for (const int heads : {8, 16, 64, 128})
      for (const int qo : {1, 2}) {
        const int page = (heads / 8 + qo) % 2 == 0 ? 64 : 1;
        cases.push_back({f, heads, qo, page, heads <= 16 ? 2048 : 512});
      }
  return cases;
}

test::ProblemSpec sparse_spec(const SparseGpuCase& k, std::uint64_t seed) {
  test::ProblemSpec s;
  s.format = k.format;
  s.num_heads = k.heads;
  s.page_size = k.page_size;
  s.batch = 3;
  s.qo_len_min = s.qo_len_max = k.qo_len;
  // Requests longer than k (every row full but for its -1 entries) and one shorter (rows padded
  // with -1 past the request's tokens).
  s.kv_len_min = k.topk / 2;
  s.kv_len_max = k.topk + k.topk / 2;
  s.topk = k.topk;
  s.invalid_fraction = 0.1;
  s.seed = seed;
  return s;
}

// Slots listed more than once in a row (a top-k list from an indexer that repeats a slot): in
// each row the first valid slot is copied to the middle and last positions; and the first
// row's entries all -1 (a query token that sees nothing: o = 0, lse = -inf).
void add_duplicates_and_an_empty_row(test::RandomCase& c) {
  const int k = c.spec.topk;
  for (int t = 0; t < c.total_q; ++t) {
    std::int32_t* row = c.sparse_indices.data() + static_cast<std::size_t>(t) * k;
    if (t == 0) {
      std::fill(row, row + k, -1);
      continue;
    }
    for (int j = 0; j < k; ++j) {
      if (row[j] >= 0) {
        row[k / 2] = row[j];
        row[k - 1] = row[j];
        break;
      }
    }
  }
}

// The family the dispatch table gives a sparse plan on sm_90 (fast scores, a power-of-two
// ratio): the warp-specialized family for tiles of 17-64 rows (one query token a tile: heads,
// <= 64), fp8_gather for tiles of <= 16.
void expect_sparse_family(const Plan& p, const std::string& what) {
  if (detail::cuda_compute_capability(0) != 90 || family_forced()) return;
  int rows = 0;
  for (const WorkTile& t : p.tiles()) rows = std::max(rows, t.q_count * t.head_count);
  const char* want = rows > 16 ? "wide_rows" : "fp8_gather";
  EXPECT_STREQ(p.kernel_name(), want) << what << ", tiles of up to " << rows << " rows";
}

class CudaSparseGrid : public ::testing::TestWithParam<SparseGpuCase> {};

TEST_P(CudaSparseGrid, MatchesReferenceWithSkippedAndRepeatedSlots) {
  SKIP_WITHOUT_GPU();
  const SparseGpuCase& k = GetParam();
  test::RandomCase c = test::make_case(sparse_spec(k, 700 + static_cast<std::uint64_t>(k.heads)));
  add_duplicates_and_an_empty_row(c);
  const std::string what = test::describe(c.spec) + " (repeated slots, an empty row)";
  expect_sparse_family(plan(c.problem(DeviceKind::cuda)), what);
  check_case(c, what);
}

INSTANTIATE_TEST_SUITE_P(Sparse, CudaSparseGrid, ::testing::ValuesIn(sparse_cases()),
                         [](const ::testing::TestParamInfo<SparseGpuCase>& param_info) {
                           const SparseGpuCase& k = param_info.param;
                           return std::string(format_name(k.format)) + "_h" +
                                  std::to_string(k.heads) + "_qo" + std::to_string(k.qo_len) +
                                  "_ps" + std::to_string(k.page_size) + "_k" +
                                  std::to_string(k.topk);
                         });

// The case's pool copied to the end of a pool of more than 2^31 bytes (the rest NaN codes), its
// page ids and slots moved with it: every byte offset the kernels compute is past 2^31.
TEST(CudaSparseLargePool, SlotsPast2GiBMatchReference) {
  SKIP_WITHOUT_GPU();
  for (const SparseGpuCase& k :
       {SparseGpuCase{BL, 8, 2, 64, 512}, SparseGpuCase{BL, 128, 1, 1, 256},
        SparseGpuCase{F8, 16, 2, 1, 512}, SparseGpuCase{F8, 64, 1, 64, 256}}) {
    test::ProblemSpec s = sparse_spec(k, 900 + static_cast<std::uint64_t>(k.heads));
    s.spare_pages = 0;
    test::RandomCase c = test::make_case(s);
    const std::string what = test::describe(s) + " at the end of a > 2^31-byte pool";
    const std::int64_t tb = token_bytes(k.format), page_bytes = tb * k.page_size;
    const std::int64_t shift = ((std::int64_t{1} << 31) + page_bytes - 1) / page_bytes;
    const std::int64_t pages = shift + c.num_pages;
    ASSERT_EQ(static_cast<std::int64_t>(c.cache.size()), c.num_pages * page_bytes) << what;
    DeviceBuffer pool(static_cast<std::size_t>(pages * page_bytes));
    check_cuda(cudaMemset(pool.ptr, 0xff, pool.bytes));  // e4m3 NaN codes, NaN block scales
    detail::cuda_copy_to_device(static_cast<std::uint8_t*>(pool.ptr) + shift * page_bytes,
                                c.cache.data(), c.cache.size());
    std::vector<std::int32_t> kv_indices = c.kv_indices, sparse = c.sparse_indices;
    for (std::int32_t& p : kv_indices) p += static_cast<std::int32_t>(shift);
    for (std::int32_t& v : sparse)
      if (v >= 0) v += static_cast<std::int32_t>(shift * k.page_size);

    test::HostOutput ref = reference(c);
    Problem p = c.problem(DeviceKind::cuda);
    p.num_pages = pages;
    p.kv_indices = kv_indices;
    p.sparse_indices = sparse;
    const Plan plan_big = plan(p);
    DeviceBuffer q(c.q);
    DeviceOutput d(c, 64);
    RunArgs args = device_args(c, pool, q, d);
    auto* base = static_cast<std::uint8_t*>(pool.ptr);
    const std::int64_t ps = k.page_size;
    if (k.format == BL) {
      args.kv.ckv =
          make_strided_view(base, DType::u8, {pages, ps, tb}, {ps * tb, tb, 1}, DeviceKind::cuda);
    } else {
      args.kv.ckv = make_strided_view(base, DType::fp8_e4m3, {pages, ps, kDimCkv}, {ps * tb, tb, 1},
                                      DeviceKind::cuda);
      args.kv.kpe = make_strided_view(base + kDimCkv, DType::fp8_e4m3, {pages, ps, kDimKpe},
                                      {ps * tb, tb, 1}, DeviceKind::cuda);
    }
    run(plan_big, args);
    detail::cuda_synchronize(0);
    expect_matches(d, ref, what);
  }
}

}  // namespace
}  // namespace fp8mla
