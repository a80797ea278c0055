// GPU test helpers shared by tests/cuda: device copies of a case, poisoned device outputs with
// guard regions, streams and captured graphs, and the comparison with the CPU reference. Header
// only (each test file is its own translation unit of one binary; everything here is inline).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "src/core/backend.h"
#include "tests/common/test_util.h"

namespace fp8mla::gputest {

// The kernels' bounds (tests/cuda/test_cuda_grid.cpp says why): out's relative L2 error and
// lse's error |out - ref| / max(1, |ref|).
inline constexpr double kOutTol = 1e-2;
inline constexpr double kLseTol = 2e-3;

#define SKIP_WITHOUT_GPU()                                                          \
  do {                                                                              \
    if (fp8mla::detail::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// Device memory holding a copy of a host vector.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DeviceBuffer(std::size_t n, int device_id = 0)
      : ptr(detail::cuda_malloc(n, device_id)), bytes(n) {}
  template <class T>
  explicit DeviceBuffer(const std::vector<T>& host, int device_id = 0)
      : DeviceBuffer(host.size() * sizeof(T), device_id) {
    if (!host.empty()) detail::cuda_copy_to_device(ptr, host.data(), bytes);
  }
  ~DeviceBuffer() { detail::cuda_free(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  std::vector<T> to_host() const {
    std::vector<T> v(bytes / sizeof(T));
    detail::cuda_copy_to_host(v.data(), ptr, bytes);
    return v;
  }
};

inline void check_cuda(cudaError_t e) {
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
}

// A non-blocking stream for the test's lifetime.
struct TestStream {
  cudaStream_t s = nullptr;
  TestStream() { check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~TestStream() { check_cuda(cudaStreamDestroy(s)); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
};

// What `issue` launches on `stream`, captured into one CUDA graph; replay() runs it and waits.
class CapturedGraph {
 public:
  // mode: Global catches a stray synchronising call; ThreadLocal where other threads keep using
  // CUDA meanwhile (one thread a GPU).
  template <class Issue>
  CapturedGraph(cudaStream_t stream, Issue&& issue,
                cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal)
      : stream_(stream) {
    check_cuda(cudaStreamBeginCapture(stream, mode));
    issue();
    check_cuda(cudaStreamEndCapture(stream, &graph_));
    check_cuda(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    check_cuda(cudaGraphExecDestroy(exec_));
    check_cuda(cudaGraphDestroy(graph_));
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void replay() {
    check_cuda(cudaGraphLaunch(exec_, stream_));
    check_cuda(cudaStreamSynchronize(stream_));
  }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// The reference result of a case on the host.
inline test::HostOutput reference(test::RandomCase& c) {
  PlanOptions o;
  o.cpu_reference = true;
  test::HostOutput ref(c);
  run(plan(c.problem(), o), c.host_args(ref));
  return ref;
}

// Device outputs with poisoned guard regions of `guard` elements on both sides.
struct DeviceOutput {
  std::int64_t n_out, n_lse, guard;
  DeviceBuffer out, lse;
  DeviceOutput(const test::RandomCase& c, std::int64_t g, int device_id = 0)
      : n_out(c.rows() * kDimCkv),
        n_lse(c.rows()),
        guard(g),
        out((n_out + 2 * g) * 2, device_id),
        lse((n_lse + 2 * g) * 4, device_id) {
    poison_all();
  }
  void poison_all() {
    std::vector<std::uint16_t> o(static_cast<std::size_t>(n_out + 2 * guard));
    std::vector<float> l(static_cast<std::size_t>(n_lse + 2 * guard));
    test::poison(o);
    test::poison(l);
    detail::cuda_copy_to_device(out.ptr, o.data(), out.bytes);
    detail::cuda_copy_to_device(lse.ptr, l.data(), lse.bytes);
  }
  void* out_data() const { return static_cast<std::uint16_t*>(out.ptr) + guard; }
  void* lse_data() const { return static_cast<float*>(lse.ptr) + guard; }
};

// Run arguments over device copies of a case's cache and q, and device outputs.
inline RunArgs device_args(const test::RandomCase& c, const DeviceBuffer& cache,
                           const DeviceBuffer& q, const DeviceOutput& d, int device_id = 0) {
  RunArgs args;
  args.q_nope = c.q_nope_view(q.ptr, DeviceKind::cuda, device_id);
  args.q_pe = c.q_pe_view(q.ptr, DeviceKind::cuda, device_id);
  args.kv = c.kv_view(cache.ptr, DeviceKind::cuda, device_id);
  args.out = c.out_view(d.out_data(), DeviceKind::cuda, device_id);
  args.lse = c.lse_view(d.lse_data(), DeviceKind::cuda, device_id);
  return args;
}

// Bounds on a result: out's relative L2 error and lse's error (|out - ref| / max(1, |ref|)).
struct Tolerance {
  double out = kOutTol, lse = kLseTol;
};

// The guards around a device result's out and lse stayed poisoned (nothing was written outside
// them); fails at the first one that did not.
inline void expect_guards(const DeviceOutput& d, const std::string& what) {
  const auto out = d.out.to_host<std::uint16_t>();
  const auto lse = d.lse.to_host<float>();
  for (std::int64_t i = 0; i < d.guard; ++i) {
    ASSERT_EQ(out[i], test::kPoisonBf16) << what << ": wrote before out";
    ASSERT_EQ(out[d.guard + d.n_out + i], test::kPoisonBf16) << what << ": wrote after out";
    std::uint32_t a, b;
    std::memcpy(&a, &lse[i], 4);
    std::memcpy(&b, &lse[d.guard + d.n_lse + i], 4);
    ASSERT_EQ(a, test::kPoisonF32) << what << ": wrote before lse";
    ASSERT_EQ(b, test::kPoisonF32) << what << ": wrote after lse";
  }
}

// Compares a device result with the reference, and checks the guards stayed poisoned.
inline void expect_matches(const DeviceOutput& d, test::HostOutput& ref, const std::string& what,
                           Tolerance tol = {}) {
  const auto out = d.out.to_host<std::uint16_t>();
  const auto lse = d.lse.to_host<float>();
  const std::span<const std::uint16_t> out_core(out.data() + d.guard, d.n_out);
  const std::span<const float> lse_core(lse.data() + d.guard, d.n_lse);
  const test::Comparison co = test::compare_bf16(out_core, ref.out());
  const test::LseComparison cl = test::compare_lse(lse_core, ref.lse());
  // FP8MLA_TEST_ERRORS=1 prints every comparison (the measured errors quoted in this file).
  if (std::getenv("FP8MLA_TEST_ERRORS") != nullptr)
    std::printf("%s: %s; %s\n", what.c_str(), test::describe(co).c_str(),
                test::describe(cl).c_str());
  EXPECT_TRUE(co.nan_ok()) << what << ": " << test::describe(co);
  EXPECT_LE(co.rel_l2, tol.out) << what << ": " << test::describe(co);
  EXPECT_TRUE(cl.positions_ok()) << what << ": " << test::describe(cl);
  EXPECT_LE(cl.max_err, tol.lse) << what << ": " << test::describe(cl);
  expect_guards(d, what);
}

// c's pages in a random order (rng), for new page tables over the same pool.
inline std::vector<std::int32_t> shuffled_pages(const test::RandomCase& c, std::mt19937_64& rng) {
  std::vector<std::int32_t> pages(static_cast<std::size_t>(c.num_pages));
  for (std::size_t i = 0; i < pages.size(); ++i) pages[i] = static_cast<std::int32_t>(i);
  std::shuffle(pages.begin(), pages.end(), rng);
  return pages;
}

// c re-drawn for a graph replay: new lengths in [0, max_len] (0 where the pool runs out) and a new
// page table over the same pool, with the same q and total_q.
inline test::RandomCase with_new_lengths(const test::RandomCase& c, int max_len,
                                         std::uint64_t seed) {
  test::RandomCase c2 = c;
  std::mt19937_64 rng(seed);
  const int batch = static_cast<int>(c.kv_len.size()), ps = c.spec.page_size;
  for (int r = 0; r < batch; ++r)
    c2.kv_len[r] = std::uniform_int_distribution<int>(0, max_len)(rng);
  c2.kv_indptr.assign(1, 0);
  c2.kv_indices.clear();
  const std::vector<std::int32_t> pages = shuffled_pages(c, rng);
  std::size_t next = 0;
  for (int r = 0; r < batch; ++r) {
    const int need = (c2.kv_len[r] + ps - 1) / ps;
    if (next + need > pages.size()) c2.kv_len[r] = 0;
    for (int i = 0; c2.kv_len[r] > 0 && i < need; ++i) c2.kv_indices.push_back(pages[next++]);
    c2.kv_indptr.push_back(static_cast<std::int32_t>(c2.kv_indices.size()));
  }
  return c2;
}

}  // namespace fp8mla::gputest
