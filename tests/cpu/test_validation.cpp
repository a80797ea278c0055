// Bad input to plan(), replan(), run() and merge_states(): one test per class of mistake. Each
// checks the error code and that the message names the argument (with its index) and the bound.
// Every error here is thrown before a backend is called.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/check.h"
#include "tests/common/expect_error.h"
#include "tests/common/small_problem.h"

namespace fp8mla {
namespace {

using I32 = std::vector<std::int32_t>;
using test::expect_error;

// A valid dense problem: 2 requests, 8 heads, page size 4, 16 pages; request 1 has 2 tokens.
struct Input : test::SmallProblem {
  void make() { (void)plan(problem(), o); }
  // Sparse: topk 4 slots per token (3 tokens).
  void make_sparse() {
    p.topk = 4;
    sparse_indices = {0, 1, 2, -1, 5, 6, 7, 8, 63, -1, -1, -1};
  }
};

TEST(ValidationPlan, ValidInputPlans) {
  Input in;
  EXPECT_NO_THROW(in.make());
  in.make_sparse();
  EXPECT_NO_THROW(in.make());
  in.kv_indptr.clear();  // sparse mode: the page table is optional
  in.kv_indices.clear();
  in.kv_len.clear();
  EXPECT_NO_THROW(in.make());
}

TEST(ValidationPlan, NumHeads) {
  for (int h : {0, -1, 129}) {
    Input in;
    in.p.num_heads = h;
    expect_error([&] { in.make(); }, {"num_heads", "[1, 128]"});
  }
}

TEST(ValidationPlan, PageSize) {
  for (int ps : {0, 3, 256, -4}) {
    Input in;
    in.p.page_size = ps;
    expect_error([&] { in.make(); }, {"page_size", "power of two", "128"});
  }
}

TEST(ValidationPlan, NumPages) {
  Input in;
  in.p.num_pages = 0;
  expect_error([&] { in.make(); }, {"num_pages", "outside [1, 2147483647]"});
}

TEST(ValidationPlan, Dtypes) {
  Input q;
  q.p.q_dtype = DType::f32;
  expect_error([&] { q.make(); }, {"q_dtype", "bf16", "f32"});
  Input out;
  out.p.out_dtype = DType::i32;
  expect_error([&] { out.make(); }, {"out_dtype", "bf16 or f16", "i32"});
}

TEST(ValidationPlan, SmScale) {
  for (float s : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()}) {
    Input in;
    in.p.sm_scale = s;
    expect_error([&] { in.make(); }, {"sm_scale", "finite and in (0, 65536]"});
  }
}

TEST(ValidationPlan, QoIndptr) {
  Input length;
  length.qo_indptr = {};
  expect_error([&] { length.make(); }, {"qo_indptr", ">= 1 entries, got 0"});
  Input start;
  start.qo_indptr = {1, 1, 3};
  expect_error([&] { start.make(); }, {"qo_indptr[0]", "must be 0"});
  Input order;
  order.qo_indptr = {0, 3, 2};
  expect_error([&] { order.make(); }, {"qo_indptr[2]", "qo_indptr[1] = 3", "non-decreasing"});
}

TEST(ValidationPlan, KvIndptr) {
  Input length;
  length.kv_indptr = {0, 5};
  expect_error([&] { length.make(); }, {"kv_indptr", "expected 3 entries", "got 2"});
  Input start;
  start.kv_indptr = {1, 2, 5};
  expect_error([&] { start.make(); }, {"kv_indptr[0]", "must be 0"});
  Input order;
  order.kv_indptr = {0, 3, 2};
  order.kv_indices = {0, 1};
  expect_error([&] { order.make(); }, {"kv_indptr[2]", "non-decreasing"});
  Input last;
  last.kv_indices.push_back(7);
  expect_error([&] { last.make(); }, {"kv_indptr[2]", "kv_indices.size() = 6"});
}

TEST(ValidationPlan, KvIndicesOutsideThePool) {
  Input high;
  high.kv_indices[3] = 16;
  expect_error([&] { high.make(); }, {"kv_indices[3]", "16 is outside the pool [0, 16)"});
  Input negative;
  negative.kv_indices[0] = -1;
  expect_error([&] { negative.make(); }, {"kv_indices[0]", "[0, 16)"});
}

// A page table on the device (Problem::device_kv_indices): CUDA plans only, instead of
// kv_indices, i32 [kv_indptr[batch]] on the plan's device. These checks come before any device
// is asked, so `table` (standing for device memory) is never read.
TEST(ValidationPlan, DeviceKvIndices) {
  I32 table{0, 1, 2, 3, 4};
  auto input = [&](DeviceKind plan_device, TensorView view, bool with_host_table) {
    Input in;
    in.p.device = plan_device;
    in.p.device_kv_indices = view;
    if (!with_host_table) in.kv_indices.clear();
    return in;
  };
  const DeviceKind cuda = DeviceKind::cuda;
  const TensorView good = make_view(table.data(), DType::i32, {5}, cuda);
  Input cpu = input(DeviceKind::cpu, good, false);
  expect_error([&] { cpu.make(); }, {"device_kv_indices", "CUDA plans"});
  Input both = input(cuda, good, true);
  expect_error([&] { both.make(); }, {"kv_indices", "give one of the two"});
  Input dtype = input(cuda, make_view(table.data(), DType::f32, {5}, cuda), false);
  expect_error([&] { dtype.make(); }, {"device_kv_indices.dtype", "expected i32"});
  Input shape = input(cuda, make_view(table.data(), DType::i32, {4}, cuda), false);
  expect_error([&] { shape.make(); }, {"device_kv_indices.shape[0]", "expected 5"});
  Input host = input(cuda, make_view(table.data(), DType::i32, {5}), false);
  expect_error([&] { host.make(); }, {"device_kv_indices.device", "expected cuda:0"});
  Input other = input(cuda, make_view(table.data(), DType::i32, {5}, cuda, 1), false);
  expect_error([&] { other.make(); }, {"device_kv_indices.device", "got cuda:1"});
  Input graph = input(cuda, good, false);
  graph.o.cuda_graph = true;
  graph.o.max_batch = 2;
  graph.o.max_total_q = 3;
  graph.o.max_kv_indices = 4;
  expect_error(
      [&] { graph.make(); },
      {"device_kv_indices", "size 5 exceeds the graph capacity options.max_kv_indices = 4"});
}

TEST(ValidationPlan, KvLen) {
  Input size;
  size.kv_len = {5};
  expect_error([&] { size.make(); }, {"kv_len", "expected batch = 2 entries, got 1"});
  Input negative;
  negative.kv_len[0] = -1;
  negative.p.causal = false;
  expect_error([&] { negative.make(); }, {"kv_len[0]", ">= 0"});
  Input too_long;
  too_long.kv_len[1] = 13;  // 3 pages of 4 tokens
  expect_error([&] { too_long.make(); }, {"kv_len[1]", "13", "3 pages", "= 12 tokens"});
}

TEST(ValidationPlan, CausalNeedsQoLenWithinKvLen) {
  Input in;
  in.kv_len[1] = 1;  // 2 query tokens
  expect_error([&] { in.make(); }, {"kv_len[1]", "qo_len = 2", "causal"});
  in.p.causal = false;
  EXPECT_NO_THROW(in.make());
  Input empty;
  empty.kv_len[1] = 0;  // rows with nothing to see are allowed (o = 0, lse = -inf)
  EXPECT_NO_THROW(empty.make());
}

// Problem::causal_len (a context-parallel shard's mask length): one entry a request, each at
// least kv_len, dense causal problems only; with it a shard may hold fewer tokens than qo_len.
TEST(ValidationPlan, CausalLen) {
  Input in;
  I32 causal_len{5};
  in.p.causal_len = causal_len;
  expect_error([&] { in.make(); }, {"causal_len", "expected batch = 2 entries, got 1"});
  causal_len = {5, 8};
  in.p.causal_len = causal_len;
  expect_error([&] { in.make(); }, {"causal_len[1]", "8", "less than kv_len = 9"});
  causal_len = {7, 30};
  in.p.causal_len = causal_len;
  in.kv_len[1] = 1;  // 2 query tokens, 1 token held: fine for a shard
  EXPECT_NO_THROW(in.make());
  in.p.causal = false;
  expect_error([&] { in.make(); }, {"causal_len", "causal dense"});
  Input sparse;
  sparse.make_sparse();
  sparse.p.causal_len = causal_len;
  expect_error([&] { sparse.make(); }, {"causal_len", "causal dense"});
}

TEST(ValidationPlan, Topk) {
  Input in;
  in.p.topk = -1;
  expect_error([&] { in.make(); }, {"topk", ">= 0"});
}

TEST(ValidationPlan, SparseIndicesSize) {
  Input in;
  in.make_sparse();
  in.sparse_indices.pop_back();
  expect_error([&] { in.make(); }, {"sparse_indices", "total_q x topk = 3 x 4 = 12", "got 11"});
  Input dense;  // indices given to a dense problem
  dense.sparse_indices = {1, 2};
  expect_error([&] { dense.make(); }, {"sparse_indices", "= 0 entries, got 2"});
}

TEST(ValidationPlan, SparseIndicesOutsideThePool) {
  for (std::int32_t bad : {64, -2}) {
    Input in;
    in.make_sparse();
    in.sparse_indices[5] = bad;
    expect_error([&] { in.make(); }, {"sparse_indices[5]", "[0, 64)", "not -1", "token 1"});
  }
}

TEST(ValidationPlan, SparsePageTableIsCheckedWhenGiven) {
  Input in;
  in.make_sparse();
  in.kv_indices[2] = 99;
  expect_error([&] { in.make(); }, {"kv_indices[2]", "[0, 16)"});
  Input len;
  len.make_sparse();
  len.kv_indptr.clear();
  len.kv_indices.clear();
  len.kv_len = {1};
  expect_error([&] { len.make(); }, {"kv_len", "expected batch = 2"});
}

TEST(ValidationPlan, Options) {
  struct Case {
    void (*set)(PlanOptions&);
    const char* name;
  };
  const Case cases[] = {
      {[](PlanOptions& o) { o.sm_count = -1; }, "options.sm_count"},
      {[](PlanOptions& o) { o.ctas_per_sm = -1; }, "options.ctas_per_sm"},
      {[](PlanOptions& o) { o.min_chunk_tokens = 0; }, "options.min_chunk_tokens"},
      {[](PlanOptions& o) { o.num_threads = -2; }, "options.num_threads"},
      {[](PlanOptions& o) { o.max_tile_rows = -1; }, "options.max_tile_rows"},
      {[](PlanOptions& o) { o.max_tile_rows = kMaxRowsPerTile + 1; }, "options.max_tile_rows"},
  };
  for (const Case& c : cases) {
    Input in;
    c.set(in.o);
    expect_error([&] { in.make(); }, {c.name});
  }
}

TEST(ValidationPlan, GraphCapacities) {
  auto graph = [](Input& in) {
    in.o.cuda_graph = true;
    in.o.max_batch = 2;
    in.o.max_total_q = 3;
    in.o.max_kv_indices = 5;
  };
  Input ok;
  graph(ok);
  EXPECT_NO_THROW(ok.make());
  Input zero;
  graph(zero);
  zero.o.max_total_q = 0;
  expect_error([&] { zero.make(); }, {"options.max_total_q", "outside [1, 4194304]"});
  Input batch;
  graph(batch);
  batch.o.max_batch = 1;
  expect_error([&] { batch.make(); }, {"qo_indptr", "batch 2", "options.max_batch = 1"});
  Input tokens;
  graph(tokens);
  tokens.o.max_total_q = 2;
  expect_error([&] { tokens.make(); }, {"total_q 3", "options.max_total_q = 2"});
  Input pages;
  graph(pages);
  pages.o.max_kv_indices = 4;
  expect_error([&] { pages.make(); }, {"kv_indices", "size 5", "options.max_kv_indices = 4"});
  Input qo_len;  // request 1 has 2 tokens
  graph(qo_len);
  qo_len.o.max_qo_len = 1;
  expect_error([&] { qo_len.make(); }, {"qo_indptr[2]", "qo_len 2", "options.max_qo_len = 1"});
  Input negative;
  graph(negative);
  negative.o.max_qo_len = -1;
  expect_error([&] { negative.make(); }, {"options.max_qo_len", "outside [0, 4194304]"});
}

TEST(ValidationPlan, DeviceId) {
  Input in;
  in.p.device_id = -1;
  expect_error([&] { in.make(); }, {"device_id", ">= 0"});
}

TEST(ValidationPlan, EmptyPlanAndReplanOfAPlainPlan) {
  const Plan empty;
  expect_error([&] { (void)empty.tiles(); }, {"plan", "empty"});
  Input in;
  Plan p = plan(in.problem(), in.o);
  expect_error([&] { replan(p, in.problem()); }, {"plan", "cuda_graph"});
}

#ifndef FP8MLA_WITH_CUDA
TEST(ValidationDevice, CudaPlanWithoutCudaIsUnsupported) {
  Input ask;  // sm_count 0: plan() asks the device
  ask.p.device = DeviceKind::cuda;
  ask.o.sm_count = 0;
  expect_error([&] { ask.make(); }, {"CUDA"}, ErrorCode::unsupported);
  Input given;  // sm_count given: the upload is what fails
  given.p.device = DeviceKind::cuda;
  expect_error([&] { given.make(); }, {"CUDA"}, ErrorCode::unsupported);
  EXPECT_FALSE(cuda_available());
}
#endif

// ---- run() ----

// Host tensors matching Input's plan (fp8_e4m3, 16 pages of 4, 3 tokens x 8 heads).
struct RunInput : Input {
  std::vector<std::uint16_t> q_nope = std::vector<std::uint16_t>(3 * 8 * 512);
  std::vector<std::uint16_t> q_pe = std::vector<std::uint16_t>(3 * 8 * 64);
  std::vector<std::uint16_t> out = std::vector<std::uint16_t>(3 * 8 * 512);
  std::vector<float> lse = std::vector<float>(3 * 8);
  std::vector<std::uint8_t> cache = std::vector<std::uint8_t>(16 * 4 * 656);
  std::vector<std::int32_t> indices = std::vector<std::int32_t>(3 * 4);
  RunArgs a;

