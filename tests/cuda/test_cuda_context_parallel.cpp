// Context parallelism on GPUs: NcclComm + plan_context_parallel + run_context_parallel against
// the CPU reference of the unsharded batch, one thread a GPU (each rank's cache holds the whole
// pool; it reads only its shard's pages). World 1 runs on one GPU (the exchange's mechanics: the
// run into the rank's slot, the in-place all-gather, the merge); worlds 2 and 4 need as many
// visible GPUs and skip otherwise. Tolerances are the decode tests' (gpu_test_util.h): the
// exchanged partials' bf16 rounding (2^-9 relative each) is within them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "src/core/nccl.h"
#include "tests/common/test_util.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using gputest::CapturedGraph;
using gputest::device_args;
using gputest::DeviceBuffer;
using gputest::DeviceOutput;
using gputest::expect_matches;
using gputest::reference;
using gputest::TestStream;

// Why this machine cannot run a world (too few GPUs, no NCCL), or "" when it can.
std::string cannot_run(int world) {
  if (detail::cuda_device_count() < world)
    return "needs " + std::to_string(world) + " GPUs, " +
           std::to_string(detail::cuda_device_count()) + " visible";
  try {
    (void)detail::nccl();  // loads it (an id would start a bootstrap server for nobody)
  } catch (const Error& e) {
    return std::string("NCCL: ") + e.what();
  }
  return {};
}

// Runs body(rank) on one thread per rank and reports what any rank threw.
template <class Body>
void on_every_rank(int world, Body&& body) {
  std::vector<std::string> failures(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank)
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& e) {
        failures[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank)
    EXPECT_EQ(failures[static_cast<std::size_t>(rank)], "") << "rank " << rank;
}

struct CpCase {
  KvFormat format;
  int heads, page_size, world;
  bool causal;
  int qo = 1;  // query tokens a request, at most (> 1: MTP, each shard masked by its causal_len)
};

// Every rank's merged result equals the unsharded reference; with `graph`, the run is captured,
// replayed, re-planned to new lengths and replayed again.
void check_ranks(const CpCase& k, bool graph) {
  test::ProblemSpec s;
  s.format = k.format;
  s.num_heads = k.heads;
  s.page_size = k.page_size;
  s.batch = 5;
  s.kv_len_min = k.qo > 1 ? k.qo : 0;  // short requests leave late ranks empty
  s.kv_len_max = 6000;
  s.qo_len_max = k.qo;
  s.causal = k.causal;
  s.poison_unused = !graph;  // graph: the second batch reads pages the first left unused
  s.spare_pages = graph ? 30000 / k.page_size : 3;
  s.seed = 50 + static_cast<std::uint64_t>(k.world * 7 + k.page_size);
  test::RandomCase c = test::make_case(s);
  test::HostOutput ref = reference(c);
  // graph: the batch the plan is re-planned to (new lengths and pages), and its reference.
  test::RandomCase c2 = graph ? gputest::with_new_lengths(c, 9000, 51) : test::RandomCase{};
  std::optional<test::HostOutput> ref2;
  if (graph) ref2.emplace(reference(c2));
  const NcclId id = nccl_unique_id();
  const std::string what = test::describe(s) + ", world " + std::to_string(k.world);

  on_every_rank(k.world, [&](int rank) {
    gputest::check_cuda(cudaSetDevice(rank));  // the thread's GPU (its stream is made there)
    NcclComm comm(id, rank, k.world, rank);
    ASSERT_EQ(comm.rank(), rank);
    ASSERT_EQ(comm.world(), k.world);
    DeviceBuffer cache(c.cache, rank), q(c.q, rank);
    DeviceOutput d(c, 256, rank);
    TestStream stream;
    RunArgs args = device_args(c, cache, q, d, rank);
    args.stream = stream.s;
    PlanOptions o;
    if (graph) {
      o.cuda_graph = true;
      o.max_batch = s.batch;
      o.max_total_q = c.total_q;
      o.max_kv_indices = c.num_pages;
    }
    ContextParallelPlan cp = plan_context_parallel(c.problem(DeviceKind::cuda, rank), comm, o);
    const std::string tag = what + ", rank " + std::to_string(rank);
    if (!graph) {
      run_context_parallel(cp, args);
      gputest::check_cuda(cudaStreamSynchronize(stream.s));
      expect_matches(d, ref, tag);
      return;
    }
    // A first run outside capture: NCCL connects its ranks at their first collective.
    run_context_parallel(cp, args);
    gputest::check_cuda(cudaStreamSynchronize(stream.s));
    d.poison_all();
    CapturedGraph g(
        stream.s, [&] { run_context_parallel(cp, args); }, cudaStreamCaptureModeThreadLocal);
    g.replay();
    expect_matches(d, ref, tag + ", graph replay 1");
    replan_context_parallel(cp, c2.problem(DeviceKind::cuda, rank));
    d.poison_all();
    g.replay();
    expect_matches(d, *ref2, tag + ", graph replay after replan");
  });
}

