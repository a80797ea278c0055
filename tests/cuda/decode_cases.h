// Helpers of the GPU decode tests (tests/cuda/test_cuda_*.cpp): a case run on the GPU and
// compared with the CPU reference (check_case), the grid's case description with the kernel
// family it states (GridCase, run_grid_case), and CUDA-graph capture, replan and replay.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "src/core/backend.h"
#include "src/core/dispatch.h"
#include "tests/common/test_util.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla::gputest {

// FP8MLA_KERNEL_FAMILY in the environment runs plans that leave the choice to the table on another
// family (src/core/plan.cpp): the tests' family checks then accept it.
inline bool family_forced() {
  const char* env = std::getenv("FP8MLA_KERNEL_FAMILY");
  return env != nullptr && *env != '\0';
}

// `o` for case c: a kpe_scale / ckv_scale ratio that is not a power of two is a plan input
// (PlanOptions::any_scale_ratio).
inline PlanOptions options_for(const test::RandomCase& c, PlanOptions o) {
  if (c.spec.format == KvFormat::fp8_e4m3 &&
      !detail::pow2_scale_ratio(c.sm_scale, c.spec.ckv_scale, c.spec.kpe_scale))
    o.any_scale_ratio = true;
  return o;
}

// Runs a (possibly edited) case on the GPU (fresh device copies, poisoned outputs), compares,
// and returns the output's bf16 bits (without the guards).
inline std::vector<std::uint16_t> check_case(test::RandomCase& c, const std::string& what,
                                             PlanOptions options = {}, Tolerance tol = {}) {
  options = options_for(c, options);
  test::HostOutput ref = reference(c);
  DeviceBuffer cache(c.cache), q(c.q);
  DeviceOutput d(c, 256);
  Plan p = plan(c.problem(DeviceKind::cuda), options);
  RunArgs args = device_args(c, cache, q, d);
  run(p, args);
  detail::cuda_synchronize(0);
  expect_matches(d, ref, what, tol);
  // Same inputs, second run: bit-identical (a moving result would be a race).
  const auto first = d.out.to_host<std::uint16_t>();
  d.poison_all();
  run(p, args);
  detail::cuda_synchronize(0);
  EXPECT_EQ(first, d.out.to_host<std::uint16_t>()) << what << ": second run differs";
  return {first.begin() + d.guard, first.begin() + d.guard + d.n_out};
}

inline void run_case(const test::ProblemSpec& spec, PlanOptions options = {}) {
  test::RandomCase c = test::make_case(spec);
  check_case(c, test::describe(spec), options);
}

// A decode case's spec (three requests, one query token each) for the tests that set more of it
// or edit its data; fp8_case builds an fp8_e4m3 one.
inline test::ProblemSpec decode_spec(KvFormat format, int heads, int page_size, int kv_min,
                                     int kv_max, std::uint64_t seed) {
  test::ProblemSpec s;
  s.format = format;
  s.num_heads = heads;
  s.page_size = page_size;
  s.batch = 3;
  s.kv_len_min = kv_min;
  s.kv_len_max = kv_max;
  s.seed = seed;
  return s;
}
inline test::RandomCase fp8_case(int heads, int page_size, int kv_min, int kv_max,
                                 std::uint64_t seed) {
  return test::make_case(decode_spec(KvFormat::fp8_e4m3, heads, page_size, kv_min, kv_max, seed));
}

// ---- the grid: (format, heads, page size, qo_len range, causal, kv range, layout) ----
struct GridCase {
  KvFormat format;
  int heads, page_size, batch, qo_min, qo_max;
  bool causal;
  int kv_min, kv_max;
  test::CacheLayout layout;
  float ckv_scale, kpe_scale;
  // The kernel family its plans record (src/core/dispatch.h) when their tiles have <= 16 rows,
  // and when they have more; nullptr where the case cannot plan such tiles. Which of the two a
  // plan gets depends on its requests' query lengths and, for small fp8 batches, on the SM count
  // (the planner's 16-row cap), so the test picks by the plan's tiles.
  const char* family16;
  const char* family64;
};
inline constexpr auto F8 = KvFormat::fp8_e4m3, BF = KvFormat::bf16, BL = KvFormat::fp8_e4m3_block;
inline constexpr auto FU = test::CacheLayout::fused, SP = test::CacheLayout::split;
// A grid case's spec for one seed (an even seed fuses q_nope and q_pe into one buffer).
inline test::ProblemSpec grid_spec(const GridCase& g, std::uint64_t seed) {
  test::ProblemSpec s;
  s.format = g.format;
  s.num_heads = g.heads;
  s.page_size = g.page_size;
  s.batch = g.batch;
  s.qo_len_min = g.qo_min;
  s.qo_len_max = g.qo_max;
  s.causal = g.causal;
  s.kv_len_min = g.kv_min;
  s.kv_len_max = g.kv_max;
  s.empty_fraction = 0.1;
  s.layout = g.layout;
  s.ckv_scale = g.ckv_scale;
  s.kpe_scale = g.kpe_scale;
  s.fused_q = seed % 2 == 0;
  s.seed = seed * 1000 + static_cast<std::uint64_t>(g.heads);
  return s;
}

