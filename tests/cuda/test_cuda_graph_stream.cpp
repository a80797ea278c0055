// GPU tests, CUDA graphs and streams: capture, replan and replay; replan's wait for a run in
// flight; the split merge's captured form; runs chained on one stream (programmatic dependent
// launch); the caller's current device kept. They GTEST_SKIP when no CUDA device is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "src/cuda/merge/split_merge.h"
#include "tests/common/test_util.h"
#include "tests/cuda/decode_cases.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using namespace gputest;  // NOLINT: the GPU test helpers

// run() captured in a CUDA graph; replan() with new lengths; the replay matches the reference.
// Five kernel families, each checked through the plan's recorded family before and after replan()
// (which keeps it).
TEST(CudaGraph, CaptureReplanReplay) {
  SKIP_WITHOUT_GPU();
  const struct {
    KvFormat f;
    int heads, page_size;
    const char* family;
  } kinds[] = {{F8, 16, 16, "fp8_tma"},
               {F8, 8, 1, "fp8_gather"},
               {BF, 8, 1, "bf16_gather"},
               {BF, 128, 64, "bf16_wide_rows"},
               {F8, 128, 64, "wide_rows"}};
  for (const auto& k : kinds) {
    SCOPED_TRACE(std::string(format_name(k.f)) + ", heads " + std::to_string(k.heads) + ", page " +
                 std::to_string(k.page_size));
    capture_replan_replay_lengths(decode_spec(k.f, k.heads, k.page_size, 1, 3000, 31), k.family);
  }
}

// replan() rewrites the device buffers (tiles, page table) that a run still queued or running
// reads, so it must wait for that run, also on a stream that does not synchronise with the
// legacy one (replan's copies take the legacy stream, which CUDA orders only against blocking
// streams). Device work (100 memsets of 4 GB) holds the stream, so the run is still queued when
// replan() is called; it must then compute c1, not c2. (Some drivers' pageable copies wait for
// the queued work themselves, so a build without replan's wait can pass here too: the wait is
// kept for what CUDA documents, and the test guards the contract.)
TEST(CudaGraph, ReplanWaitsForTheRunInFlight) {
  SKIP_WITHOUT_GPU();
  test::ProblemSpec s = decode_spec(F8, 16, 16, 1, 3000, 33);
  s.batch = 6;
  s.spare_pages = 400;  // room for c2's longer contexts
  s.poison_unused = false;
  test::RandomCase c1 = test::make_case(s);
  Plan p = plan(c1.problem(DeviceKind::cuda), graph_options(c1));
  DeviceBuffer cache(c1.cache), q(c1.q);
  DeviceOutput d(c1, 0);
  RunArgs args = device_args(c1, cache, q, d);
  TestStream stream;
  args.stream = stream.s;
  DeviceBuffer hold(std::size_t{4} << 30);
  for (int i = 0; i < 100; ++i) check_cuda(cudaMemsetAsync(hold.ptr, i, hold.bytes, stream.s));
  run(p, args);
  replan(p, with_new_lengths(c1, 5000, 99).problem(DeviceKind::cuda));
  check_cuda(cudaStreamSynchronize(stream.s));
  test::HostOutput ref = reference(c1);
  expect_matches(d, ref, "the run queued before replan()");
}

// A graph keeps the split-merge form it was captured with. A bs-1 plan of <= 32 rows and <= 128
// splits captures the form that loads every split before the row max (src/cuda/merge,
// split_merge_kernel<32, 4>); re-planned to more splits than it preloads, the same graph node
// must take its general path and still match the reference.
TEST(CudaGraph, MergeFormCapturedShortServesLongContexts) {
  SKIP_WITHOUT_GPU();
  // The split counts below assume the table's fp8_e4m3 families' residency (two CTAs an SM).
  if (family_forced()) GTEST_SKIP() << "FP8MLA_KERNEL_FAMILY=" << std::getenv("FP8MLA_KERNEL_FAMILY");
  test::ProblemSpec s = decode_spec(F8, 8, 64, 3000, 3000, 32);
  s.batch = 1;
  s.spare_pages = 2000;  // room for the second length
  PlanOptions o;
  o.max_batch = 1;
  // The whole pool, pages shuffled: a long context, split more than the captured form preloads.
  auto second = [&](const test::RandomCase& c) {
    test::RandomCase c2 = c;
    std::mt19937_64 rng(7);
    c2.kv_indices = shuffled_pages(c, rng);
    c2.kv_indptr = {0, static_cast<std::int32_t>(c2.kv_indices.size())};
    c2.kv_len[0] = static_cast<int>(c2.kv_indices.size()) * s.page_size - 17;
    return c2;
  };
  capture_replan_replay(s, o, second, [](const Plan& p, int stage) {
    if (stage == 1) {
      ASSERT_GT(p.num_splits()[0], 1) << "the first plan must split";
      ASSERT_LE(p.num_splits()[0], 128) << "the first plan must capture the preloading form";
    } else {
      ASSERT_GT(p.num_splits()[0], 128) << "the second plan must split past the preloaded count";
    }
  });
}

