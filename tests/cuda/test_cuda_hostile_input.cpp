// Hostile input on CUDA plans, caches and merges: the bad-input cases of
// tests/cpu/test_hostile_input.cpp and test_empty_input.cpp with device tensors. Each bad call
// must end in fp8mla::Error before any kernel touches memory (run these under compute-sanitizer
// memcheck too), leave the caller's outputs as they were, and empty input must be a no-op or give
// o = 0, lse = -inf. Also the shared-plan contract on CUDA: runs of one plan from several host
// threads on one stream are ordered there, so each gives its single-run result.
// They GTEST_SKIP when no CUDA device is visible (CI), and run on the device machine.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/limits.h"
#include "tests/common/expect_error.h"
#include "tests/common/test_util.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using gputest::DeviceBuffer;
using gputest::DeviceOutput;
using test::expect_error;
constexpr DeviceKind kCuda = DeviceKind::cuda;

// A small dense fp8_e4m3 case with split requests, its device copies and poisoned outputs.
struct DeviceCase {
  test::RandomCase c;
  DeviceBuffer cache, q;
  DeviceOutput d;
  explicit DeviceCase(std::uint64_t seed = 1)
      : c(test::make_case(spec(seed))), cache(c.cache), q(c.q), d(c, 256) {}
  static test::ProblemSpec spec(std::uint64_t seed) {
    test::ProblemSpec s;
    s.batch = 3;
    s.num_heads = 8;
    s.page_size = 16;
    s.kv_len_min = 600;
    s.kv_len_max = 1200;
    s.seed = seed;
    return s;
  }
  Plan make(PlanOptions o = {}) const { return plan(c.problem(kCuda), o); }
  RunArgs args() const { return gputest::device_args(c, cache, q, d); }
  // True when out and lse (with their guards) hold only poison: nothing was written.
  bool untouched() const {
    for (const std::uint16_t v : d.out.to_host<std::uint16_t>())
      if (v != test::kPoisonBf16) return false;
    for (const float v : d.lse.to_host<float>())
      if (std::bit_cast<std::uint32_t>(v) != test::kPoisonF32) return false;
    return true;
  }
};

TEST(CudaHostile, PlanBoundsComeBeforeAnyDeviceMemory) {
  SKIP_WITHOUT_GPU();
  DeviceCase dc;
  auto with = [&](auto set) {
    return [&dc, set] {
      PlanOptions o;
      Problem p = dc.c.problem(kCuda);
      set(p, o);
      (void)plan(p, o);
    };
  };
  std::vector<std::int32_t> huge_qo{0, INT_MAX}, none{0, 0}, zero{0}, empty;
  expect_error(with([&](Problem& p, PlanOptions&) {
                 p.num_heads = 128;
                 p.qo_indptr = huge_qo;
                 p.kv_indptr = none;
                 p.kv_indices = empty;
                 p.kv_len = zero;
                 p.causal = false;
               }),
               {"qo_indptr[1]", "4194304"});
  expect_error(with([](Problem&, PlanOptions& o) { o.sm_count = 1000000; }),
               {"options.sm_count", "[0, 4096]"});
  expect_error(with([](Problem&, PlanOptions& o) { o.ctas_per_sm = 1000; }),
               {"options.ctas_per_sm", "[0, 32]"});
  expect_error(with([](Problem& p, PlanOptions&) { p.sm_scale = 3.4e38f; }),
               {"sm_scale", "(0, 65536]"});
  // Before: a graph plan of max_kv_indices 2^40 asked cudaMalloc for 4 TiB.
  expect_error(with([](Problem&, PlanOptions& o) {
                 o.cuda_graph = true;
                 o.max_batch = 3;
                 o.max_total_q = 3;
                 o.max_kv_indices = std::int64_t{1} << 40;
               }),
               {"options.max_kv_indices", "2147483647"});
  expect_error(with([](Problem&, PlanOptions& o) {
                 o.cuda_graph = true;
                 o.max_batch = 3;
                 o.max_total_q = 1 << 20;
                 o.max_kv_indices = 1 << 12;
               }),
               {"options.max_total_q", "4194304"});
  // shard_context() of a CUDA problem reads the same arrays on the host.
  std::vector<std::int32_t> bad_indptr{1000, 1001, 1002, 1003};
  Problem p = dc.c.problem(kCuda);
  p.kv_indptr = bad_indptr;
  ContextShard shard;
  expect_error([&] { shard_context(p, 0, 2, shard); }, {"problem.kv_indptr[0]", "must be 0"});
}

