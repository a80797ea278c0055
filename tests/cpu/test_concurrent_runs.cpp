// Shared plans on the CPU backend: run() only reads a plan (each run keeps its own split-KV
// workspace), so one plan may be run from several threads at once, each into its own output,
// and every run gives the single-threaded result bit for bit. Before, the plan's one workspace
// was shared: with requests split across kv chunks, 165 of 200 concurrent runs differed and
// ThreadSanitizer reported races in run_tile. scripts/sanitize.sh runs these tests under TSan.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "fp8mla/attention.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

struct Result {
  std::vector<std::uint16_t> out;
  std::vector<std::uint32_t> lse;  // bits
  bool guards = true;
  bool operator==(const Result&) const = default;
};

Result run_once(test::RandomCase& c, const Plan& p) {
  test::HostOutput o(c, 256);
  run(p, c.host_args(o));
  Result r{{o.out().begin(), o.out().end()}, {}, o.guards_intact()};
  EXPECT_TRUE(r.guards) << "a write outside out / lse";
  for (const float l : o.lse()) r.lse.push_back(std::bit_cast<std::uint32_t>(l));
  return r;
}

// `cases` run on one thread each, all starting together, each running `p` `runs` times into
// its own output; returns how many runs differed from that case's single-threaded result.
int concurrent_mismatches(std::vector<test::RandomCase>& cases, const Plan& p, int runs) {
  std::vector<Result> want;
  for (test::RandomCase& c : cases) want.push_back(run_once(c, p));
  const int threads = static_cast<int>(cases.size());
  std::atomic<int> ready{0}, mismatches{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < threads) std::this_thread::yield();
      for (int i = 0; i < runs; ++i)
        if (!(run_once(cases[t], p) == want[t])) mismatches.fetch_add(1);
    });
  }
  for (std::thread& t : pool) t.join();
  return mismatches.load();
}

// Requests split across kv chunks (the split-KV workspace is in use) and multi-token causal
// ones; every format's fast path, and the reference path. Each thread runs the plan on its own
// queries (one layer each), as an engine running layers of one batch on several threads does.
TEST(ConcurrentRuns, OnePlanFromManyThreadsGivesTheSingleThreadResult) {
  for (const KvFormat format : {KvFormat::fp8_e4m3, KvFormat::bf16, KvFormat::fp8_e4m3_block}) {
    test::ProblemSpec s;
    s.format = format;
    s.batch = 3;
    s.num_heads = 8;
    s.page_size = 16;
    s.qo_len_max = 2;
    s.causal = true;
    s.kv_len_min = 200;
    s.kv_len_max = 300;
    s.seed = 35 + static_cast<std::uint64_t>(format);
    std::vector<test::RandomCase> layers(4, test::make_case(s));
    for (std::size_t t = 1; t < layers.size(); ++t) {  // other queries, the same batch and cache
      std::vector<std::uint16_t>& q = layers[t].q;
      std::rotate(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(t * 4099 % q.size()), q.end());
    }
    for (const bool reference : {false, true}) {
      // The reference path (float64, one thread) reads the plan only too; one format will do.
      if (reference && format != KvFormat::fp8_e4m3) continue;
      PlanOptions o;
      o.sm_count = 512;  // one wave of many tiles: splits of 64 tokens
      o.min_chunk_tokens = 1;
      o.num_threads = 2;
      o.cpu_reference = reference;
      const Plan p = plan(layers[0].problem(), o);
      ASSERT_GT(p.partial_rows(), 0) << test::describe(s) << ": the case must use the workspace";
      EXPECT_EQ(concurrent_mismatches(layers, p, 3), 0)
          << test::describe(s) << (reference ? " (reference)" : " (fast path)");
    }
  }
}

// merge_states() shares nothing between calls either.
TEST(ConcurrentRuns, MergeStatesFromManyThreads) {
  constexpr std::int64_t kRows = 300, kStates = 5, kDim = 512;  // above the threading cut
  std::vector<float> v(kRows * kStates * kDim), s(kRows * kStates);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 97) * 0.01f;
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(i % 13) * 0.1f;
  auto merge = [&](std::vector<float>& out, std::vector<float>& lse) {
    merge_states(make_view(v.data(), DType::f32, {kRows, kStates, kDim}),
                 make_view(s.data(), DType::f32, {kRows, kStates}),
                 make_view(out.data(), DType::f32, {kRows, kDim}),
                 make_view(lse.data(), DType::f32, {kRows}));
  };
  std::vector<float> want(kRows * kDim), want_lse(kRows);
  merge(want, want_lse);
  std::atomic<int> mismatches{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < 4; ++t) {
    pool.emplace_back([&] {
      std::vector<float> out(kRows * kDim), lse(kRows);
      for (int i = 0; i < 3; ++i) {
        merge(out, lse);
        if (out != want || lse != want_lse) mismatches.fetch_add(1);
      }
    });
  }
  for (std::thread& t : pool) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace fp8mla