const CpCase kCases[] = {
    {KvFormat::fp8_e4m3, 8, 1, 1, true},     {KvFormat::fp8_e4m3, 16, 64, 1, false},
    {KvFormat::fp8_e4m3, 8, 1, 2, true},     {KvFormat::fp8_e4m3, 128, 64, 2, false},
    {KvFormat::bf16, 16, 64, 2, true},       {KvFormat::fp8_e4m3_block, 64, 64, 2, false},
    {KvFormat::fp8_e4m3, 8, 64, 4, true},    {KvFormat::bf16, 8, 1, 4, false},
    {KvFormat::fp8_e4m3, 16, 1, 1, true, 3}, {KvFormat::fp8_e4m3, 16, 1, 2, true, 3},
    {KvFormat::bf16, 8, 64, 4, true, 2},
};
const CpCase kGraphCases[] = {
    {KvFormat::fp8_e4m3, 8, 1, 1, true},
    {KvFormat::fp8_e4m3, 8, 1, 2, true},
    {KvFormat::fp8_e4m3, 8, 64, 4, true},
};

// Runs the cases this machine can (enough GPUs, NCCL), says which it could not, and skips the
// test when it could run none.
void check_cases(std::span<const CpCase> cases, bool graph) {
  int ran = 0;
  std::string skipped;
  for (const CpCase& k : cases) {
    const std::string why = cannot_run(k.world);
    if (!why.empty()) {
      skipped += "\n  world " + std::to_string(k.world) + ": " + why;
      continue;
    }
    SCOPED_TRACE(std::string(format_name(k.format)) + ", world " + std::to_string(k.world));
    check_ranks(k, graph);
    ++ran;
  }
  if (!skipped.empty()) std::printf("not run here:%s\n", skipped.c_str());
  if (ran == 0) GTEST_SKIP() << "no case can run here:" << skipped;
}

TEST(CudaContextParallel, RanksMergeToTheUnshardedResult) {
  SKIP_WITHOUT_GPU();
  check_cases(kCases, false);
}

// run_context_parallel captured in a CUDA graph (NCCL's all-gather included), then re-planned in
// place for new lengths and page tables, and replayed.
TEST(CudaContextParallel, CaptureReplanReplay) {
  SKIP_WITHOUT_GPU();
  check_cases(kGraphCases, true);
}

// Bad input names its argument (world 1 on device 0).
TEST(CudaContextParallel, BadInputIsRejected) {
  SKIP_WITHOUT_GPU();
  const std::string skip = cannot_run(1);
  if (!skip.empty()) GTEST_SKIP() << skip;
  test::ProblemSpec s;
  s.seed = 61;
  test::RandomCase c = test::make_case(s);
  NcclComm comm(nccl_unique_id(), 0, 1, 0);
  auto expect_error = [](auto&& fn, const std::string& argument) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << argument;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
    }
  };
  expect_error([&] { (void)plan_context_parallel(c.problem(DeviceKind::cpu), comm); },
               "problem.device");
  expect_error([&] { (void)NcclComm(nccl_unique_id(), 0, 1, detail::cuda_device_count()); },
               "device_id");
  ContextParallelPlan cp = plan_context_parallel(c.problem(DeviceKind::cuda), comm);
  DeviceBuffer cache(c.cache), q(c.q);
  DeviceOutput d(c, 0);
  RunArgs args = device_args(c, cache, q, d);
  RunArgs strided = args;
  strided.out.stride[0] += 512;  // rows not dense
  expect_error([&] { run_context_parallel(cp, strided); }, "out.stride[0]");
  RunArgs short_out = args;
  short_out.out.shape[0] -= 1;
  expect_error([&] { run_context_parallel(cp, short_out); }, "out.shape[0]");
  test::RandomCase more_q = c;
  more_q.qo_indptr.back() += 1;
  expect_error([&] { replan_context_parallel(cp, more_q.problem(DeviceKind::cuda)); },
               "problem.qo_indptr");
  test::RandomCase c2 = gputest::with_new_lengths(c, 500, 3);  // a plan not made for graphs
  const std::vector<std::int32_t> planned = cp.shard().kv_len;
  expect_error([&] { replan_context_parallel(cp, c2.problem(DeviceKind::cuda)); }, "plan");
  EXPECT_EQ(cp.shard().kv_len, planned) << "a failed replan keeps the planned shard";
}

}  // namespace
}  // namespace fp8mla
