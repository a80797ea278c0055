// Graph mode as serving engines use it (GPU; every test GTEST_SKIPs without a device):
//  * a borrowed page table (Problem::borrowed_kv_indices) is read by the captured kernels at
//    replay, so an in-place rewrite of the caller's buffer between replays is seen;
//  * the stream-ordered replan(p, problem, stream) returns while the stream is still busy (no
//    host synchronisation), and the run queued after it on that stream computes the new batch.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using gputest::CapturedGraph;
using gputest::check_cuda;
using gputest::device_args;
using gputest::DeviceBuffer;
using gputest::DeviceOutput;
using gputest::expect_matches;
using gputest::reference;
using gputest::TestStream;
using gputest::with_new_lengths;

test::ProblemSpec engine_spec(KvFormat format, int heads, int page_size, std::uint64_t seed) {
  test::ProblemSpec s;
  s.format = format;
  s.num_heads = heads;
  s.page_size = page_size;
  s.batch = 6;
  s.kv_len_min = 1;
  s.kv_len_max = 2000;
  s.spare_pages = 600;  // room for with_new_lengths' longer contexts
  s.poison_unused = false;
  s.seed = seed;
  return s;
}

PlanOptions graph_options(const test::RandomCase& c) {
  PlanOptions o;
  o.cuda_graph = true;
  o.max_batch = 8;
  o.max_total_q = 8;
  o.max_qo_len = 1;
  o.max_kv_indices = 2 * c.num_pages;
  return o;
}

// The pool twice over: pages [P, 2P) hold copies of pages [0, P).
std::vector<std::uint8_t> doubled_pool(const test::RandomCase& c) {
  std::vector<std::uint8_t> pool(c.cache);
  pool.insert(pool.end(), c.cache.begin(), c.cache.end());
  return pool;
}

// A captured run reads the borrowed device page table at replay: after the ids are moved in
// place to the second copy of every page and the first copies are overwritten with NaN, the
// replay still matches the reference (a stale table would read NaN pages). Five families: fp8
// <= 16 rows (TMA, page 16), fp8 and bf16 gather (page 1), bf16 and fp8 wide rows (128 heads).
TEST(CudaEngineGraph, ReplayReadsTheBorrowedPageTableRewrittenInPlace) {
  SKIP_WITHOUT_GPU();
  const struct {
    KvFormat f;
    int heads, page_size;
  } kinds[] = {{KvFormat::fp8_e4m3, 16, 16},
               {KvFormat::fp8_e4m3, 8, 1},
               {KvFormat::bf16, 8, 1},
               {KvFormat::bf16, 128, 64},
               {KvFormat::fp8_e4m3, 128, 64}};
  for (const auto& k : kinds) {
    SCOPED_TRACE(std::string(format_name(k.f)) + ", heads " + std::to_string(k.heads) + ", page " +
                 std::to_string(k.page_size));
    test::RandomCase c = test::make_case(engine_spec(k.f, k.heads, k.page_size, 71));
    const std::vector<std::uint8_t> pool = doubled_pool(c);
    DeviceBuffer cache(pool), q(c.q);
    std::vector<std::int32_t> table = c.kv_indices;
    table.resize(static_cast<std::size_t>(2 * c.num_pages), 0);  // the engine's capacity
    DeviceBuffer d_table(table);

    Problem p = c.problem(DeviceKind::cuda);
    p.num_pages = 2 * c.num_pages;
    p.kv_indices = {};
    p.borrowed_kv_indices.data = d_table.ptr;
    p.borrowed_kv_indices.dtype = DType::i32;
    p.borrowed_kv_indices.ndim = 1;
    p.borrowed_kv_indices.shape[0] = static_cast<std::int64_t>(table.size());
    p.borrowed_kv_indices.stride[0] = 1;
    p.borrowed_kv_indices.device = DeviceKind::cuda;
    const Plan pl = plan(p, graph_options(c));

    DeviceOutput d(c, 64);
    RunArgs args = device_args(c, cache, q, d);
    args.kv = c.kv_view(cache.ptr, DeviceKind::cuda);
    // The view of the doubled pool: the same strides, twice the pages.
    args.kv.ckv.shape[0] = 2 * c.num_pages;
    if (args.kv.kpe.defined()) args.kv.kpe.shape[0] = 2 * c.num_pages;
    TestStream stream;
    args.stream = stream.s;
    CapturedGraph graph(stream.s, [&] { run(pl, args); });
    graph.replay();
    test::HostOutput ref = reference(c);
    expect_matches(d, ref, "replay of the planned table");

    // Move the ids to the copies and destroy the originals (NaN in every byte pattern: 0xff is
    // e4m3 NaN and a bf16 NaN pair).
    for (std::size_t i = 0; i < c.kv_indices.size(); ++i) {
      table[i] = static_cast<std::int32_t>(c.kv_indices[i] + c.num_pages);
    }
    detail::cuda_copy_to_device(d_table.ptr, table.data(), table.size() * sizeof(std::int32_t));
    check_cuda(cudaMemset(cache.ptr, 0xff, c.cache.size()));
    d.poison_all();
    graph.replay();
    expect_matches(d, ref, "replay after the table was rewritten in place");
  }
}

