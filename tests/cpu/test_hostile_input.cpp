// Hostile input: what an adversarial caller hands the public API (issue 35's reproducers and
// their neighbours). Every call must end in fp8mla::Error naming the argument and the bound,
// quickly and without touching memory it does not own: no crash, no other exception type, no
// gigabytes asked for from a few bytes of input, no silent wrong answer. The bounds are those of
// include/fp8mla/limits.h; fuzz/ drives the same entry points with random input.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "fp8mla/limits.h"
#include "tests/common/expect_error.h"
#include "tests/common/small_problem.h"

namespace fp8mla {
namespace {

using I32 = std::vector<std::int32_t>;
using test::expect_error;

// ---- shard_context(): it reads the index arrays before any plan() sees them ----

// SmallProblem cut to one dense request of one token over one cached token (pages of 4, a pool
// of 16), not causal, unless a test changes it.
struct Full : test::SmallProblem {
  Full() {
    qo_indptr = {0, 1};
    kv_indptr = {0, 1};
    kv_indices = {0};
    kv_len = {1};
    p.causal = false;
  }
  void shard(int rank = 0, int world = 2) {
    ContextShard s;
    shard_context(problem(), rank, world, s);
  }
};

// Before: [INT_MIN, 0] overflowed signed arithmetic, [1000, 1001] read past kv_indices (a heap
// buffer overflow; a release build returned a garbage page id), [-100000, -99999] crashed.
TEST(HostileShardContext, KvIndptrMustStartAtZero) {
  for (const I32& bad : {I32{INT_MIN, 0}, I32{1000, 1001}, I32{-100000, -99999}}) {
    Full f;
    f.kv_indptr = bad;
    expect_error([&] { f.shard(); }, {"problem.kv_indptr[0]", "must be 0"});
  }
}

TEST(HostileShardContext, KvIndptrMustEndAtKvIndicesAndNotDecrease) {
  Full past;
  past.kv_indptr = {0, 5};  // one index given
  expect_error([&] { past.shard(); }, {"problem.kv_indptr[1]", "kv_indices.size() = 1"});
  Full order;
  order.qo_indptr = {0, 1, 2};
  order.kv_indptr = {0, 2, 1};
  order.kv_indices = {0};
  order.kv_len = {1, 1};
  expect_error([&] { order.shard(); }, {"problem.kv_indptr[2]", "non-decreasing"});
  Full listed;  // 5 tokens need 2 pages of 4, 1 is listed
  listed.kv_len = {5};
  expect_error([&] { listed.shard(); }, {"problem.kv_len[0]", "1 pages listed"});
}

TEST(HostileShardContext, QoIndptrAndScalars) {
  Full start;
  start.qo_indptr = {3, 4};
  expect_error([&] { start.shard(); }, {"problem.qo_indptr[0]", "must be 0"});
  Full order;
  order.qo_indptr = {0, INT_MIN};
  expect_error([&] { order.shard(); }, {"problem.qo_indptr[1]", "non-decreasing"});
  Full empty;
  empty.qo_indptr = {};
  expect_error([&] { empty.shard(); }, {"problem.qo_indptr", ">= 1 entries"});
  Full page;
  page.p.page_size = 3;
  expect_error([&] { page.shard(); }, {"problem.page_size", "power of two"});
  Full rows;  // 2^31 - 1 query tokens x 8 heads
  rows.qo_indptr = {0, INT_MAX};
  expect_error([&] { rows.shard(); }, {"problem.qo_indptr[1]", "4194304"});
}

// A borrowed page table (Problem::borrowed_kv_indices) leaves kv_indices empty: shard_context()
// would index past it. It is refused by name.
TEST(HostileShardContext, BorrowedPageTableIsRefused) {
  Full f;
  I32 table{0};
  f.p.borrowed_kv_indices = make_view(table.data(), DType::i32, {1});
  f.kv_indices = {};
  expect_error([&] { f.shard(); }, {"problem.borrowed_kv_indices", "give kv_indices"});
}

// The full table may list other ranks' pages with ids of their pools (or placeholders): only the
// pages a rank holds are checked, by its own plan().
TEST(HostileShardContext, OtherRanksPageIdsAreTheirs) {
  Full f;
  f.kv_indptr = {0, 2};
  f.kv_indices = {3, -1};  // page 1 is rank 1's
  f.kv_len = {8};
  ContextShard s;
  shard_context(f.problem(), 0, 2, s);
  EXPECT_EQ(s.kv_indices, I32{3});
  EXPECT_NO_THROW((void)plan(s.problem));
  shard_context(f.p, 1, 2, s);
  expect_error([&] { (void)plan(s.problem); }, {"kv_indices[0]", "outside the pool"});
}

// ---- views whose ndim or extents are out of range ----

// Before: describe() looped ndim times over the 4-entry shape and stride arrays (ndim 5 printed
// what follows them; ndim 1 << 24 crashed run() and append() while building their message).
TEST(HostileTensorView, DescribeReadsAtMostFourDimensions) {
  TensorView t;
  t.ndim = 5;
  t.shape = {1, 2, 3, 4};
  t.stride = {24, 12, 4, 1};
  EXPECT_EQ(t.describe(),
            "u8[1, 2, 3, 4, ...: ndim 5 is outside [0, 4]] strides [24, 12, 4, 1] on cpu");
  t.ndim = 1 << 24;
  EXPECT_NE(t.describe().find("ndim 16777216 is outside [0, 4]"), std::string::npos);
  t.ndim = -3;
  EXPECT_EQ(t.describe(), "u8[...: ndim -3 is outside [0, 4]] strides [] on cpu");
  EXPECT_EQ(t.numel(), 0);  // undefined (null data)
}

// Host tensors of a 2-request plan (fp8_e4m3, 16 pages of 4, 3 query tokens x 8 heads).
// SmallProblem with its run's buffers: q, out, lse and an fp8_e4m3 pool (zeros), as RunArgs.
struct RunInput : test::SmallProblem {
  std::vector<std::uint16_t> q_nope = std::vector<std::uint16_t>(3 * 8 * 512);
  std::vector<std::uint16_t> q_pe = std::vector<std::uint16_t>(3 * 8 * 64);
  std::vector<std::uint16_t> out = std::vector<std::uint16_t>(3 * 8 * 512);
  std::vector<float> lse = std::vector<float>(3 * 8);
  std::vector<std::uint8_t> cache = std::vector<std::uint8_t>(16 * 4 * 576);
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
  Plan make() { return plan(problem(), o); }
  void run_it() { run(make(), a); }
};

TEST(HostileTensorView, NdimOutOfRangeIsAnError) {
  for (const int ndim : {1 << 24, 5, -1}) {
    RunInput in;
    in.a.q_nope.ndim = ndim;
    expect_error([&] { in.run_it(); }, {"q_nope.ndim", "is outside [0, 4]"});
    RunInput lse;
    lse.a.lse.ndim = ndim;
    expect_error([&] { lse.run_it(); }, {"lse.ndim", "is outside [0, 4]"});
  }
  PagedLatentCache cache({.num_pages = 2, .page_size = 4});
  (void)cache.allocate(2);
  I32 slots{0};
  std::vector<float> ckv(512), kpe(64);
  TensorView s = make_view(slots.data(), DType::i32, {1});
  s.ndim = 1 << 24;
  expect_error(
      [&] {
        cache.append(s, make_view(ckv.data(), DType::f32, {1, 512}),
                     make_view(kpe.data(), DType::f32, {1, 64}));
      },
      {"slots.ndim", "is outside [0, 4]"});
}

// Before: an extent of -1 made append() ask for a vector of 2^64 - 576 floats (length_error).
TEST(HostileTensorView, NegativeExtentIsAnError) {
  PagedLatentCache cache({.num_pages = 2, .page_size = 4});
  (void)cache.allocate(2);
  I32 slots{0};
  std::vector<float> ckv(512), kpe(64);
  TensorView s = make_view(slots.data(), DType::i32, {1});
  s.shape[0] = -1;
  TensorView c = make_view(ckv.data(), DType::f32, {1, 512});
  c.shape[0] = -1;
  TensorView k = make_view(kpe.data(), DType::f32, {1, 64});
  k.shape[0] = -1;
  expect_error([&] { cache.append(s, c, k); }, {"slots.shape[0]", "extent -1 is negative"});
  RunInput in;
  in.a.out.shape[2] = -512;
  expect_error([&] { in.run_it(); }, {"out.shape[2]", "negative"});
}

// Strides whose element offsets leave the int64 byte range are refused before any address is
// computed from them.
TEST(HostileTensorView, OffsetsBeyondInt64AreAnError) {
  RunInput in;
  in.a.q_nope.stride[0] = std::int64_t{1} << 62;
  expect_error([&] { in.run_it(); }, {"q_nope.stride[0]", "int64 byte range"});
}

// Before: a stride of an extent of 1 passed (no index reaches it), and the CPU reader's byte
// stride overflowed (fuzz_run found it: signed overflow in KvReader::byte_stride).
TEST(HostileTensorView, StridesBeyondInt64BytesAreAnErrorAlsoOnExtentsOfOne) {
  RunInput in;
  std::vector<std::uint16_t> cache(16 * 576);
  in.p.page_size = 1;
  in.p.kv_format = KvFormat::bf16;
  in.kv_len = {2, 3};
  in.a.kv.format = KvFormat::bf16;
  in.a.kv.ckv = make_strided_view(cache.data(), DType::bf16, {16, 1, 512}, {576, 576, 1});
  in.a.kv.kpe = make_strided_view(cache.data() + 512, DType::bf16, {16, 1, 64}, {576, 576, 1});
  in.run_it();  // the same views with sane strides run
  in.a.kv.ckv.stride[1] = std::int64_t{3} << 61;  // 2 bytes each: 3 * 2^62 bytes
  expect_error([&] { in.run_it(); }, {"kv.ckv.stride[1]", "int64 byte range"});
}

// ---- work and memory from small inputs ----

// Before: [0, 2^31 - 1] made plan() ask for 4 GiB of tiles (bad_alloc, or minutes).
TEST(HostileBounds, QueryRowsOfAPlan) {
  for (const int heads : {1, 128}) {
    RunInput in;
    in.p.num_heads = heads;
    in.p.causal = false;
    in.qo_indptr = {0, INT_MAX};
    in.kv_indptr = {0, 0};
    in.kv_indices = {};
    in.kv_len = {0};
    const auto start = std::chrono::steady_clock::now();
    expect_error([&] { (void)in.make(); },
                 {"qo_indptr[1]", "total_q x num_heads", "4194304", "limits.h"});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  }
  RunInput at;  // the bound itself plans (one request of 2^22 / 128 tokens, no context)
  at.p.num_heads = 128;
  at.p.causal = false;
  at.qo_indptr = {0, static_cast<std::int32_t>(kMaxRows / 128)};
  at.kv_indptr = {0, 0};
  at.kv_indices = {};
  at.kv_len = {0};
  EXPECT_NO_THROW((void)at.make());
}

// Before: a CPU graph-mode plan with sm_count = 1e6 took 4.6 s and ~4 GB; INT_MAX asked for a
// 4 GiB workspace; num_threads = 100000 threw std::system_error from run().
TEST(HostileBounds, PlanOptions) {
  // Each case plain and in graph mode.
  auto check = [](void (*set)(PlanOptions&), std::initializer_list<const char*> needles) {
    for (const bool graph : {false, true}) {
      RunInput in;
      set(in.o);
      if (graph) {
        in.o.cuda_graph = true;
        in.o.max_batch = 2;
        in.o.max_total_q = 3;
        in.o.max_kv_indices = 5;
      }
      expect_error([&] { in.run_it(); }, needles);
    }
  };
  check([](PlanOptions& o) { o.sm_count = 1000000; }, {"options.sm_count", "[0, 4096]"});
  check([](PlanOptions& o) { o.sm_count = INT_MAX; }, {"options.sm_count", "[0, 4096]"});
  check([](PlanOptions& o) { o.ctas_per_sm = 33; }, {"options.ctas_per_sm", "[0, 32]"});
  check([](PlanOptions& o) { o.ctas_per_sm = INT_MAX; }, {"options.ctas_per_sm", "[0, 32]"});
  check(
      [](PlanOptions& o) {
        o.sm_count = 4096;
        o.ctas_per_sm = 2;
      },
      {"options.sm_count x options.ctas_per_sm", "8192", "4096"});
  check(
      [](PlanOptions& o) {
        o.sm_count = 0;  // the thread count
        o.num_threads = 1000;
        o.ctas_per_sm = 32;
      },
      {"options.sm_count x options.ctas_per_sm", "32000"});
  check([](PlanOptions& o) { o.num_threads = 100000; }, {"options.num_threads", "[0, 1024]"});
}

TEST(HostileBounds, GraphCapacities) {
  auto graph = [](RunInput& in) {
    in.o.cuda_graph = true;
    in.o.max_batch = 2;
    in.o.max_total_q = 3;
    in.o.max_kv_indices = 5;
  };
  RunInput pages;
  graph(pages);
  pages.o.max_kv_indices = std::int64_t{1} << 40;
  expect_error([&] { (void)pages.make(); }, {"options.max_kv_indices", "2147483647"});
  RunInput rows;  // 2^21 tokens x 8 heads
  graph(rows);
  rows.o.max_total_q = 1 << 21;
  expect_error([&] { (void)rows.make(); }, {"options.max_total_q", "x num_heads", "4194304"});
  RunInput batch;
  graph(batch);
  batch.o.max_batch = INT_MAX;
  expect_error([&] { (void)batch.make(); }, {"options.max_batch", "4194304"});
  RunInput sparse;  // 2^20 tokens x topk 2^12 = 2^32 index entries of capacity
  graph(sparse);
  sparse.p.num_heads = 1;
  sparse.o.max_total_q = 1 << 20;
  sparse.p.topk = 1 << 12;
  sparse.sparse_indices.assign(3 << 12, -1);
  expect_error([&] { (void)sparse.make(); }, {"x topk", "2147483647"});
}

// Before: sm_scale = 3.4e38 planned, and every output was NaN (the scores overflow float).
TEST(HostileBounds, SmScale) {
  for (const float scale : {3.4e38f, 65536.5f}) {
    RunInput in;
    in.p.sm_scale = scale;
    expect_error([&] { (void)in.make(); }, {"sm_scale", "(0, 65536]"});
  }
  RunInput at;
  at.p.sm_scale = kMaxSmScale;
  EXPECT_NO_THROW((void)at.make());
  // The kernels' factor sm_scale x kv scale x log2(e) must be a float.
  RunInput fold;
  fold.p.sm_scale = 60000.0f;
  fold.a.kv.ckv_scale = 1e34f;
  expect_error([&] { fold.run_it(); }, {"kv.ckv_scale", "overflows float"});
  RunInput codes;  // 448 x scale must be finite
  codes.a.kv.kpe_scale = 1e36f;
  expect_error([&] { codes.run_it(); }, {"kv.kpe_scale", "FLT_MAX / 448"});
}

TEST(HostileBounds, SparseIndexEntries) {
  RunInput in;
  in.p.topk = INT_MAX;  // 3 tokens x (2^31 - 1) entries
  expect_error([&] { (void)in.make(); }, {"topk", "total_q x topk", "2147483647"});
}

// merge_states() over stride-0 views: any shape in a few bytes. Before: 2^32 states truncated
// to int (output 0 / -inf instead of the answer); 2^31 states asked for 8 GiB (bad_alloc);
// rows = 2^62 overflowed rows x states x D.
TEST(HostileBounds, MergeStates) {
  std::vector<float> row(1 << 20, 0.0f), out(16, 0.0f), out_lse(1, 0.0f);
  auto merge = [&](std::int64_t rows, std::int64_t states, std::int64_t dim) {
    merge_states(make_strided_view(row.data(), DType::f32, {rows, states, dim}, {0, 0, 1}),
                 make_strided_view(row.data(), DType::f32, {rows, states}, {0, 0}),
                 make_strided_view(out.data(), DType::f32, {rows, dim}, {dim, 1}),
                 make_strided_view(out_lse.data(), DType::f32, {rows}, {1}));
  };
  expect_error([&] { merge(1, std::int64_t{1} << 32, 1); }, {"v.shape[1]", "4096"});
  expect_error([&] { merge(1, std::int64_t{1} << 31, 1); }, {"v.shape[1]", "4096"});
  expect_error([&] { merge(std::int64_t{1} << 62, 2, 1); }, {"v.shape[0]", "4194304"});
  expect_error([&] { merge(1, 2, std::int64_t{1} << 20); }, {"v.shape[2]", "65536"});
  expect_error([&] { merge(1 << 22, 4096, 4096); }, {"v", "values exceed", "68719476736"});
  // At the bounds' corner, one row of 4096 states: the merge of equal states is that state.
  std::fill(row.begin(), row.begin() + 16, 2.0f);
  merge(1, 4096, 16);
  EXPECT_EQ(out[0], 2.0f);
  EXPECT_EQ(out[15], 2.0f);
  EXPECT_NEAR(out_lse[0], 2.0f + std::log(4096.0f), 1e-4);
}

// Before: append() converted all n x 576 values into one buffer first, n unbounded (stride-0
// rows describe any number of tokens in a few bytes). A call writes each slot at most once.
TEST(HostileBounds, AppendWritesAtMostThePool) {
  PagedLatentCache cache({.num_pages = 2, .page_size = 4});
  (void)cache.allocate(2);
  const std::int64_t n = cache.capacity_tokens() + 1;
  I32 slots(static_cast<std::size_t>(n), 0);
  std::vector<float> ckv(512), kpe(64);
  expect_error(
      [&] {
        cache.append(make_view(slots.data(), DType::i32, {n}),
                     make_strided_view(ckv.data(), DType::f32, {n, 512}, {0, 1}),
                     make_strided_view(kpe.data(), DType::f32, {n, 64}, {0, 1}));
      },
      {"slots.shape[0]", "9 tokens exceed the pool's 8 slots"});
}

// ---- no silent wrong answers ----

// Before: run() of a plan with no query tokens checked nothing, so q of 5 tokens x 7 heads
// "ran" and the caller's output was left as it was (uninitialised memory in Python).
TEST(HostileRun, APlanOfNoQueryTokensStillChecksItsTensors) {
  RunInput in;
  in.p.num_heads = 7;
  in.qo_indptr = {0, 0, 0};
  in.a.q_nope = make_view(in.q_nope.data(), DType::bf16, {5, 7, 512});
  expect_error([&] { in.run_it(); }, {"q_nope.shape[0]", "expected 0", "got 5"});
  RunInput out;
  out.qo_indptr = {0, 0, 0};
  out.a.q_nope = make_view(out.q_nope.data(), DType::bf16, {0, 8, 512});
  out.a.q_pe = make_view(out.q_pe.data(), DType::bf16, {0, 8, 64});
  expect_error([&] { out.run_it(); }, {"out.shape[0]", "expected 0", "got 3"});
}

// An output whose elements share addresses would keep one of several results: refused.
TEST(HostileRun, OutputElementsMustNotOverlap) {
  RunInput heads;  // every head of a token on one row
  heads.a.out = make_strided_view(heads.out.data(), DType::bf16, {3, 8, 512}, {512, 0, 1});
  expect_error([&] { heads.run_it(); }, {"out.stride[1]", "overlap"});
  RunInput rows;  // rows shorter than their stride
  rows.a.out = make_strided_view(rows.out.data(), DType::bf16, {3, 8, 512}, {4096, 256, 1});
  expect_error([&] { rows.run_it(); }, {"out.stride[1]", "overlap"});
  RunInput lse;
  lse.a.lse = make_strided_view(lse.lse.data(), DType::f32, {3, 8}, {0, 1});
  expect_error([&] { lse.run_it(); }, {"lse.stride[0]", "overlap"});
  std::vector<float> v(2 * 3 * 4), s(2 * 3), v_out(4);
  expect_error(
      [&] {
        merge_states(make_view(v.data(), DType::f32, {2, 3, 4}),
                     make_view(s.data(), DType::f32, {2, 3}),
                     make_strided_view(v_out.data(), DType::f32, {2, 4}, {0, 1}), {});
      },
      {"v_out.stride[0]", "overlap"});
  // Extent-1 dimensions take any stride; distinct rows are fine.
  RunInput ok;
  ok.a.out = make_strided_view(ok.out.data(), DType::bf16, {3, 8, 512}, {4096, 512, 1});
  EXPECT_NO_THROW(ok.run_it());
}

}  // namespace
}  // namespace fp8mla