TEST(CudaHostile, RunTensorsOutOfRangeWriteNothing) {
  SKIP_WITHOUT_GPU();
  DeviceCase dc;
  const Plan p = dc.make();
  ASSERT_GT(p.partial_rows(), 0) << "the case must use the split-KV workspace";
  struct Case {
    void (*set)(RunArgs&);
    const char* argument;
    const char* bound;
  };
  const Case cases[] = {
      {[](RunArgs& a) { a.q_nope.ndim = 1 << 24; }, "q_nope.ndim", "outside [0, 4]"},
      {[](RunArgs& a) { a.lse.ndim = 5; }, "lse.ndim", "outside [0, 4]"},
      {[](RunArgs& a) { a.out.shape[2] = -512; }, "out.shape[2]", "negative"},
      {[](RunArgs& a) { a.q_pe.stride[0] = std::int64_t{1} << 62; }, "q_pe.stride[0]",
       "int64 byte range"},
      {[](RunArgs& a) { a.out.stride[1] = 0; }, "out.stride[1]", "overlap"},
      {[](RunArgs& a) { a.lse.stride[0] = 0; }, "lse.stride[0]", "overlap"},
      {[](RunArgs& a) { a.q_nope.device = DeviceKind::cpu; }, "q_nope.device", "expected cuda"},
      {[](RunArgs& a) { a.out.device_id = 7; }, "out.device", "cuda:7"},
      {[](RunArgs& a) { a.kv.ckv_scale = 1e36f; }, "kv.ckv_scale", "FLT_MAX / 448"},
      {[](RunArgs& a) { a.kv.kpe.shape[0] = 1; }, "kv.kpe.shape[0]", "expected"},
  };
  for (const Case& k : cases) {
    RunArgs a = dc.args();
    k.set(a);
    expect_error([&] { run(p, a); }, {k.argument, k.bound});
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(dc.untouched()) << k.argument << ": a rejected run wrote its outputs";
  }
  // A plan of no query tokens still checks its tensors (before: q of 5 tokens ran nothing).
  std::vector<std::int32_t> no_tokens(dc.c.qo_indptr.size(), 0);
  Problem none = dc.c.problem(kCuda);
  none.qo_indptr = no_tokens;
  none.causal = false;
  const Plan empty = plan(none);
  expect_error([&] { run(empty, dc.args()); }, {"q_nope.shape[0]", "expected 0"});
  EXPECT_TRUE(dc.untouched());
}