// The family `p` records for grid case g: g.family16 or g.family64 by p's largest tile (a family
// that FP8MLA_KERNEL_FAMILY in the environment asks for is accepted where the planner took it).
inline void expect_family(const Plan& p, const GridCase& g, const std::string& what) {
  int rows = 0;
  for (const WorkTile& t : p.tiles()) rows = std::max(rows, t.q_count * t.head_count);
  const char* want = rows <= 16 ? g.family16 : g.family64;
  if (family_forced() && std::string(p.kernel_name()) == std::getenv("FP8MLA_KERNEL_FAMILY"))
    return;
  ASSERT_NE(want, nullptr) << what << ": the case states no family for tiles of " << rows
                           << " rows";
  EXPECT_STREQ(p.kernel_name(), want) << what << ", tiles of up to " << rows << " rows";
}

// Grid case g for one seed: its plan records the family the case states, and the run matches the
// reference (check_case).
inline void run_grid_case(const GridCase& g, std::uint64_t seed, PlanOptions options = {}) {
  test::RandomCase c = test::make_case(grid_spec(g, seed));
  const std::string what = test::describe(c.spec);
  {
    const Plan p = plan(c.problem(DeviceKind::cuda), options_for(c, options));
    expect_family(p, g, what);
  }
  check_case(c, what, options);
}

// `o` made graph-mode for decode batches of up to o.max_batch requests (8 when unset) of one
// query token each over c's pool.
inline PlanOptions graph_options(const test::RandomCase& c, PlanOptions o = {}) {
  o.cuda_graph = true;
  if (o.max_batch == 0) o.max_batch = 8;
  o.max_total_q = o.max_batch;
  o.max_kv_indices = static_cast<std::int64_t>(c.num_pages);
  o.max_qo_len = 1;
  return o;
}

// A CUDA-graph plan (options o with o.max_batch requests, bounded by c1's pool and one query
// token a request) for c1 = make_case(s), with the engine's fixed buffers (c1's pool and q):
// run() captured and replayed, then replan() for c2 = second(c1) over the same pool and q (so
// c1's pool is not poisoned: c2 reads pages c1 left unused) and the same graph replayed (and,
// with and_back, re-planned for c1 again and replayed); every replay must match the reference.
// check(p, 1 | 2 | 3) runs after each plan (its fatal failures stop the test).
template <class Second, class Check>
void capture_replan_replay(test::ProblemSpec s, PlanOptions o, Second second, Check check,
                           bool and_back = false) {
  s.poison_unused = false;
  test::RandomCase c1 = test::make_case(s);
  Plan p = plan(c1.problem(DeviceKind::cuda), graph_options(c1, o));
  check(p, 1);
  if (::testing::Test::HasFatalFailure()) return;
  DeviceBuffer cache(c1.cache), q(c1.q);
  DeviceOutput d(c1, 0);
  RunArgs args = device_args(c1, cache, q, d);
  TestStream stream;
  args.stream = stream.s;
  CapturedGraph graph(stream.s, [&] { run(p, args); });
  graph.replay();
  test::HostOutput ref1 = reference(c1);
  expect_matches(d, ref1, "graph replay 1");

  test::RandomCase c2 = second(c1);
  replan(p, c2.problem(DeviceKind::cuda));
  check(p, 2);
  if (::testing::Test::HasFatalFailure()) return;
  d.poison_all();
  graph.replay();
  test::HostOutput ref2 = reference(c2);
  expect_matches(d, ref2, "graph replay after replan");
  if (!and_back) return;

  replan(p, c1.problem(DeviceKind::cuda));
  check(p, 3);
  if (::testing::Test::HasFatalFailure()) return;
  d.poison_all();
  graph.replay();
  expect_matches(d, ref1, "graph replay after replanning the first batch again");
}

// capture_replan_replay for six requests of spec s, re-planned to new lengths of 0-5000 tokens;
// both plans record `family` (replan() keeps the plan's family).
inline void capture_replan_replay_lengths(test::ProblemSpec s, const char* family) {
  s.batch = 6;
  s.spare_pages = 400 * 16 / s.page_size;  // room for the second batch's longer contexts
  PlanOptions o;
  o.max_batch = 8;
  auto second = [](const test::RandomCase& c) { return with_new_lengths(c, 5000, 99); };
  capture_replan_replay(s, o, second, [family](const Plan& p, int stage) {
    if (!family_forced()) {
      EXPECT_STREQ(p.kernel_name(), family) << "plan " << stage;
    }
  });
}

}  // namespace fp8mla::gputest
