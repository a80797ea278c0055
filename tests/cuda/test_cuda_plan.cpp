// GPU tests, the planner on a CUDA device: tiles per SM for small problems, the 16-row cap for
// few multi-token requests, a page table on the device. They GTEST_SKIP when no CUDA device is
// visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "tests/common/test_util.h"
#include "tests/cuda/decode_cases.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using namespace gputest;  // NOLINT: the GPU test helpers

// The planner's split on a CUDA device: below ~768 tokens of work per SM one tile per SM (a
// second CTA per SM costs more than it hides there), above it two per SM (the kernels'
// residency).
TEST(CudaPlan, SmallProblemsTakeOneTilePerSm) {
  SKIP_WITHOUT_GPU();
  // The counts below assume the table's fp8_e4m3 families' residency (two CTAs an SM).
  if (family_forced()) GTEST_SKIP() << "FP8MLA_KERNEL_FAMILY=" << std::getenv("FP8MLA_KERNEL_FAMILY");
  const int sms = detail::cuda_sm_count(0);
  auto tiles_for = [&](int batch, int context) {
    const int pages = context / 64;
    std::vector<std::int32_t> qo(batch + 1), kvp(batch + 1), len(batch, context), idx;
    for (int r = 0; r <= batch; ++r) qo[r] = r, kvp[r] = r * pages;
    for (int i = 0; i < batch * pages; ++i) idx.push_back(i);
    Problem pb;
    pb.num_heads = 8;
    pb.page_size = 64;
    pb.num_pages = batch * pages;
    pb.kv_format = KvFormat::fp8_e4m3;
    pb.sm_scale = 0.07f;
    pb.qo_indptr = qo;
    pb.kv_indptr = kvp;
    pb.kv_indices = idx;
    pb.kv_len = len;
    pb.device = DeviceKind::cuda;
    return static_cast<int>(plan(pb).tiles().size());
  };
  EXPECT_LE(tiles_for(1, 32768), sms);          // 248 tokens per SM on 132 SMs
  EXPECT_LE(tiles_for(16, 4096), sms);          // 496
  EXPECT_GT(tiles_for(64, 4096), sms);          // 1986: two CTAs per SM
  EXPECT_GT(tiles_for(1, 131072), sms);         // 993
  EXPECT_GE(tiles_for(1, 32768), sms * 3 / 4);  // still the whole GPU, not a few long tiles
}

// Multi-token requests (MTP) on an fp8 cache with <= 16 heads: while the batch is too small to
// fill the GPU (<= 128 kv tokens an SM, 16-row tiles <= a quarter of the SMs) the planner caps
// tiles at 16 rows by itself (max_tile_rows = 0; src/core/dispatch.h, choose_max_tile_rows), and
// the capped plan matches the reference; with longer contexts, more requests,
// exact_scores, a bf16 cache or a graph plan sized for more it keeps tiles of up to 64 rows.
// Sparse fp8_e4m3 lists at 8 heads: a tile a query token. 128 tokens fit one wave of
// fp8_gather's one CTA an SM on a 132-SM GPU and run there; 256 (128 requests x 2 tokens, MTP)
// do not and run fp8_exact, two CTAs an SM (the dispatch table's waves column).
TEST(CudaPlan, SparseTilesBeyondOneWaveLeaveFp8Gather) {
  SKIP_WITHOUT_GPU();
  if (family_forced())
    GTEST_SKIP() << "FP8MLA_KERNEL_FAMILY=" << std::getenv("FP8MLA_KERNEL_FAMILY");
  if (detail::cuda_compute_capability(0) != 90) GTEST_SKIP() << "the Hopper families' rule";
  const int sms = detail::cuda_sm_count(0);
  const int topk = 64;
  auto family_for = [&](int tokens) {
    std::vector<std::int32_t> qo{0, tokens}, sparse(static_cast<std::size_t>(tokens) * topk);
    for (std::size_t i = 0; i < sparse.size(); ++i) sparse[i] = static_cast<std::int32_t>(i % 4096);
    Problem pb;
    pb.num_heads = 8;
    pb.page_size = 1;
    pb.num_pages = 4096;
    pb.kv_format = KvFormat::fp8_e4m3;
    pb.sm_scale = 0.07f;
    pb.topk = topk;
    pb.qo_indptr = qo;
    pb.sparse_indices = sparse;
    pb.device = DeviceKind::cuda;
    const Plan pl = plan(pb);
    return std::make_pair(pl.kernel_family(), static_cast<int>(pl.tiles().size()));
  };
  const auto [one_wave, one_tiles] = family_for(sms);
  EXPECT_EQ(one_wave, KernelFamily::fp8_gather) << one_tiles << " tiles";
  const auto [two_waves, two_tiles] = family_for(2 * sms);
  EXPECT_GT(two_tiles, sms);
  EXPECT_EQ(two_waves, KernelFamily::fp8_exact) << two_tiles << " tiles";
}

