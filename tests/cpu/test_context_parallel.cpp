// Context parallelism on one machine: every rank's shard is run (float64 reference), the
// (out, lse) partials are stacked as NCCL's all-gather would lay them out ([world, rows, 512]
// bf16, [world, rows] f32) and merged with merge_states over the world axis; the result must match
// the unsharded run. Tolerance: the partials are rounded to bf16 before the merge (2^-9
// relative each), so rel L2 <= 4e-3 on out and 1e-3 * max(1, |lse|) on lse.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/nccl.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

test::HostOutput run_reference(test::RandomCase& c, const Problem& problem) {
  PlanOptions o;
  o.cpu_reference = true;
  test::HostOutput out(c);
  run(plan(problem, o), c.host_args(out));
  return out;
}

TEST(ContextParallel, ShardedRunsMergeToTheFullResult) {
  const struct {
    KvFormat format;
    int heads, page_size, world;
    bool causal;
  } cases[] = {{KvFormat::fp8_e4m3, 8, 1, 2, true},
               {KvFormat::fp8_e4m3, 16, 64, 4, false},
               {KvFormat::fp8_e4m3_block, 64, 16, 3, true},
               {KvFormat::bf16, 128, 64, 8, false},
               {KvFormat::fp8_e4m3, 5, 16, 1, true}};
  for (const auto& k : cases) {
    test::ProblemSpec s;
    s.format = k.format;
    s.num_heads = k.heads;
    s.page_size = k.page_size;
    s.batch = 4;
    s.kv_len_min = 0;  // short requests leave late ranks empty
    s.kv_len_max = 3000;
    s.causal = k.causal;
    s.seed = 40 + static_cast<std::uint64_t>(k.world);
    test::RandomCase c = test::make_case(s);
    const Problem full = c.problem();
    test::HostOutput want = run_reference(c, full);

    const std::int64_t rows = c.rows();
    std::vector<std::uint16_t> parts(static_cast<std::size_t>(k.world * rows * kDimCkv));
    std::vector<float> lses(static_cast<std::size_t>(k.world * rows));
    std::int64_t covered = 0;
    for (int rank = 0; rank < k.world; ++rank) {
      ContextShard shard;
      shard_context(full, rank, k.world, shard);
      for (std::int32_t len : shard.kv_len) covered += len;
      test::HostOutput part = run_reference(c, shard.problem);
      std::copy(part.out().begin(), part.out().end(), parts.begin() + rank * rows * kDimCkv);
      std::copy(part.lse().begin(), part.lse().end(), lses.begin() + rank * rows);
    }
    std::int64_t total = 0;
    for (std::int32_t len : c.kv_len) total += len;
    EXPECT_EQ(covered, total) << "shards must cover every token exactly once";

    // [rows, world, D] view of the world-major buffers, as merge_states takes them.
    std::vector<float> merged(static_cast<std::size_t>(rows * kDimCkv)), merged_lse(rows);
    merge_states(make_strided_view(parts.data(), DType::bf16, {rows, k.world, kDimCkv},
                                   {kDimCkv, rows * kDimCkv, 1}),
                 make_strided_view(lses.data(), DType::f32, {rows, k.world}, {1, rows}),
                 make_view(merged.data(), DType::f32, {rows, kDimCkv}),
                 make_view(merged_lse.data(), DType::f32, {rows}));
    std::vector<float> want_out(merged.size());
    for (std::size_t i = 0; i < want_out.size(); ++i) want_out[i] = bf16_to_float(want.out()[i]);
    const test::Comparison co = test::compare_f32(merged, want_out);
    const test::LseComparison cl = test::compare_lse(merged_lse, want.lse());
    EXPECT_TRUE(co.nan_ok()) << test::describe(s) << ": " << test::describe(co);
    EXPECT_LE(co.rel_l2, 4e-3) << test::describe(s) << ": " << test::describe(co);
    EXPECT_TRUE(cl.positions_ok()) << test::describe(s) << ": " << test::describe(cl);
    EXPECT_LE(cl.max_err, 1e-3) << test::describe(s) << ": " << test::describe(cl);
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
  try {
    shard_context(c.problem(), 0, 2, shard);
    FAIL() << "causal qo_len 3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qo_indptr"), std::string::npos) << e.what();
  }
  test::ProblemSpec sp;
  sp.topk = 16;
  test::RandomCase cs = test::make_case(sp);
  EXPECT_THROW(shard_context(cs.problem(), 0, 2, shard), Error);
}

// The NCCL exchange's host-side checks (its GPU runs: tests/cuda/test_cuda_context_parallel.cpp).
std::string error_argument(const auto& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.argument();
  }
  return "(no error)";
}

TEST(ContextParallel, NcclCommChecksItsRankBeforeJoining) {
  const NcclId id{};
  EXPECT_EQ(error_argument([&] { NcclComm(id, 0, 0, 0); }), "world");
  EXPECT_EQ(error_argument([&] { NcclComm(id, 2, 2, 0); }), "rank");
  EXPECT_EQ(error_argument([&] { NcclComm(id, -1, 2, 0); }), "rank");
  EXPECT_EQ(error_argument([&] { (void)NcclComm::borrow(nullptr, 0); }), "nccl_comm");
}

TEST(ContextParallel, AnEmptyPlanIsAnError) {
  const ContextParallelPlan empty;
  EXPECT_EQ(error_argument([&] { run_context_parallel(empty, RunArgs{}); }), "plan");
  EXPECT_EQ(error_argument([&] { (void)empty.local(); }), "plan");
}

// A library that is not NCCL, or no library, is reported with its path and the way to name one.
TEST(ContextParallel, NcclThatCannotBeLoadedIsNamed) {
  for (const std::string path : {"/nonexistent/libnccl.so.2", "libm.so.6"}) {
    try {
      (void)detail::load_nccl(path);
      ADD_FAILURE() << path << " loaded as NCCL";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::unsupported) << e.what();
      const std::string m = e.what();
      EXPECT_NE(m.find(path), std::string::npos) << m;
      EXPECT_NE(m.find("FP8MLA_NCCL_LIBRARY"), std::string::npos) << m;
    }
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