// Empty input: no requests, no query tokens, no context, with null pointers and stride 0.
TEST(CudaHostile, EmptyInputIsValid) {
  SKIP_WITHOUT_GPU();
  std::vector<std::int32_t> qo{0}, kvp{0}, none;
  Problem p;
  p.num_heads = 8;
  p.page_size = 16;
  p.num_pages = 4;
  p.sm_scale = 0.1f;
  p.device = kCuda;
  p.qo_indptr = qo;
  p.kv_indptr = kvp;
  const Plan no_requests = plan(p);
  EXPECT_EQ(no_requests.batch(), 0);
  DeviceBuffer pool(4 * 16 * 576);
  RunArgs a;
  a.q_nope = make_strided_view(nullptr, DType::bf16, {0, 8, 512}, {0, 0, 0}, kCuda);
  a.q_pe = make_strided_view(nullptr, DType::bf16, {0, 8, 64}, {0, 0, 0}, kCuda);
  a.out = make_strided_view(nullptr, DType::bf16, {0, 8, 512}, {0, 0, 0}, kCuda);
  a.kv.format = KvFormat::fp8_e4m3;
  a.kv.ckv = make_strided_view(pool.ptr, DType::u8, {4, 16, 512}, {16 * 576, 576, 1}, kCuda);
  a.kv.kpe = make_strided_view(static_cast<std::uint8_t*>(pool.ptr) + 512, DType::u8, {4, 16, 64},
                               {16 * 576, 576, 1}, kCuda);
  EXPECT_NO_THROW(run(no_requests, a));

  // Requests without context (every kv_len 0, an empty page table): o = 0, lse = -inf.
  std::vector<std::int32_t> qo3{0, 1, 3}, kvp3{0, 0, 0}, len{0, 0};
  p.qo_indptr = qo3;
  p.kv_indptr = kvp3;
  p.kv_indices = none;
  p.kv_len = len;
  const Plan no_context = plan(p);
  DeviceBuffer q(3 * 8 * 576 * 2), out(3 * 8 * 512 * 2), lse(3 * 8 * 4);
  std::vector<std::uint16_t> poison(3 * 8 * 512, test::kPoisonBf16);
  detail::cuda_copy_to_device(out.ptr, poison.data(), out.bytes);
  a.q_nope = make_strided_view(q.ptr, DType::bf16, {3, 8, 512}, {8 * 576, 576, 1}, kCuda);
  a.q_pe = make_strided_view(static_cast<std::uint16_t*>(q.ptr) + 512, DType::bf16, {3, 8, 64},
                             {8 * 576, 576, 1}, kCuda);
  a.out = make_view(out.ptr, DType::bf16, {3, 8, 512}, kCuda);
  a.lse = make_view(lse.ptr, DType::f32, {3, 8}, kCuda);
  run(no_context, a);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const std::uint16_t v : out.to_host<std::uint16_t>()) ASSERT_EQ(v, 0);
  for (const float v : lse.to_host<float>()) ASSERT_EQ(v, -INFINITY);

  // merge_states() of no rows (null pointers) and of no states (v_out = 0, s_out = -inf).
  EXPECT_NO_THROW(merge_states(make_view(nullptr, DType::f32, {0, 3, 16}, kCuda),
                               make_view(nullptr, DType::f32, {0, 3}, kCuda),
                               make_view(nullptr, DType::f32, {0, 16}, kCuda), {}));
  DeviceBuffer vo(3 * 16 * 4), so(3 * 4);
  merge_states(make_strided_view(nullptr, DType::f32, {3, 0, 16}, {0, 0, 1}, kCuda),
               make_strided_view(nullptr, DType::f32, {3, 0}, {0, 0}, kCuda),
               make_view(vo.ptr, DType::f32, {3, 16}, kCuda),
               make_view(so.ptr, DType::f32, {3}, kCuda));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const float v : vo.to_host<float>()) ASSERT_EQ(v, 0.0f);
  for (const float v : so.to_host<float>()) ASSERT_EQ(v, -INFINITY);

  // Appending nothing to a device cache.
  PagedLatentCache cache({.num_pages = 2, .page_size = 4, .device = kCuda});
  EXPECT_NO_THROW(cache.append(make_view(nullptr, DType::i32, {0}, kCuda),
                               make_view(nullptr, DType::bf16, {0, 512}, kCuda),
                               make_view(nullptr, DType::bf16, {0, 64}, kCuda)));
}