TEST(CudaPlan, FewMultiTokenRequestsTakeSixteenRowTiles) {
  SKIP_WITHOUT_GPU();
  const int sms = detail::cuda_sm_count(0);
  auto spec = [](KvFormat format, int batch, int kv_len) {
    test::ProblemSpec s = decode_spec(format, 16, 64, kv_len, kv_len, 61 + batch);
    s.batch = batch;
    s.qo_len_min = s.qo_len_max = 2;
    s.causal = true;
    return s;
  };
  auto tokens_a_tile = [](const test::RandomCase& c, const PlanOptions& o) {
    const Plan p = plan(c.problem(DeviceKind::cuda), o);
    int most = 0;
    for (const WorkTile& t : p.tiles()) most = std::max(most, t.q_count);
    return most;
  };
  const int few = sms / 8;                    // 2 tiles a request: a quarter of the SMs
  const int short_kv = 128 * sms / few - 64;  // their tokens: just under 128 an SM
  const test::RandomCase one = test::make_case(spec(F8, 1, 900)),
                         some = test::make_case(spec(F8, few, short_kv)),
                         longer = test::make_case(spec(F8, few, short_kv + 128)),
                         more = test::make_case(spec(F8, few + 1, 900)),
                         bf16 = test::make_case(spec(BF, 1, 900));
  PlanOptions exact;
  exact.exact_scores = true;
  EXPECT_EQ(tokens_a_tile(one, {}), 1);
  EXPECT_EQ(tokens_a_tile(some, {}), 1);
  EXPECT_EQ(tokens_a_tile(longer, {}), 2);
  EXPECT_EQ(tokens_a_tile(more, {}), 2);
  EXPECT_EQ(tokens_a_tile(one, exact), 2);
  EXPECT_EQ(tokens_a_tile(bf16, {}), 2);
  PlanOptions small_graph = graph_options(one), large_graph = graph_options(one);
  small_graph.max_batch = 1;
  small_graph.max_total_q = small_graph.max_qo_len = large_graph.max_qo_len = 2;
  large_graph.max_batch = few + 1;
  large_graph.max_total_q = 2 * (few + 1);
  EXPECT_EQ(tokens_a_tile(one, small_graph), 1);
  EXPECT_EQ(tokens_a_tile(one, large_graph), 2);
  run_case(spec(F8, 1, 900));
  run_case(spec(F8, few, short_kv));
}

// A page table on the device (Problem::device_kv_indices) plans what the host one does: the same
// tiles and bit-identical output, run on a non-blocking stream right after plan() (its copies
// have landed when plan() returns); an entry outside the pool is named with its index and value;
// a graph-mode plan made and re-planned from device tables replays each batch.
TEST(CudaPlan, DevicePageTableMatchesTheHostOne) {
  SKIP_WITHOUT_GPU();
  test::ProblemSpec s = decode_spec(F8, 16, 1, 1, 3000, 94);
  s.batch = 6;
  s.spare_pages = 6400;  // the second batch's longer contexts
  s.poison_unused = false;
  test::RandomCase c = test::make_case(s);
  test::HostOutput ref = reference(c);
  DeviceBuffer cache(c.cache), q(c.q), table(c.kv_indices);
  auto on_device = [](const test::RandomCase& k, const DeviceBuffer& t) {
    Problem p = k.problem(DeviceKind::cuda);
    p.kv_indices = {};
    p.device_kv_indices = make_view(
        t.ptr, DType::i32, {static_cast<std::int64_t>(k.kv_indices.size())}, DeviceKind::cuda);
    return p;
  };
  TestStream stream;
  DeviceOutput host_out(c, 256), dev_out(c, 256);
  const Plan from_host = plan(c.problem(DeviceKind::cuda));
  const Plan from_device = plan(on_device(c, table));
  ASSERT_EQ(from_host.tiles().size(), from_device.tiles().size());
  RunArgs a = device_args(c, cache, q, host_out);
  a.stream = stream.s;
  run(from_host, a);
  RunArgs b = device_args(c, cache, q, dev_out);
  b.stream = stream.s;
  run(from_device, b);
  check_cuda(cudaStreamSynchronize(stream.s));
  expect_matches(host_out, ref, "host page table");
  expect_matches(dev_out, ref, "device page table");
  EXPECT_EQ(host_out.out.to_host<std::uint16_t>(), dev_out.out.to_host<std::uint16_t>());

  std::vector<std::int32_t> bad = c.kv_indices;
  const std::size_t at = bad.size() * 2 / 3;
  bad[at] = static_cast<std::int32_t>(c.num_pages) + 5;
  DeviceBuffer bad_table(bad);
  try {
    (void)plan(on_device(c, bad_table));
    ADD_FAILURE() << "a page outside the pool accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "device_kv_indices[" + std::to_string(at) + "]") << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(bad[at]) + " is outside the pool"),
              std::string::npos)
        << e.what();
  }

  Plan g = plan(on_device(c, table), graph_options(c));
  DeviceOutput d(c, 0);
  RunArgs ga = device_args(c, cache, q, d);
  ga.stream = stream.s;
  CapturedGraph graph(stream.s, [&] { run(g, ga); });
  graph.replay();
  expect_matches(d, ref, "graph, device page table");
  test::RandomCase c2 = with_new_lengths(c, 5000, 95);
  DeviceBuffer table2(c2.kv_indices);
  replan(g, on_device(c2, table2));
  d.poison_all();
  graph.replay();
  test::HostOutput ref2 = reference(c2);
  expect_matches(d, ref2, "graph, re-planned on device");
}

}  // namespace
}  // namespace fp8mla
