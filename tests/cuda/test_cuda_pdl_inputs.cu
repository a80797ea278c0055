// What an engine's kernel writes right before run() (GPU; GTEST_SKIP without a device). Every
// decode kernel is a programmatic dependent of the kernel before it on the stream, so it may
// start while that kernel still runs: the sparse indices an indexer kernel writes, or a borrowed
// page table a kernel fills (SGLang builds its kv_indices that way), must be read only after
// griddepcontrol.wait. A writer kernel here lets its dependents launch at once, spins for about a
// millisecond, then writes the final list over a stale one (other slots or pages, NaN where the
// case poisons unused tokens); the run queued right after it must match the float64 reference of
// the final list. With the first blocks' entries read before the wait, it read the stale ones.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "tests/common/test_util.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla::gputest {
namespace {

// Lets the next kernel on the stream launch (sm_90+), waits `spin` clocks, then copies n entries.
__global__ void write_late(std::int32_t* dst, const std::int32_t* src, std::int64_t n,
                           long long spin) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {
  }
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

struct LateCase {
  KvFormat format;
  int heads, page_size, topk;  // topk 0: dense, the page table borrowed
};

void check_written_late(const LateCase& k) {
  const test::ProblemSpec s{
      .batch = 3, .num_heads = k.heads, .page_size = k.page_size, .format = k.format,
      .kv_len_min = 200, .kv_len_max = 1500, .topk = k.topk,
      .spare_pages = 40,  // NaN pages for the stale table to point at
      .seed = 4100 + static_cast<std::uint64_t>(k.heads * 7 + k.page_size + k.topk)};
  test::RandomCase c = test::make_case(s);
  const bool sparse = k.topk > 0;
  const std::string what = test::describe(s) + (sparse ? " (sparse indices written late)"
                                                       : " (borrowed page table written late)");
  SCOPED_TRACE(what);

  // The stale list: every valid entry moved to another slot (sparse) or page (dense) of the pool.
  const std::vector<std::int32_t>& final_list = sparse ? c.sparse_indices : c.kv_indices;
  const std::int64_t n_ids = sparse ? c.num_pages * k.page_size : c.num_pages;
  std::vector<std::int32_t> stale = final_list;
  for (std::int32_t& v : stale) {
    if (v >= 0) v = static_cast<std::int32_t>((v + n_ids / 2 + 1) % n_ids);
  }
  DeviceBuffer d_final(final_list), d_list(stale), cache(c.cache), q(c.q);

  Problem p = c.problem(DeviceKind::cuda);
  if (!sparse) {
    p.kv_indices = {};
    p.borrowed_kv_indices = make_view(d_list.ptr, DType::i32,
                                      {static_cast<std::int64_t>(final_list.size())},
                                      DeviceKind::cuda);
  }
  const Plan pl = plan(p);
  DeviceOutput d(c, 64);
  RunArgs args = device_args(c, cache, q, d);
  if (sparse) {
    args.sparse_indices =
        make_view(d_list.ptr, DType::i32, {c.total_q, k.topk}, DeviceKind::cuda);
  }
  TestStream stream;
  args.stream = stream.s;
  write_late<<<1, 256, 0, stream.s>>>(static_cast<std::int32_t*>(d_list.ptr),
                                      static_cast<const std::int32_t*>(d_final.ptr),
                                      static_cast<std::int64_t>(final_list.size()), 2000000);
  check_cuda(cudaGetLastError());
  run(pl, args);
  check_cuda(cudaStreamSynchronize(stream.s));
  test::HostOutput ref = reference(c);
  expect_matches(d, ref, what + ", kernel " + pl.kernel_name());
}

// The families the dispatch table gives these plans on sm_90: fp8_gather, fp8_tma, bf16_tma,
// bf16_gather and bf16_wide_rows, which read their first blocks' entries before the wait where
// the plan owns them, and wide_rows and shared_tile, which read them after it; on other GPUs,
// the portable family.
TEST(CudaPdlInputs, SparseIndicesWrittenByThePreviousKernel) {
  SKIP_WITHOUT_GPU();
  for (const LateCase& k : {LateCase{KvFormat::fp8_e4m3, 8, 1, 512},
                            LateCase{KvFormat::fp8_e4m3_block, 16, 64, 512},
                            LateCase{KvFormat::fp8_e4m3, 64, 64, 256},
                            LateCase{KvFormat::bf16, 16, 1, 256}}) {
    check_written_late(k);
  }
}

TEST(CudaPdlInputs, BorrowedPageTableWrittenByThePreviousKernel) {
  SKIP_WITHOUT_GPU();
  for (const LateCase& k :
       {LateCase{KvFormat::fp8_e4m3, 16, 64, 0}, LateCase{KvFormat::fp8_e4m3, 8, 1, 0},
        LateCase{KvFormat::fp8_e4m3_block, 8, 64, 0}, LateCase{KvFormat::bf16, 16, 64, 0},
        LateCase{KvFormat::bf16, 16, 1, 0}, LateCase{KvFormat::bf16, 64, 64, 0},
        LateCase{KvFormat::fp8_e4m3, 128, 1, 0}}) {
    check_written_late(k);
  }
}

}  // namespace
}  // namespace fp8mla::gputest