// Before: 2^32 states were truncated to int (0 / -inf instead of the merge) on the device too.
TEST(CudaHostile, MergeStatesBounds) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer one(1 << 16), vo(16 * 4), so(4);
  auto merge = [&](std::int64_t rows, std::int64_t states, std::int64_t dim) {
    merge_states(make_strided_view(one.ptr, DType::f32, {rows, states, dim}, {0, 0, 1}, kCuda),
                 make_strided_view(one.ptr, DType::f32, {rows, states}, {0, 0}, kCuda),
                 make_strided_view(vo.ptr, DType::f32, {rows, dim}, {dim, 1}, kCuda),
                 make_strided_view(so.ptr, DType::f32, {rows}, {1}, kCuda));
  };
  expect_error([&] { merge(1, std::int64_t{1} << 32, 1); }, {"v.shape[1]", "4096"});
  expect_error([&] { merge(std::int64_t{1} << 62, 2, 1); }, {"v.shape[0]", "4194304"});
  expect_error([&] { merge(1 << 22, 4096, 4096); }, {"v", "values exceed"});
  expect_error(
      [&] {
        merge_states(make_view(one.ptr, DType::f32, {2, 3, 4}, kCuda),
                     make_view(one.ptr, DType::f32, {2, 3}, kCuda),
                     make_strided_view(vo.ptr, DType::f32, {2, 4}, {0, 1}, kCuda), {});
      },
      {"v_out.stride[0]", "overlap"});
}

TEST(CudaHostile, AppendBounds) {
  SKIP_WITHOUT_GPU();
  PagedLatentCache cache({.num_pages = 2, .page_size = 4, .device = kCuda});
  (void)cache.allocate(2);
  DeviceBuffer slots(64 * 4), ckv(64 * 512 * 4), kpe(64 * 64 * 4);
  TensorView s = make_view(slots.ptr, DType::i32, {1}, kCuda);
  TensorView c = make_view(ckv.ptr, DType::f32, {1, 512}, kCuda);
  TensorView k = make_view(kpe.ptr, DType::f32, {1, 64}, kCuda);
  TensorView neg = s;
  neg.shape[0] = -1;
  expect_error([&] { cache.append(neg, c, k); }, {"slots.shape[0]", "negative"});
  TensorView rank = s;
  rank.ndim = 1 << 24;
  expect_error([&] { cache.append(rank, c, k); }, {"slots.ndim", "outside [0, 4]"});
  // More tokens than the pool has slots (8 here), rows of stride 0.
  expect_error(
      [&] {
        cache.append(make_view(slots.ptr, DType::i32, {9}, kCuda),
                     make_strided_view(ckv.ptr, DType::f32, {9, 512}, {0, 1}, kCuda),
                     make_strided_view(kpe.ptr, DType::f32, {9, 64}, {0, 1}, kCuda));
      },
      {"slots.shape[0]", "9 tokens exceed the pool's 8 slots"});
}

// The CUDA contract for shared plans: runs of one plan ordered on one stream, from several host
// threads at once, each into its own output with its own queries, give their single-run results
// (the split-KV workspace is used by one run at a time in stream order).
TEST(CudaHostile, OnePlanFromManyThreadsOnOneStream) {
  SKIP_WITHOUT_GPU();
  constexpr int kThreads = 4;
  std::vector<std::unique_ptr<DeviceCase>> layers;
  for (int t = 0; t < kThreads; ++t) {  // one batch and cache, other queries
    layers.push_back(std::make_unique<DeviceCase>(7));
    std::vector<std::uint16_t>& q = layers[t]->c.q;
    std::rotate(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(t * 4099 % q.size()), q.end());
    detail::cuda_copy_to_device(layers[t]->q.ptr, q.data(), layers[t]->q.bytes);
  }
  const Plan p = layers[0]->make();
  ASSERT_GT(p.partial_rows(), 0);
  gputest::TestStream stream;
  std::vector<std::vector<std::uint16_t>> want(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    RunArgs a = layers[t]->args();
    a.stream = stream.s;
    run(p, a);
    ASSERT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
    want[t] = layers[t]->d.out.to_host<std::uint16_t>();
  }
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  std::vector<int> errors(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      RunArgs a = layers[t]->args();
      a.stream = stream.s;
      for (int i = 0; i < 5; ++i) {
        try {
          run(p, a);
        } catch (const std::exception&) {
          ++errors[t];
        }
      }
    });
  }
  for (std::thread& t : pool) t.join();
  ASSERT_EQ(cudaStreamSynchronize(stream.s), cudaSuccess);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[t], 0);
    EXPECT_EQ(layers[t]->d.out.to_host<std::uint16_t>(), want[t]) << "thread " << t;
  }
}

}  // namespace
}  // namespace fp8mla
