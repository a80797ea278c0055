// Context parallelism on one machine: every rank is a thread with its shard's plan (the CPU fast
// path; the unsharded result is the float64 reference), and the library's run_context_parallel
// body (detail::run_sharded) runs with an in-memory all-gather between the threads in place of
// NCCL's: each rank runs into its slot of
// its world-major exchange buffers ([world, rows, 512] bf16, [world, rows] f32), copies the
// others' slots, and merges. Every rank's result must match the unsharded run. Tolerance: the
// partials are rounded to bf16 before the merge (2^-9 relative each), so rel L2 <= 4e-3 on out
// and 1e-3 * max(1, |lse|) on lse.
#include <gtest/gtest.h>

#include <barrier>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/context_parallel_run.h"
#include "src/core/nccl.h"
#include "tests/common/expect_error.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

using test::error_of;

PlanOptions reference_options() {
  PlanOptions o;
  o.cpu_reference = true;
  return o;
}

test::HostOutput run_reference(test::RandomCase& c, const Problem& problem) {
  test::HostOutput out(c);
  run(plan(problem, reference_options()), c.host_args(out));
  return out;
}

// The exchange buffers of `world` ranks on the host, and an all-gather between their threads.
struct HostExchange {
  int world;
  std::int64_t rows;
  std::vector<std::vector<std::uint16_t>> out;  // [rank][world x rows x 512]
  std::vector<std::vector<float>> lse;          // [rank][world x rows]
  std::barrier<> sync;
  HostExchange(int w, std::int64_t r)
      : world(w),
        rows(r),
        out(w, std::vector<std::uint16_t>(static_cast<std::size_t>(w * r * kDimCkv), 0x7fc1)),
        lse(w, std::vector<float>(static_cast<std::size_t>(w * r), -1.0f)),
        sync(w) {}
  detail::ExchangeBuffers buffers(int rank) { return {out[rank].data(), lse[rank].data(), rows}; }
  // Rank `rank`'s all-gather: once every rank has run, copy the others' slots.
  void all_gather(int rank) {
    sync.arrive_and_wait();
    for (int r = 0; r < world; ++r) {
      if (r == rank) continue;
      const std::int64_t o = r * rows * kDimCkv, l = r * rows;
      std::copy(out[r].begin() + o, out[r].begin() + o + rows * kDimCkv, out[rank].begin() + o);
      std::copy(lse[r].begin() + l, lse[r].begin() + l + rows, lse[rank].begin() + l);
    }
    sync.arrive_and_wait();  // nobody's slot changes while another rank still copies it
  }
};