// The stream-ordered replan returns while the stream is held: a host function queued on it
// blocks until the test releases it (or 10 s pass), so a replan that waited for the stream or
// the device would take 10 s. The run queued after it computes the new batch. Then a second and
// third replan in a row (both staging slots, then the first again) stay correct.
TEST(CudaEngineGraph, StreamOrderedReplanDoesNotWaitForTheStream) {
  SKIP_WITHOUT_GPU();
  for (const bool borrowed : {false, true}) {
    SCOPED_TRACE(borrowed ? "borrowed page table" : "host page table");
    test::RandomCase c1 = test::make_case(engine_spec(KvFormat::fp8_e4m3, 16, 16, 73));
    DeviceBuffer cache(c1.cache), q(c1.q);
    std::vector<std::int32_t> table(static_cast<std::size_t>(2 * c1.num_pages), 0);
    std::copy(c1.kv_indices.begin(), c1.kv_indices.end(), table.begin());
    DeviceBuffer d_table(table);
    auto problem = [&](test::RandomCase& c) {
      Problem p = c.problem(DeviceKind::cuda);
      if (borrowed) {
        p.kv_indices = {};
        p.borrowed_kv_indices.data = d_table.ptr;
        p.borrowed_kv_indices.dtype = DType::i32;
        p.borrowed_kv_indices.ndim = 1;
        p.borrowed_kv_indices.shape[0] = static_cast<std::int64_t>(table.size());
        p.borrowed_kv_indices.stride[0] = 1;
        p.borrowed_kv_indices.device = DeviceKind::cuda;
      }
      return p;
    };
    Plan pl = plan(problem(c1), graph_options(c1));
    DeviceOutput d(c1, 32);
    RunArgs args = device_args(c1, cache, q, d);
    TestStream stream;
    args.stream = stream.s;

    test::RandomCase c2 = with_new_lengths(c1, 3000, 91);
    DeviceBuffer c2_ids(c2.kv_indices);  // allocated and uploaded before the stream is held
    std::atomic<bool> release{false};
    struct Hold {
      std::atomic<bool>* release;
      static void CUDART_CB wait(void* self) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!static_cast<Hold*>(self)->release->load() &&
               std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
    } hold{&release};
    check_cuda(cudaLaunchHostFunc(stream.s, &Hold::wait, &hold));

    if (borrowed) {
      // The engine writes the step's page ids into its buffer on the same stream (a device copy:
      // nothing here may wait for the held stream).
      check_cuda(cudaMemcpyAsync(d_table.ptr, c2_ids.ptr, c2_ids.bytes, cudaMemcpyDeviceToDevice,
                                 stream.s));
    }
    const auto start = std::chrono::steady_clock::now();
    replan(pl, problem(c2), stream.s);
    const double host_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const cudaError_t busy = cudaStreamQuery(stream.s);
    run(pl, args);
    release.store(true);
    check_cuda(cudaStreamSynchronize(stream.s));
    EXPECT_EQ(busy, cudaErrorNotReady) << "the stream finished before replan() returned";
    EXPECT_LT(host_ms, 1000.0) << "replan() waited for the held stream";
    std::printf("stream-ordered replan: %.1f us of host time\n", 1000.0 * host_ms);
    test::HostOutput ref2 = reference(c2);
    expect_matches(d, ref2, "the run queued after the stream-ordered replan");

    // Two more steps, back to back on the stream: slot 1, then slot 0 again.
    for (std::uint64_t seed : {92u, 93u}) {
      test::RandomCase cn = with_new_lengths(c1, 3000, seed);
      if (borrowed) {
        check_cuda(cudaMemcpyAsync(d_table.ptr, cn.kv_indices.data(),
                                   cn.kv_indices.size() * sizeof(std::int32_t),
                                   cudaMemcpyHostToDevice, stream.s));
        check_cuda(cudaStreamSynchronize(stream.s));  // the host vector dies with cn
      }
      replan(pl, problem(cn), stream.s);
      d.poison_all();
      run(pl, args);
      check_cuda(cudaStreamSynchronize(stream.s));
      test::HostOutput refn = reference(cn);
      expect_matches(d, refn, "replan " + std::to_string(seed));
    }
  }
}

// A device page table (device_kv_indices) needs a host round trip to be checked: the
// stream-ordered replan refuses it, naming it.
TEST(CudaEngineGraph, StreamOrderedReplanRefusesADevicePageTable) {
  SKIP_WITHOUT_GPU();
  test::RandomCase c = test::make_case(engine_spec(KvFormat::fp8_e4m3, 16, 16, 75));
  Plan pl = plan(c.problem(DeviceKind::cuda), graph_options(c));
  DeviceBuffer d_table(c.kv_indices);
  Problem p = c.problem(DeviceKind::cuda);
  p.kv_indices = {};
  p.device_kv_indices.data = d_table.ptr;
  p.device_kv_indices.dtype = DType::i32;
  p.device_kv_indices.ndim = 1;
  p.device_kv_indices.shape[0] = static_cast<std::int64_t>(c.kv_indices.size());
  p.device_kv_indices.stride[0] = 1;
  p.device_kv_indices.device = DeviceKind::cuda;
  TestStream stream;
  try {
    replan(pl, p, stream.s);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device_kv_indices"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace fp8mla