// A graph-mode plan of more than 32 merge rows reads its merge's form at each run (src/cuda/merge,
// split_merge_graph_kernel): whole rows while no request has more than kGraphWholeRowMaxSplits
// splits, (row, 64-column) units past that. One captured graph, re-planned from 32 requests of 3000
// tokens (a few splits each) to one request over the whole pool (the others empty; many splits) and
// back, matches the reference at every replay.
TEST(CudaGraph, MergeFormFollowsEachReplan) {
  SKIP_WITHOUT_GPU();
  // The split counts below assume the table's fp8_e4m3 families' residency (two CTAs an SM).
  if (family_forced())
    GTEST_SKIP() << "FP8MLA_KERNEL_FAMILY=" << std::getenv("FP8MLA_KERNEL_FAMILY");
  test::ProblemSpec s = decode_spec(F8, 16, 64, 3000, 3000, 41);
  s.batch = 32;
  s.spare_pages = 1500;
  PlanOptions o;
  o.max_batch = 32;
  auto one_long = [&](const test::RandomCase& c) {  // request 0 over the whole pool, shuffled
    test::RandomCase c2 = c;
    std::mt19937_64 rng(11);
    c2.kv_indices = shuffled_pages(c, rng);
    const auto pages = static_cast<std::int32_t>(c2.kv_indices.size());
    c2.kv_indptr.assign(c.kv_indptr.size(), pages);
    c2.kv_indptr[0] = 0;
    std::fill(c2.kv_len.begin(), c2.kv_len.end(), 0);
    c2.kv_len[0] = pages * s.page_size - 17;
    return c2;
  };
  capture_replan_replay(
      s, o, one_long,
      [](const Plan& p, int stage) {
        const std::span<const std::int32_t> n = p.num_splits();
        const std::int32_t most = *std::max_element(n.begin(), n.end());
        if (stage == 2) {
          ASSERT_GT(most, detail::kGraphWholeRowMaxSplits) << "plan 2 must merge 64-column units";
        } else {
          ASSERT_GT(most, 1) << "plan " << stage << " must split";
          ASSERT_LE(most, detail::kGraphWholeRowMaxSplits)
              << "plan " << stage << " must merge whole rows";
        }
      },
      /*and_back=*/true);
}

// Two runs on one stream, no sync between them, the second's q_nope being the first's out: the
// decode launch is a programmatic dependent of the kernel before it (the first run's split merge,
// which lets it launch as soon as the merge starts its work), so a decode kernel that read q
// before griddepcontrol.wait would read the poisoned out, and one that wrote its split partials
// before it would corrupt the first run's merge. Every decode family, eagerly and in a CUDA
// graph, checked through the plan's recorded family.
TEST(CudaStream, ChainedRunsSeeTheRunBefore) {
  SKIP_WITHOUT_GPU();
  struct Chain {
    KvFormat format;
    int heads, page_size;
    const char* kernel;
    bool exact_scores = false;  // PlanOptions::exact_scores: fp8_exact
  };
  const Chain chains[] = {
      {F8, 16, 64, "fp8_tma"},    {F8, 8, 1, "fp8_gather"},  {F8, 8, 1, "fp8_exact", true},
      {F8, 128, 64, "wide_rows"}, {BF, 64, 1, "wide_rows"},  {BF, 8, 16, "bf16_tma"},
      {BF, 8, 1, "bf16_gather"},  {BL, 16, 64, "fp8_gather"}, {BF, 128, 64, "bf16_wide_rows"}};
  TestStream stream;
  for (const bool graph : {false, true}) {
    for (const Chain& ch : chains) {
      test::ProblemSpec s;
      s.format = ch.format;
      s.num_heads = ch.heads;
      s.page_size = ch.page_size;
      s.batch = 1;  // long and alone: split, so a merge kernel runs between the two decodes
      s.kv_len_min = s.kv_len_max = 3000;
      s.seed = 4000 + ch.heads + ch.page_size + (ch.exact_scores ? 1000 : 0);
      test::RandomCase c = test::make_case(s);
      const std::string what = std::string(ch.kernel) + (graph ? ", graph" : ", stream");
      PlanOptions o;
      o.exact_scores = ch.exact_scores;
      Plan p = plan(c.problem(DeviceKind::cuda), o);
      ASSERT_GT(p.num_splits()[0], 1) << what << ": the case must split";
      if (!family_forced()) {
        EXPECT_STREQ(p.kernel_name(), ch.kernel) << what;
      }
      DeviceBuffer cache(c.cache), q(c.q);
      DeviceOutput d1(c, 0), d2(c, 0);
      RunArgs a1 = device_args(c, cache, q, d1);
      RunArgs a2 = device_args(c, cache, q, d2);
      a2.q_nope = c.out_view(d1.out_data(), DeviceKind::cuda);
      a1.stream = a2.stream = stream.s;
      auto issue = [&] {
        run(p, a1);
        run(p, a2);
      };
      if (graph) {
        CapturedGraph(stream.s, issue).replay();
      } else {
        issue();
        check_cuda(cudaStreamSynchronize(stream.s));
      }
      test::HostOutput ref1 = reference(c);
      expect_matches(d1, ref1, what + ": first run");
      test::RandomCase c2 = c;  // q_nope = the first run's out, as the device held it
      const auto out1 = d1.out.to_host<std::uint16_t>();
      std::copy(out1.begin(), out1.end(), c2.q.begin());
      test::HostOutput ref2 = reference(c2);
      expect_matches(d2, ref2, what + ": second run");
    }
  }
}