// Multi-token causal rows (qo > 1: MTP / speculative verify) see the tokens the unsharded
// problem shows them: shard_context sets each shard's causal_len. Short contexts put shard
// boundaries among a request's last qo tokens (partly visible shards, and rows that see none of
// a shard: empty states in the merge).
TEST(ContextParallel, ShardedRunsMergeToTheFullResult) {
  const struct {
    KvFormat format;
    int heads, page_size, world;
    bool causal;
    int qo, kv_max;
  } cases[] = {{KvFormat::fp8_e4m3, 8, 1, 2, true, 1, 3000},
               {KvFormat::fp8_e4m3, 16, 64, 4, false, 1, 3000},
               {KvFormat::fp8_e4m3_block, 64, 16, 3, true, 1, 3000},
               {KvFormat::bf16, 128, 64, 8, false, 1, 3000},
               {KvFormat::fp8_e4m3, 5, 16, 1, true, 1, 3000},
               {KvFormat::fp8_e4m3, 16, 1, 3, true, 4, 3000},
               {KvFormat::fp8_e4m3, 8, 1, 4, true, 4, 12},
               {KvFormat::bf16, 16, 2, 3, true, 3, 20},
               {KvFormat::fp8_e4m3, 128, 16, 2, true, 2, 600},
               {KvFormat::fp8_e4m3, 8, 1, 3, false, 4, 12}};
  for (const auto& k : cases) {
    test::ProblemSpec s;
    s.format = k.format;
    s.num_heads = k.heads;
    s.page_size = k.page_size;
    s.batch = 4;
    s.kv_len_min = k.qo > 1 ? k.qo : 0;  // short requests leave late ranks empty
    s.kv_len_max = k.kv_max;
    s.qo_len_min = 1;
    s.qo_len_max = k.qo;
    s.causal = k.causal;
    s.seed = 40 + static_cast<std::uint64_t>(k.world) + 10 * static_cast<std::uint64_t>(k.qo);
    test::RandomCase c = test::make_case(s);
    const Problem full = c.problem();
    test::HostOutput want = run_reference(c, full);

    HostExchange x(k.world, c.rows());
    std::vector<test::HostOutput> got;
    for (int rank = 0; rank < k.world; ++rank) got.emplace_back(c, 64);
    std::vector<std::int64_t> covered(k.world, 0);
    std::vector<std::string> failures(k.world);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < k.world; ++rank)
      ranks.emplace_back([&, rank] {
        bool gathered = false;
        try {
          ContextShard shard;
          shard_context(full, rank, k.world, shard);
          for (std::int32_t len : shard.kv_len) covered[rank] += len;
          PlanOptions o;
          o.num_threads = 1;  // the ranks are the threads
          const Plan local = plan(shard.problem, o);
          detail::run_sharded(local, rank, k.world, x.buffers(rank), c.host_args(got[rank]),
                              [&](const detail::ExchangeBuffers&) {
                                gathered = true;
                                x.all_gather(rank);
                              });
        } catch (const std::exception& e) {
          failures[rank] = e.what();
          if (!gathered) x.sync.arrive_and_drop();  // the others must not wait for this rank
        }
      });
    for (std::thread& t : ranks) t.join();
    std::int64_t total = 0, shards = 0;
    for (std::int32_t len : c.kv_len) total += len;
    for (std::int64_t n : covered) shards += n;
    EXPECT_EQ(shards, total) << "shards must cover every token exactly once";

    for (int rank = 0; rank < k.world; ++rank) {
      const std::string what = test::describe(s) + ", rank " + std::to_string(rank);
      ASSERT_EQ(failures[rank], "") << what;
      const test::Comparison co = test::compare_bf16(got[rank].out(), want.out());
      const test::LseComparison cl = test::compare_lse(got[rank].lse(), want.lse());
      EXPECT_TRUE(co.nan_ok()) << what << ": " << test::describe(co);
      EXPECT_LE(co.rel_l2, 4e-3) << what << ": " << test::describe(co);
      EXPECT_TRUE(cl.positions_ok()) << what << ": " << test::describe(cl);
      EXPECT_LE(cl.max_err, 1e-3) << what << ": " << test::describe(cl);
      EXPECT_TRUE(got[rank].guards_intact()) << what << ": wrote outside out / lse";
    }
  }
}

// run_sharded's checks name the argument: rows that are not dense cannot take the merge. Nothing
// runs or is exchanged before the checks.
TEST(ContextParallel, ShardedRunsRejectRowsThatAreNotDense) {
  test::ProblemSpec s;
  s.seed = 48;
  test::RandomCase c = test::make_case(s);
  const Plan local = plan(c.problem(), reference_options());
  HostExchange x(1, c.rows());
  test::HostOutput out(c);
  const auto no_exchange = [](const detail::ExchangeBuffers&) { FAIL() << "exchanged"; };
  RunArgs strided = c.host_args(out);
  strided.out.stride[0] += kDimCkv;
  RunArgs strided_lse = c.host_args(out);
  strided_lse.lse.stride[0] += 1;
  for (const auto& [bad, name] :
       {std::pair{strided, "out.stride[0]"}, std::pair{strided_lse, "lse.stride[0]"}}) {
    const RunArgs& args = bad;  // clang 14's lambdas cannot capture a structured binding
    EXPECT_EQ(error_of([&] {
                detail::run_sharded(local, 0, 1, x.buffers(0), args, no_exchange);
              }).argument(),
              name);
  }
}