  RunInput() {
    a.q_nope = make_view(q_nope.data(), DType::bf16, {3, 8, 512});
    a.q_pe = make_view(q_pe.data(), DType::bf16, {3, 8, 64});
    a.out = make_view(out.data(), DType::bf16, {3, 8, 512});
    a.lse = make_view(lse.data(), DType::f32, {3, 8});
    a.kv.format = KvFormat::fp8_e4m3;
    a.kv.ckv = make_strided_view(cache.data(), DType::fp8_e4m3, {16, 4, 512}, {4 * 576, 576, 1});
    a.kv.kpe = make_strided_view(cache.data() + 512, DType::u8, {16, 4, 64}, {4 * 576, 576, 1});
  }
  void run_it() { run(plan(problem(), o), a); }
};

TEST(ValidationRun, QueryShape) {
  RunInput in;
  in.a.q_nope = make_view(in.q_nope.data(), DType::bf16, {3, 4, 512});
  expect_error([&] { in.run_it(); }, {"q_nope.shape[1]", "expected 8", "got 4"});
  RunInput pe;
  pe.a.q_pe = make_view(pe.q_pe.data(), DType::bf16, {2, 8, 64});
  expect_error([&] { pe.run_it(); }, {"q_pe.shape[0]", "expected 3", "got 2"});
  RunInput rank;
  rank.a.q_nope = make_view(rank.q_nope.data(), DType::bf16, {24, 512});
  expect_error([&] { rank.run_it(); }, {"q_nope.ndim", "expected 3", "got 2"});
}

TEST(ValidationRun, Dtype) {
  RunInput in;
  in.a.q_nope.dtype = DType::f16;
  expect_error([&] { in.run_it(); }, {"q_nope.dtype", "bf16", "f16"});
  RunInput lse;
  lse.a.lse.dtype = DType::bf16;
  expect_error([&] { lse.run_it(); }, {"lse.dtype", "f32", "bf16"});
  RunInput ckv;
  ckv.a.kv.ckv.dtype = DType::bf16;
  expect_error([&] { ckv.run_it(); }, {"kv.ckv.dtype", "fp8_e4m3 or u8", "bf16"});
}

TEST(ValidationRun, OutputShape) {
  RunInput in;
  in.a.out = make_view(in.out.data(), DType::bf16, {3, 8, 256});
  expect_error([&] { in.run_it(); }, {"out.shape[2]", "expected 512", "got 256"});
  RunInput lse;
  lse.a.lse = make_view(lse.lse.data(), DType::f32, {3, 4});
  expect_error([&] { lse.run_it(); }, {"lse.shape[1]", "expected 8", "got 4"});
  RunInput missing;
  missing.a.out.data = nullptr;
  expect_error([&] { missing.run_it(); }, {"out", "required"});
}

TEST(ValidationRun, KvFormat) {
  RunInput in;
  in.a.kv.format = KvFormat::bf16;
  expect_error([&] { in.run_it(); }, {"kv.format", "expected fp8_e4m3", "got bf16"});
  RunInput block;  // a 656-byte cache must be 656 wide
  block.p.kv_format = KvFormat::fp8_e4m3_block;
  block.a.kv.format = KvFormat::fp8_e4m3_block;
  block.a.kv.ckv = make_view(block.cache.data(), DType::u8, {16, 4, 576});
  expect_error([&] { block.run_it(); }, {"kv.ckv.shape[2]", "expected 656", "got 576"});
}

TEST(ValidationRun, Device) {
  RunInput in;
  in.a.out.device = DeviceKind::cuda;
  expect_error([&] { in.run_it(); }, {"out.device", "expected cpu", "got cuda"});
  RunInput kpe;
  kpe.a.kv.kpe.device = DeviceKind::cuda;
  expect_error([&] { kpe.run_it(); }, {"kv.kpe.device"});
}

TEST(ValidationRun, InnermostStride) {
  RunInput in;
  // Never dereferenced: run() rejects it first.
  in.a.q_nope = make_strided_view(in.q_nope.data(), DType::bf16, {3, 8, 512}, {4096, 512, 2});
  expect_error([&] { in.run_it(); }, {"q_nope.stride[2]", "contiguous", "got 2"});
}

TEST(ValidationRun, CachePagesDifferFromThePlan) {
  RunInput in;
  in.a.kv.ckv.shape[0] = 8;
  expect_error([&] { in.run_it(); }, {"kv.ckv.shape[0]", "expected 16", "got 8"});
  RunInput page;
  page.a.kv.kpe.shape[1] = 2;
  expect_error([&] { page.run_it(); }, {"kv.kpe.shape[1]", "expected 4", "got 2"});
}

TEST(ValidationRun, Scales) {
  RunInput in;
  in.a.kv.ckv_scale = 0.0f;
  expect_error([&] { in.run_it(); }, {"kv.ckv_scale", "finite and > 0"});
  RunInput kpe;
  kpe.a.kv.kpe_scale = std::numeric_limits<float>::infinity();
  expect_error([&] { kpe.run_it(); }, {"kv.kpe_scale", "finite and > 0"});
}

TEST(ValidationRun, SparseIndicesOverride) {
  RunInput dense;
  dense.a.sparse_indices = make_view(dense.indices.data(), DType::i32, {3, 4});
  expect_error([&] { dense.run_it(); }, {"sparse_indices", "dense (topk = 0)"});
  RunInput shape;
  shape.make_sparse();
  shape.a.sparse_indices = make_view(shape.indices.data(), DType::i32, {3, 2});
  expect_error([&] { shape.run_it(); }, {"sparse_indices.shape[1]", "expected 4", "got 2"});
  RunInput dtype;
  dtype.make_sparse();
  dtype.a.sparse_indices = make_view(dtype.indices.data(), DType::f32, {3, 4});
  expect_error([&] { dtype.run_it(); }, {"sparse_indices.dtype", "i32"});
}

// ---- merge_states() ----

struct MergeInput {
  std::vector<float> v = std::vector<float>(5 * 3 * 16);
  std::vector<float> s = std::vector<float>(5 * 3);
  std::vector<float> v_out = std::vector<float>(5 * 16);
  std::vector<float> s_out = std::vector<float>(5);
  TensorView tv = make_view(v.data(), DType::f32, {5, 3, 16});
  TensorView ts = make_view(s.data(), DType::f32, {5, 3});
  TensorView tv_out = make_view(v_out.data(), DType::f32, {5, 16});
  TensorView ts_out = make_view(s_out.data(), DType::f32, {5});
  void merge() { merge_states(tv, ts, tv_out, ts_out); }
};

TEST(ValidationMerge, Shapes) {
  MergeInput rank;
  rank.tv = make_view(rank.v.data(), DType::f32, {15, 16});
  expect_error([&] { rank.merge(); }, {"v.ndim", "expected 3", "got 2"});
  MergeInput states;
  states.ts = make_view(states.s.data(), DType::f32, {5, 2});
  expect_error([&] { states.merge(); }, {"s.shape[1]", "expected 3", "got 2"});
  MergeInput width;
  width.tv_out = make_view(width.v_out.data(), DType::f32, {5, 8});
  expect_error([&] { width.merge(); }, {"v_out.shape[1]", "expected 16", "got 8"});
  MergeInput rows;
  rows.ts_out = make_view(rows.s_out.data(), DType::f32, {4});
  expect_error([&] { rows.merge(); }, {"s_out.shape[0]", "expected 5", "got 4"});
}

TEST(ValidationMerge, DtypesAndDevice) {
  MergeInput v;
  v.tv.dtype = DType::f16;
  expect_error([&] { v.merge(); }, {"v.dtype", "f32 or bf16"});
  MergeInput s;
  s.ts.dtype = DType::bf16;
  expect_error([&] { s.merge(); }, {"s.dtype", "f32"});
  MergeInput device;
  device.ts_out.device = DeviceKind::cuda;
  expect_error([&] { device.merge(); }, {"s_out.device", "expected cpu"});
}

TEST(ValidationMerge, StatesMajorLseIsAccepted) {
  // s as a permuted view of a [states, rows] buffer: inner stride 5. The error then comes from
  // the next tensor, so s passed.
  MergeInput in;
  in.ts = make_strided_view(in.s.data(), DType::f32, {5, 3}, {1, 5});
  in.tv_out.dtype = DType::i32;
  expect_error([&] { in.merge(); }, {"v_out.dtype"});
}

// The check prepare() (src/cuda/decode/launch.cu) runs on the warp-specialized kernel before its first
// launch: a register count other than the one its setmaxnreg split adds up to is an error, not a
// hang. Exercised here on counts, since a kernel cannot be mis-built on purpose.
TEST(ValidationDevice, RegisterSplitNeedsTheExactCount) {
  EXPECT_NO_THROW(detail::require_register_count("decode kernel", 168, 168));
  for (const int built : {128, 167, 169, 255})
    expect_error([&] { detail::require_register_count("decode kernel", built, 168); },
                 {"decode kernel", std::to_string(built).c_str(), "exactly 168"},
                 ErrorCode::cuda_error);
}

#ifndef FP8MLA_WITH_CUDA
TEST(ValidationDevice, CudaMergeWithoutCudaIsUnsupported) {
  MergeInput in;
  for (TensorView* t : {&in.tv, &in.ts, &in.tv_out, &in.ts_out}) t->device = DeviceKind::cuda;
  expect_error([&] { in.merge(); }, {"CUDA"}, ErrorCode::unsupported);
}
#endif

}  // namespace
}  // namespace fp8mla