// The library's CUDA calls give the calling thread its current device back (CurrentDeviceGuard,
// src/core/backend.h): with device 1 current (its context active), a plan, a run, a merge and a
// cache with its append, all on device 0, leave device 1 current, and the run still matches the
// reference. Needs two GPUs (the test helpers' own allocations select device 0, so device 1 is
// made current after them).
TEST(CudaDevice, CallsGiveTheCallerItsDeviceBack) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  auto current = [] {
    int d = -1;
    check_cuda(cudaGetDevice(&d));
    return d;
  };
  auto select_1 = [] {
    check_cuda(cudaSetDevice(1));
    check_cuda(cudaFree(nullptr));  // device 1's context is active: it may be given back
  };
  test::RandomCase c = fp8_case(8, 64, 100, 700, 93);
  test::HostOutput ref = reference(c);
  DeviceBuffer cache(c.cache), q(c.q);
  DeviceOutput d(c, 256);
  const RunArgs args = device_args(c, cache, q, d);
  const int rows = 40;
  std::vector<float> v(rows * 2 * kDimCkv, 0.5f), s(rows * 2, 1.0f);
  DeviceBuffer dv(v), ds(s), dout(rows * kDimCkv * 4), slots(std::vector<std::int32_t>{0, 5, 17}),
      ckv(std::vector<float>(3 * kDimCkv, 1.5f)), kpe(std::vector<float>(3 * kDimKpe, -2.0f));

  select_1();
  const Plan p = plan(c.problem(DeviceKind::cuda));
  EXPECT_EQ(current(), 1) << "plan()";
  run(p, args);
  EXPECT_EQ(current(), 1) << "run()";
  merge_states(make_view(dv.ptr, DType::f32, {rows, 2, kDimCkv}, DeviceKind::cuda),
               make_view(ds.ptr, DType::f32, {rows, 2}, DeviceKind::cuda),
               make_view(dout.ptr, DType::f32, {rows, kDimCkv}, DeviceKind::cuda), {});
  EXPECT_EQ(current(), 1) << "merge_states()";
  PagedLatentCache dev_cache({.num_pages = 4, .page_size = 16, .device = DeviceKind::cuda});
  EXPECT_EQ(current(), 1) << "PagedLatentCache()";
  dev_cache.append(make_view(slots.ptr, DType::i32, {3}, DeviceKind::cuda),
                   make_view(ckv.ptr, DType::f32, {3, kDimCkv}, DeviceKind::cuda),
                   make_view(kpe.ptr, DType::f32, {3, kDimKpe}, DeviceKind::cuda));
  EXPECT_EQ(current(), 1) << "PagedLatentCache::append()";
  detail::cuda_synchronize(0);
  expect_matches(d, ref, "run with device 1 current");
  std::vector<float> token(kDimQk);
  dev_cache.read_token(17, token);
  EXPECT_EQ(token[0], 1.5f);
  EXPECT_EQ(token[kDimCkv], -2.0f);
}

}  // namespace
}  // namespace fp8mla