TEST(ContextParallel, RejectsWhatItCannotShard) {
  test::ProblemSpec s;
  s.qo_len_min = s.qo_len_max = 3;
  s.causal = true;
  test::RandomCase c = test::make_case(s);
  ContextShard shard;
  EXPECT_THROW(shard_context(c.problem(), 0, 0, shard), Error);
  EXPECT_THROW(shard_context(c.problem(), 2, 2, shard), Error);
  // plan()'s causal rule holds for the whole request: 3 query tokens need 3 cached.
  std::vector<std::int32_t> short_len(c.kv_len.begin(), c.kv_len.end());
  short_len[0] = 2;
  Problem too_short = c.problem();
  too_short.kv_len = short_len;
  EXPECT_EQ(error_of([&] { shard_context(too_short, 0, 2, shard); }).argument(),
            "problem.kv_len[0]")
      << "causal qo_len 3 over 2 tokens";
  // A shard is not sharded again: its causal_len would be lost.
  shard_context(c.problem(), 0, 2, shard);
  ContextShard again;
  EXPECT_EQ(error_of([&] { shard_context(shard.problem, 0, 2, again); }).argument(),
            "problem.causal_len")
      << "a shard's problem";
  // Outputs other than bf16 (the merge writes bf16), and a borrowed page table (each rank keeps
  // its own share): errors naming them at plan time, not at the first run.
  Problem f16_out = c.problem();
  f16_out.out_dtype = DType::f16;
  EXPECT_EQ(error_of([&] { shard_context(f16_out, 0, 2, shard); }).argument(), "problem.out_dtype");
  std::vector<std::int32_t> borrowed_table(c.kv_indices.begin(), c.kv_indices.end());
  Problem borrowed = c.problem();
  borrowed.borrowed_kv_indices =
      make_view(borrowed_table.data(), DType::i32,
                {static_cast<std::int64_t>(borrowed_table.size())}, DeviceKind::cpu);
  borrowed.kv_indices = {};
  EXPECT_EQ(error_of([&] { shard_context(borrowed, 0, 2, shard); }).argument(),
            "problem.borrowed_kv_indices");
  test::ProblemSpec sp;
  sp.topk = 16;
  test::RandomCase cs = test::make_case(sp);
  EXPECT_THROW(shard_context(cs.problem(), 0, 2, shard), Error);
  // A page table on the device: shards are cut on the host.
  test::RandomCase cd = test::make_case(test::ProblemSpec{});
  Problem on_device = cd.problem(DeviceKind::cuda);
  std::vector<std::int32_t> table(on_device.kv_indices.begin(), on_device.kv_indices.end());
  on_device.device_kv_indices = make_view(
      table.data(), DType::i32, {static_cast<std::int64_t>(table.size())}, DeviceKind::cuda);
  on_device.kv_indices = {};
  EXPECT_EQ(error_of([&] { shard_context(on_device, 0, 2, shard); }).argument(),
            "problem.device_kv_indices")
      << "a device page table";
}

// The NCCL exchange's host-side checks (its GPU runs: tests/cuda/test_cuda_context_parallel.cpp).

TEST(ContextParallel, NcclCommChecksItsRankBeforeJoining) {
  const NcclId id{};
  EXPECT_EQ(error_of([&] { NcclComm(id, 0, 0, 0); }).argument(), "world");
  EXPECT_EQ(error_of([&] { NcclComm(id, 2, 2, 0); }).argument(), "rank");
  EXPECT_EQ(error_of([&] { NcclComm(id, -1, 2, 0); }).argument(), "rank");
  EXPECT_EQ(error_of([&] { (void)NcclComm::borrow(nullptr, 0); }).argument(), "nccl_comm");
}

TEST(ContextParallel, AnEmptyPlanIsAnError) {
  const ContextParallelPlan empty;
  EXPECT_EQ(error_of([&] { run_context_parallel(empty, RunArgs{}); }).argument(), "plan");
  EXPECT_EQ(error_of([&] { (void)empty.local(); }).argument(), "plan");
}

// A library that is not NCCL, or no library, is reported with its path and the way to name one.
TEST(ContextParallel, NcclThatCannotBeLoadedIsNamed) {
  for (const std::string path : {"/nonexistent/libnccl.so.2", "libm.so.6"}) {
    test::expect_error([&] { (void)detail::load_nccl(path); },
                       {path.c_str(), "FP8MLA_NCCL_LIBRARY"}, ErrorCode::unsupported);
  }
}

// Where NCCL is installed (the CUDA toolkit's, or PyTorch's), ids are fresh each time.
TEST(ContextParallel, NcclIdsAreFresh) {
  NcclId a, b;
  try {
    a = nccl_unique_id();
    b = nccl_unique_id();
  } catch (const Error& e) {
    if (e.code() == ErrorCode::unsupported) GTEST_SKIP() << e.what();
    throw;
  }
  EXPECT_NE(a.bytes, b.bytes);
}

}  // namespace
}  // namespace fp8mla
