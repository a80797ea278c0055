// GPU tests: every kernel variant against the CPU float64 reference on fresh random data.
// They GTEST_SKIP when no CUDA device is visible (CI), and run on the device machine.
//
// Tolerances. Both sides read identical dequantized cache values (the reference decodes the
// same bytes), so the error measures the kernel, not FP8: products of bf16 q and exact cache
// values are exact in the tensor cores' fp32 accumulators; the softmax weights P are rounded to
// bf16 before P V (relative 2^-9 each, averaging out over many tokens), and the output is rounded
// to bf16 (2^-9). Measured errors are ~2-4e-3 relative L2; we allow 1e-2 (the project's bar) for
// out and 2e-3 * max(1, |lse|) for lse. Positions of NaN and -inf must match exactly.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "src/core/dispatch.h"
#include "tests/common/test_util.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using gputest::CapturedGraph;
using gputest::check_cuda;
using gputest::device_args;
using gputest::DeviceBuffer;
using gputest::DeviceOutput;
using gputest::expect_matches;
using gputest::kLseTol;
using gputest::kOutTol;
using gputest::reference;
using gputest::shuffled_pages;
using gputest::TestStream;
using gputest::Tolerance;
using gputest::with_new_lengths;

// Runs a (possibly edited) case on the GPU (fresh device copies, poisoned outputs), compares,
// and returns the output's bf16 bits (without the guards).
std::vector<std::uint16_t> check_case(test::RandomCase& c, const std::string& what,
                                      PlanOptions options = {}, Tolerance tol = {}) {
  // A scale ratio that is not a power of two is a plan input (PlanOptions::any_scale_ratio).
  if (c.spec.format == KvFormat::fp8_e4m3 &&
      !detail::pow2_scale_ratio(c.sm_scale, c.spec.ckv_scale, c.spec.kpe_scale))
    options.any_scale_ratio = true;
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

void run_case(const test::ProblemSpec& spec, PlanOptions options = {}) {
  test::RandomCase c = test::make_case(spec);
  check_case(c, test::describe(spec), options);
}

// A decode case's spec (three requests, one query token each) for the tests that set more of it
// or edit its data; fp8_case builds an fp8_e4m3 one.
test::ProblemSpec decode_spec(KvFormat format, int heads, int page_size, int kv_min, int kv_max,
                              std::uint64_t seed) {
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
test::RandomCase fp8_case(int heads, int page_size, int kv_min, int kv_max, std::uint64_t seed) {
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
};
constexpr auto F8 = KvFormat::fp8_e4m3, BF = KvFormat::bf16, BL = KvFormat::fp8_e4m3_block;
constexpr auto FU = test::CacheLayout::fused, SP = test::CacheLayout::split;
const GridCase kGrid[] = {
    // dense decode: heads 1..128, page sizes 1/16/64, ragged lengths incl. 0 and non-multiples
    {F8, 8, 1, 6, 1, 1, false, 0, 700, FU, 1.0f, 1.0f},
    {F8, 16, 64, 5, 1, 1, false, 1, 1000, SP, 0.5f, 0.5f},
    {F8, 1, 16, 3, 1, 1, false, 0, 333, FU, 2.0f, 0.25f},
    {F8, 20, 16, 4, 1, 1, false, 50, 400, FU, 1.0f, 1.0f},
    {F8, 64, 64, 3, 1, 1, false, 0, 500, FU, 1.0f, 1.0f},
    {F8, 128, 1, 2, 1, 1, false, 100, 600, FU, 1.0f, 1.0f},
    {F8, 96, 16, 2, 1, 1, false, 1, 300, SP, 1.0f, 1.0f},
    {BF, 8, 64, 4, 1, 1, false, 0, 800, FU, 1.0f, 1.0f},
    {BF, 16, 1, 4, 1, 1, false, 1, 300, SP, 1.0f, 1.0f},
    {BF, 128, 16, 2, 1, 1, false, 0, 400, FU, 1.0f, 1.0f},
    {BL, 8, 64, 4, 1, 1, false, 0, 900, FU, 1.0f, 1.0f},
    {BL, 64, 1, 3, 1, 1, false, 1, 300, FU, 1.0f, 1.0f},
    {BL, 128, 16, 2, 1, 1, false, 10, 200, FU, 1.0f, 1.0f},
    // multi-token causal decode (MTP / speculative): qo_len 1..8 ragged
    {F8, 8, 1, 5, 1, 8, true, 0, 500, FU, 1.0f, 1.0f},
    {F8, 16, 64, 4, 2, 4, true, 8, 700, FU, 1.0f, 1.0f},
    {F8, 128, 16, 2, 1, 3, true, 4, 300, FU, 1.0f, 1.0f},
    {BF, 8, 16, 3, 1, 8, true, 1, 400, FU, 1.0f, 1.0f},
    {BL, 16, 64, 3, 1, 6, true, 1, 500, FU, 1.0f, 1.0f},
    {F8, 5, 16, 3, 1, 16, false, 20, 300, FU, 1.0f, 1.0f},
    // <= 16 rows with several query tokens: the fp8 <= 16-row kernels' multi-token causal path
    // (page 1: the gather kernel, 16 and 64: the TMA kernel)
    {F8, 8, 16, 4, 1, 2, true, 1, 600, FU, 1.0f, 1.0f},
    {F8, 4, 1, 3, 2, 4, true, 4, 900, SP, 2.0f, 0.5f},
    {F8, 2, 64, 3, 1, 8, true, 8, 1300, FU, 1.0f, 1.0f},
    // 17-64-row fp8 tiles (the wgmma kernel) with kpe_scale != ckv_scale: q_pe carries the ratio
    {F8, 32, 16, 3, 1, 1, false, 1, 500, SP, 2.0f, 0.5f},
    {F8, 128, 64, 2, 1, 2, true, 1, 700, FU, 0.5f, 4.0f},
    // 17-64-row bf16 tiles (the warp-specialized kernel, cp.async copies): page 1, causal, long
    // enough to split
    {BF, 64, 1, 2, 1, 2, true, 300, 2500, SP, 1.0f, 1.0f},
    // <= 16-row fp8 tiles on pages of >= 8 tokens (the TMA kernel): page sizes 8, 32 and 128
    // besides the 16 and 64 above, split layouts, kpe_scale != ckv_scale, causal multi-token
    {F8, 16, 128, 3, 1, 1, false, 1, 900, SP, 1.0f, 2.0f},
    {F8, 8, 8, 4, 1, 2, true, 1, 600, FU, 1.0f, 1.0f},
    {F8, 4, 32, 3, 1, 4, true, 1, 700, SP, 0.5f, 1.0f},
    // ... with kpe_scale / ckv_scale = 2^10 (q_pe carries it, exactly), and = 1e6 (not a power
    // of two: the fragment kernel)
    {F8, 16, 64, 3, 1, 2, true, 1, 600, FU, 0.03125f, 32.0f},
    {F8, 16, 64, 3, 1, 2, true, 1, 600, FU, 1e-3f, 1e3f},
    // 17-64-row bf16 tiles at page 64 (FlashMLA's schedule, the seesaw kernel): ragged lengths
    // from 0 (odd and even block counts, the last pair without its second block), and 32 heads x
    // 2 query tokens on the split layout; page 1 on the fused layout (the warp-specialized
    // kernel, one multiply a token's address)
    {BF, 128, 64, 3, 1, 1, false, 0, 700, FU, 1.0f, 1.0f},
    {BF, 32, 64, 3, 1, 2, true, 1, 900, SP, 1.0f, 1.0f},
    {BF, 64, 1, 3, 1, 1, false, 0, 600, FU, 1.0f, 1.0f},
    // ... the seesaw kernel on pages of 128 tokens: 20 heads x 3 query tokens (rows past a
    // tile's 60), causal, on the split layout; 64 heads on fused pages, long enough to split
    {BF, 20, 128, 3, 1, 3, true, 1, 2600, SP, 1.0f, 1.0f},
    {BF, 64, 128, 2, 1, 1, false, 500, 3000, FU, 1.0f, 1.0f},
    // <= 16-row bf16 tiles on pages of >= 8 tokens (the bf16 TMA kernel): page sizes 128, 8 and
    // 32 (several page runs a block), split and fused layouts, lengths from 0, causal multi-token
    {BF, 16, 128, 3, 1, 1, false, 1, 900, SP, 1.0f, 1.0f},
    {BF, 8, 8, 4, 1, 2, true, 1, 600, FU, 1.0f, 1.0f},
    {BF, 4, 32, 3, 1, 4, true, 0, 700, SP, 1.0f, 1.0f},
    // 17-64-row fp8 tiles at pages >= 64 (the warp-specialized kernel; its contiguous-block
    // loads on fused pages): ragged lengths from 0; 20 heads x 3 query tokens (rows past a
    // tile's 60), causal, on the split layout with kpe_scale / ckv_scale = 1/4; 64 heads at page
    // 128, long enough to split
    {F8, 128, 64, 3, 1, 1, false, 0, 700, FU, 1.0f, 1.0f},
    {F8, 20, 128, 3, 1, 3, true, 1, 2600, SP, 2.0f, 0.5f},
    {F8, 64, 128, 2, 1, 1, false, 500, 3000, FU, 1.0f, 1.0f},
    // <= 16-row fp8 tiles on pages of 2 and 4 tokens (the gather kernel: several tokens a page
    // entry), split and fused layouts, lengths from 0, causal multi-token
    // with kpe_scale / ckv_scale = 4; page 1 with a ratio of 1e6 (the fragment kernel)
    {F8, 16, 2, 4, 1, 1, false, 0, 900, SP, 1.0f, 1.0f},
    {F8, 8, 4, 3, 1, 2, true, 1, 700, FU, 0.5f, 2.0f},
    {F8, 12, 1, 3, 1, 1, false, 1, 600, FU, 1e-3f, 1e3f},
    // <= 16-row bf16 tiles on pages of < 8 tokens (the bf16 TMA kernel's gather instantiation):
    // page sizes 2 and 4 besides the page-1 cases above, causal multi-token, lengths from 0
    {BF, 8, 2, 3, 1, 3, true, 0, 700, FU, 1.0f, 1.0f},
    {BF, 16, 4, 4, 1, 1, false, 1, 900, SP, 1.0f, 1.0f},
};

// A grid case's spec for one seed (an even seed fuses q_nope and q_pe into one buffer).
test::ProblemSpec grid_spec(const GridCase& g, std::uint64_t seed) {
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

class CudaDecodeGrid : public ::testing::TestWithParam<GridCase> {};

// Seed 11 runs the planner's choice of tile rows, seed 12 tiles of up to 64 rows: the planner
// caps small fp8 multi-token batches of <= 16 heads at 16 rows (mtp2), so 64 keeps their rows
// covered on the 17-64-row kernel (elsewhere both seeds plan alike).
TEST_P(CudaDecodeGrid, MatchesReference) {
  SKIP_WITHOUT_GPU();
  PlanOptions wide;
  wide.max_tile_rows = 64;
  run_case(grid_spec(GetParam(), 11));
  run_case(grid_spec(GetParam(), 12), wide);
}
INSTANTIATE_TEST_SUITE_P(Grid, CudaDecodeGrid, ::testing::ValuesIn(kGrid),
                         [](const ::testing::TestParamInfo<GridCase>& param_info) {
                           const GridCase& g = param_info.param;
                           return std::string(format_name(g.format)) + "_h" +
                                  std::to_string(g.heads) + "_ps" + std::to_string(g.page_size) +
                                  "_qo" + std::to_string(g.qo_max) + (g.causal ? "_causal" : "") +
                                  "_" + std::to_string(param_info.index);
                         });

// Extend / chunked prefill: tens of query tokens a request (causal), so a request's rows span
// several tiles of up to 64 rows (q blocks of 64 / heads tokens), each reading the same pages,
// and the long case splits its request too (q blocks x splits, then the merge). These tiles run
// the 17-64-row kernels of each format (8 heads x 8 tokens fill a tile as 64 heads do); the
// non-causal case packs 16 tokens of 4 heads a tile. With options.max_tile_rows = 16 the cases
// of <= 16 heads run again on the <= 16-row kernels (fp8 and bf16 TMA kernels at pages >= 8,
// the fragment kernel and the gather instantiation below), their tiles starting at query
// tokens past 0; the last two rows are MTP's shape (16 heads x 2 tokens). The first run of each
// sets 64 itself: with 0 the planner may cap small fp8 batches at 16 rows (mtp2).
TEST(CudaDecodeExtend, LongQueryChunksMatchReference) {
  SKIP_WITHOUT_GPU();
  const GridCase cases[] = {
      {F8, 16, 64, 2, 17, 48, true, 48, 1200, FU, 1.0f, 1.0f},
      {F8, 8, 1, 2, 9, 40, true, 40, 900, SP, 1.0f, 1.0f},
      {BF, 16, 64, 2, 17, 40, true, 40, 1000, FU, 1.0f, 1.0f},
      {BL, 32, 16, 2, 3, 20, true, 20, 600, FU, 1.0f, 1.0f},
      {F8, 128, 16, 2, 2, 12, true, 12, 700, FU, 1.0f, 1.0f},
      {F8, 4, 64, 2, 20, 40, false, 1, 800, SP, 0.5f, 2.0f},
      {F8, 16, 64, 1, 8, 24, true, 2500, 3500, FU, 1.0f, 1.0f},
      {F8, 16, 64, 4, 2, 2, true, 2, 1500, SP, 1.0f, 1.0f},
      {BF, 16, 1, 4, 2, 2, true, 2, 900, FU, 1.0f, 1.0f},
  };
  PlanOptions wide, capped;
  wide.max_tile_rows = 64;
  capped.max_tile_rows = 16;
  for (const GridCase& g : cases) {
    run_case(grid_spec(g, 21), wide);
    if (g.heads <= 16) run_case(grid_spec(g, 22), capped);
  }
}

// Context-parallel shards of multi-token causal requests: each of three ranks' shards
// (shard_context, which sets Problem::causal_len) runs alone on the GPU and matches the CPU
// reference of the same shard. Short contexts cut shards among a request's last query tokens,
// so some rows see part of a shard and some none of it (o = 0, lse = -inf). The kernel families
// of <= 16 rows at pages 1, 2 and 16, and of 17-64 rows (16 heads x 4 tokens; 128 heads): each
// shard runs with the planner's choice of tile rows (small fp8 batches capped at 16 rows, mtp2)
// and with tiles of up to 64 rows.
TEST(CudaDecodeShards, CausalLenMatchesReference) {
  SKIP_WITHOUT_GPU();
  const struct {
    KvFormat f;
    int heads, page_size, kv_max;
  } kinds[] = {{F8, 8, 1, 12},  {BF, 8, 2, 24},     {F8, 16, 16, 100},
               {F8, 16, 1, 40}, {BF, 128, 64, 400}, {F8, 128, 64, 400}};
  PlanOptions reference_options;
  reference_options.cpu_reference = true;
  for (const auto& k : kinds) {
    test::ProblemSpec s = decode_spec(k.f, k.heads, k.page_size, 4, k.kv_max, 57);
    s.batch = 5;
    s.qo_len_min = 2;
    s.qo_len_max = 4;
    test::RandomCase c = test::make_case(s);
    DeviceBuffer cache(c.cache), q(c.q);
    for (int rank = 0; rank < 3; ++rank) {
      const std::string what = test::describe(s) + ", rank " + std::to_string(rank) + " of 3";
      ContextShard shard;
      shard_context(c.problem(DeviceKind::cuda), rank, 3, shard);
      Problem on_host = shard.problem;
      on_host.device = DeviceKind::cpu;
      test::HostOutput ref(c);
      run(plan(on_host, reference_options), c.host_args(ref));
      for (const int rows : {0, 64}) {
        PlanOptions o;
        o.max_tile_rows = rows;
        DeviceOutput d(c, 64);
        run(plan(shard.problem, o), device_args(c, cache, q, d));
        detail::cuda_synchronize(0);
        expect_matches(d, ref, what + ", max_tile_rows " + std::to_string(rows));
      }
    }
  }
}

// fp8_e4m3 tiles run on fp16 tensor cores with q scaled per row by a power of two: rows whose
// q is tiny or huge (far outside fp16's range) must match as well as ordinary ones.
TEST(CudaDecodeFp16, ExtremeQueryMagnitudesPerRow) {
  SKIP_WITHOUT_GPU();
  for (int heads : {8, 16, 128}) {
    test::RandomCase c = fp8_case(heads, 16, 100, 700, 77 + static_cast<std::uint64_t>(heads));
    // Row (token, head) gets 2^k with k cycling through -100, -30, 0, 20, 60 (bf16 keeps it).
    const int exps[] = {-100, -30, 0, 20, 60};
    const std::int64_t rows = c.rows();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float f = std::ldexp(1.0f, exps[r % 5]);
      auto scale_row = [&](std::size_t begin, std::size_t n) {
        for (std::size_t i = begin; i < begin + n; ++i)
          c.q[i] = float_to_bf16(bf16_to_float(c.q[i]) * f);
      };
      if (c.spec.fused_q) {
        scale_row(static_cast<std::size_t>(r) * 576, 576);
      } else {
        scale_row(static_cast<std::size_t>(r) * 512, 512);
        scale_row(static_cast<std::size_t>(rows) * 512 + static_cast<std::size_t>(r) * 64, 64);
      }
    }
    check_case(c, "extreme q, heads " + std::to_string(heads));
  }
}

// Score accuracy per fp8_e4m3 path on peaked attention: sm_scale 0.4 on N(0, 1) x 2^[-2, 2]
// data gives scores up to ~50, where a relative score error e moves P by ~50 e. Pages of 64 run
// the TMA kernel by default, page 1 the gather kernel (S on fp8 tensor cores: their
// accumulator keeps 13 mantissa bits, truncating; measured on the H200 at page 64: out
// 0.9-1.0e-3, lse 1.9-2.2e-4 with three accumulator chains, 2.4-3.6e-3 and 7e-4 with one);
// PlanOptions::exact_scores runs the fragment kernel (fp16 products of exact values, fp32
// sums; measured: out 0.4-1.4e-4, lse 3e-7). The
// bounds are ~3x those measurements, so either path losing precision fails here. 128 heads run
// the 17-64-row warp-specialized kernel on every page (fp16 products of exact values, fp32 sums;
// measured: out 5.8-7.2e-5, lse 0.7-1.9e-6; bounds 5e-4, 6e-6).
TEST(CudaDecodeScores, LargeScoresStayAccurate) {
  SKIP_WITHOUT_GPU();
  for (int page : {1, 64}) {
    for (int heads : {8, 16, 128}) {
      for (const bool exact : {false, true}) {
        test::ProblemSpec s = decode_spec(KvFormat::fp8_e4m3, heads, page, 500, 1500,
                                          300 + static_cast<std::uint64_t>(page + heads));
        s.sm_scale = 0.4f;
        test::RandomCase c = test::make_case(s);
        PlanOptions options;
        options.exact_scores = exact;
        const bool fp8_scores = heads <= 16 && !exact;
        const Tolerance tol = fp8_scores   ? Tolerance{3e-3, 6e-4}
                              : heads > 16 ? Tolerance{5e-4, 6e-6}
                                           : Tolerance{5e-4, 2e-6};
        check_case(c,
                   "large scores, page " + std::to_string(page) + ", heads " +
                       std::to_string(heads) + (exact ? ", exact_scores" : ""),
                   options, tol);
      }
    }
  }
}

// Scores that rise along the sequence: every token of block b (64 tokens) scaled by 2^min(b, 5)
// (bf16: the exponent field, exactly) or its fp8_e4m3 codes' exponents raised by min(b, 3), so
// each block's maxima pass the earlier ones by several log2 units and every kernel's online
// softmax moves its rows' base mid-sequence: P on the new base, O and the row sums rescaled. A
// build whose moves after the first block skip O's rescale (in the <= 16-row TMA kernels) fails
// here (bench/results/h200_v41_lazy_base_ab.txt). Page 1 runs the fp8 gather kernel and the
// bf16 TMA kernel's gather instantiation, pages 16 and 64 the TMA kernels, 128 heads the
// 17-64-row kernels. The
// plan does not split (a tile of one or two blocks would move its base only at its first).
TEST(CudaDecodeScores, RisingScoresMoveTheSoftmaxBase) {
  SKIP_WITHOUT_GPU();
  for (const KvFormat format : {KvFormat::bf16, KvFormat::fp8_e4m3}) {
    for (int page : {1, 16, 64}) {
      for (int heads : {8, 16, 128}) {
        test::ProblemSpec s = decode_spec(format, heads, page, 300, 800,
                                          500 + static_cast<std::uint64_t>(page + heads));
        s.magnitude_log2 = 0.0f;
        test::RandomCase c = test::make_case(s);
        const bool bf16 = format == KvFormat::bf16;
        const std::int64_t stride = token_bytes(format);  // fused layout, no padding
        for (int r = 0; r < s.batch; ++r) {
          const std::vector<std::int64_t> slots = c.request_slots(r);
          for (std::size_t i = 0; i < slots.size(); ++i) {
            const int up = std::min(static_cast<int>(i / 64), bf16 ? 5 : 3);
            std::uint8_t* token = c.cache.data() + slots[i] * stride;
            for (int d = 0; d < kDimQk; ++d) {
              if (bf16) {
                std::uint16_t v;
                std::memcpy(&v, token + 2 * d, 2);
                if ((v & 0x7f80u) != 0) v = static_cast<std::uint16_t>(v + (up << 7));
                std::memcpy(token + 2 * d, &v, 2);
              } else if ((token[d] & 0x78u) != 0) {  // normal codes (|x| < 16): exponent + 3 < 15
                token[d] = static_cast<std::uint8_t>(token[d] + (up << 3));
              }
            }
          }
        }
        // Unsplit, so each tile runs its request's 5-13 blocks in one softmax.
        PlanOptions options;
        options.min_chunk_tokens = 1 << 16;
        check_case(c,
                   std::string("rising scores, ") + format_name(format) + ", page " +
                       std::to_string(page) + ", heads " + std::to_string(heads),
                   options);
      }
    }
  }
}

// The planner's split on a CUDA device: below ~768 tokens of work per SM one tile per SM (a
// second CTA per SM costs more than it hides there), above it two per SM (the kernels'
// residency).
TEST(CudaPlan, SmallProblemsTakeOneTilePerSm) {
  SKIP_WITHOUT_GPU();
  const int sms = detail::cuda_sm_count(0);
  auto tiles_for = [&](int batch, int context) {
    const int pages = context / 64;
    std::vector<std::int32_t> qo(batch + 1), kvp(batch + 1), len(batch, context), idx;
    for (int r = 0; r <= batch; ++r) qo[r] = r, kvp[r] = r * pages;
    for (int i = 0; i < batch * pages; ++i) idx.push_back(i);
    Problem pb;
    pb.num_heads = 8;
    pb.page_size = 64;
    pb.num_pages = batch * pages;
    pb.kv_format = KvFormat::fp8_e4m3;
    pb.sm_scale = 0.07f;
    pb.qo_indptr = qo;
    pb.kv_indptr = kvp;
    pb.kv_indices = idx;
    pb.kv_len = len;
    pb.device = DeviceKind::cuda;
    return static_cast<int>(plan(pb).tiles().size());
  };
  EXPECT_LE(tiles_for(1, 32768), sms);          // 248 tokens per SM on 132 SMs
  EXPECT_LE(tiles_for(16, 4096), sms);          // 496
  EXPECT_GT(tiles_for(64, 4096), sms);          // 1986: two CTAs per SM
  EXPECT_GT(tiles_for(1, 131072), sms);         // 993
  EXPECT_GE(tiles_for(1, 32768), sms * 3 / 4);  // still the whole GPU, not a few long tiles
}

// A NaN code in the cache reaches every row that sees its token (as in the reference), and
// only those: the fragment kernels convert codes with the NaN-preserving instruction.
TEST(CudaDecodeFp16, NanInTheCacheReachesTheRowsThatSeeIt) {
  SKIP_WITHOUT_GPU();
  // Whole requests, then split into 64-token chunks: the merge must keep the NaN too.
  for (const bool split : {false, true}) {
    for (int heads : {8, 128}) {
      PlanOptions options;
      options.min_chunk_tokens = split ? 64 : 1 << 20;
      options.ctas_per_sm = split ? 8 : 0;
      test::RandomCase c = fp8_case(heads, 64, 200, 400, 91 + static_cast<std::uint64_t>(heads));
      // Request 1's token 5 gets a NaN code in its ckv part (byte 100: read as K and as V).
      const std::int64_t slot = c.request_slots(1)[5];
      const KvCacheView kv = c.kv_view(c.cache.data());
      const std::int64_t page = slot / c.spec.page_size, off = slot % c.spec.page_size;
      auto* ckv = static_cast<std::uint8_t*>(kv.ckv.data) +
                  (page * kv.ckv.stride[0] + off * kv.ckv.stride[1]) * dtype_size(kv.ckv.dtype);
      ckv[100] = 0x7f;
      const std::string what =
          "NaN in the cache, heads " + std::to_string(heads) + (split ? ", split" : ", whole");
      EXPECT_EQ(plan(c.problem(DeviceKind::cuda), options).num_splits()[1] > 1, split) << what;
      const auto out = check_case(c, what, options);
      int nan_rows = 0;
      for (std::int64_t r = 0; r < c.rows(); ++r)
        nan_rows += std::isnan(bf16_to_float(out[r * kDimCkv])) ? 1 : 0;
      EXPECT_EQ(nan_rows, heads) << what << ": exactly request 1's rows";
    }
  }
}

TEST(CudaDecodeSplit, LongContextSplitsAndMerges) {
  SKIP_WITHOUT_GPU();
  for (KvFormat f : {F8, BF, BL}) {
    test::ProblemSpec s;
    s.format = f;
    s.batch = 2;
    s.num_heads = 8;
    s.page_size = 64;
    s.kv_len_min = 9000;
    s.kv_len_max = 20000;
    s.seed = 77;
    PlanOptions o;
    o.min_chunk_tokens = 256;  // force many splits
    run_case(s, o);
  }
  // 128 heads (two 64-row tiles a request) of bf16 at page 64: the seesaw kernel on split tiles
  // (chunks of whole blocks); the second length ends mid-block
  for (int len : {4096, 4096 + 64 * 3 + 17}) {
    test::ProblemSpec s = decode_spec(BF, 128, 64, len, len, 79);
    s.batch = 1;
    PlanOptions o;
    o.min_chunk_tokens = 256;
    EXPECT_GT(plan(test::make_case(s).problem(DeviceKind::cuda), o).num_splits()[0], 1);
    run_case(s, o);
  }
  test::ProblemSpec causal;
  causal.batch = 1;
  causal.num_heads = 16;
  causal.qo_len_min = causal.qo_len_max = 4;
  causal.causal = true;
  causal.kv_len_min = causal.kv_len_max = 5000;
  causal.seed = 78;
  run_case(causal);
}

// <= 16-row bf16 tiles at pages >= 8 in a plan with a tile of >= 32 blocks: the bf16 TMA
// kernel's gather instantiation (decode.cu, kGatherMinTile; pages < 8 take it in the grid).
// min_chunk_tokens keeps the tiles that long, and lengths end mid-block. Page 64 on the split
// layout; page 16, causal multi-token, on the fused layout with requests of length 0.
TEST(CudaDecodeSplit, LongTilesAtLargePagesMatchReference) {
  SKIP_WITHOUT_GPU();
  for (int page : {64, 16}) {
    test::ProblemSpec s = decode_spec(BF, page == 64 ? 16 : 8, page, 2100, 5000, 80 + page);
    s.layout = page == 64 ? SP : FU;
    s.causal = page == 16;
    s.qo_len_max = page == 16 ? 3 : 1;
    s.empty_fraction = page == 16 ? 0.3 : 0.0;
    PlanOptions o;
    o.min_chunk_tokens = 2048;
    const Plan p = plan(test::make_case(s).problem(DeviceKind::cuda), o);
    int longest = 0;
    for (const WorkTile& t : p.tiles()) longest = std::max(longest, t.kv_end - t.kv_begin);
    EXPECT_GE(longest, 32 * 64) << "page " << page << ": no tile takes the gather kernel";
    run_case(s, o);
  }
}

TEST(CudaDecodeSparse, TopkWithSkippedEntries) {
  SKIP_WITHOUT_GPU();
  const struct {
    KvFormat f;
    int heads, page_size, topk;
  } cases[] = {{BL, 64, 64, 128}, {BL, 8, 64, 512}, {F8, 128, 1, 96},
               {F8, 16, 16, 300}, {BF, 8, 64, 64},  {BL, 128, 64, 2048}};
  for (const auto& k : cases) {
    test::ProblemSpec s;
    s.format = k.f;
    s.num_heads = k.heads;
    s.page_size = k.page_size;
    s.batch = 3;
    s.qo_len_min = 1;
    s.qo_len_max = 2;
    s.kv_len_min = 64;
    s.kv_len_max = 3000;
    s.topk = k.topk;
    s.seed = 500 + static_cast<std::uint64_t>(k.topk);
    run_case(s);
  }
}

// DSA picks new indices every layer: run() takes them as a device tensor.
TEST(CudaDecodeSparse, RunTimeIndicesOverrideThePlannedOnes) {
  SKIP_WITHOUT_GPU();
  test::ProblemSpec s;
  s.format = BL;
  s.num_heads = 64;
  s.page_size = 64;
  s.batch = 2;
  s.kv_len_min = 500;
  s.kv_len_max = 900;
  s.topk = 256;
  s.seed = 9;
  test::RandomCase c = test::make_case(s);
  s.seed = 10;  // other indices over the same pool shape
  test::RandomCase other = test::make_case(s);
  // Reference: plan `c` with other's indices (same pool bytes: c.cache).
  std::vector<std::int32_t> idx = other.sparse_indices;
  const std::int64_t pool = c.num_pages * s.page_size;
  for (auto& v : idx)
    if (v >= pool) v = -1;
  Problem pr = c.problem();
  pr.sparse_indices = idx;
  PlanOptions ro;
  ro.cpu_reference = true;
  test::HostOutput ref(c);
  run(plan(pr, ro), c.host_args(ref));

  DeviceBuffer cache(c.cache), q(c.q), d_idx(idx);
  DeviceOutput d(c, 64);
  Plan p = plan(c.problem(DeviceKind::cuda));
  RunArgs args = device_args(c, cache, q, d);
  args.sparse_indices = c.sparse_view(d_idx.ptr, DeviceKind::cuda);
  run(p, args);
  detail::cuda_synchronize(0);
  expect_matches(d, ref, "sparse override");
}

// `o` made graph-mode for decode batches of up to o.max_batch requests (8 when unset) of one
// query token each over c's pool.
PlanOptions graph_options(const test::RandomCase& c, PlanOptions o = {}) {
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
// c1's pool is not poisoned: c2 reads pages c1 left unused) and the same graph replayed; both
// replays must match the reference. check(p, 1 | 2) runs after each plan (its fatal failures
// stop the test).
template <class Second, class Check>
void capture_replan_replay(test::ProblemSpec s, PlanOptions o, Second second, Check check) {
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
}

// capture_replan_replay for six requests of spec s, re-planned to new lengths of 0-5000 tokens.
void capture_replan_replay_lengths(test::ProblemSpec s) {
  s.batch = 6;
  s.spare_pages = 400 * 16 / s.page_size;  // room for the second batch's longer contexts
  PlanOptions o;
  o.max_batch = 8;
  auto second = [](const test::RandomCase& c) { return with_new_lengths(c, 5000, 99); };
  capture_replan_replay(s, o, second, [](const Plan&, int) {});
}

// run() captured in a CUDA graph; replan() with new lengths; the replay matches the reference.
// Five kernel families: the fp8 <= 16-row TMA kernel (16 heads, page 16), the fp8 gather kernel
// and the bf16 TMA kernel's gather instantiation (8 heads, page 1), the bf16 seesaw kernel (128
// heads, page 64) and the fp8 warp-specialized kernel (128 heads, page 64).
TEST(CudaGraph, CaptureReplanReplay) {
  SKIP_WITHOUT_GPU();
  const struct {
    KvFormat f;
    int heads, page_size;
  } kinds[] = {{F8, 16, 16}, {F8, 8, 1}, {BF, 8, 1}, {BF, 128, 64}, {F8, 128, 64}};
  for (const auto& k : kinds) {
    SCOPED_TRACE(std::string(format_name(k.f)) + ", heads " + std::to_string(k.heads) + ", page " +
                 std::to_string(k.page_size));
    capture_replan_replay_lengths(decode_spec(k.f, k.heads, k.page_size, 1, 3000, 31));
  }
}

// Multi-token requests (MTP) on an fp8 cache with <= 16 heads: while the batch is too small to
// fill the GPU (<= 128 kv tokens an SM, 16-row tiles <= a quarter of the SMs) the planner caps
// tiles at 16 rows by itself (max_tile_rows = 0; plan.cpp resolve_max_tile_rows, bench/NOTES.md
// mtp2), and the capped plan matches the reference; with longer contexts, more requests,
// exact_scores, a bf16 cache or a graph plan sized for more it keeps tiles of up to 64 rows.
TEST(CudaPlan, FewMultiTokenRequestsTakeSixteenRowTiles) {
  SKIP_WITHOUT_GPU();
  const int sms = detail::cuda_sm_count(0);
  auto spec = [](KvFormat format, int batch, int kv_len) {
    test::ProblemSpec s = decode_spec(format, 16, 64, kv_len, kv_len, 61 + batch);
    s.batch = batch;
    s.qo_len_min = s.qo_len_max = 2;
    s.causal = true;
    return s;
  };
  auto tokens_a_tile = [](const test::RandomCase& c, const PlanOptions& o) {
    const Plan p = plan(c.problem(DeviceKind::cuda), o);
    int most = 0;
    for (const WorkTile& t : p.tiles()) most = std::max(most, t.q_count);
    return most;
  };
  const int few = sms / 8;                    // 2 tiles a request: a quarter of the SMs
  const int short_kv = 128 * sms / few - 64;  // their tokens: just under 128 an SM
  const test::RandomCase one = test::make_case(spec(F8, 1, 900)),
                         some = test::make_case(spec(F8, few, short_kv)),
                         longer = test::make_case(spec(F8, few, short_kv + 128)),
                         more = test::make_case(spec(F8, few + 1, 900)),
                         bf16 = test::make_case(spec(BF, 1, 900));
  PlanOptions exact;
  exact.exact_scores = true;
  EXPECT_EQ(tokens_a_tile(one, {}), 1);
  EXPECT_EQ(tokens_a_tile(some, {}), 1);
  EXPECT_EQ(tokens_a_tile(longer, {}), 2);
  EXPECT_EQ(tokens_a_tile(more, {}), 2);
  EXPECT_EQ(tokens_a_tile(one, exact), 2);
  EXPECT_EQ(tokens_a_tile(bf16, {}), 2);
  PlanOptions small_graph = graph_options(one), large_graph = graph_options(one);
  small_graph.max_batch = 1;
  small_graph.max_total_q = small_graph.max_qo_len = large_graph.max_qo_len = 2;
  large_graph.max_batch = few + 1;
  large_graph.max_total_q = 2 * (few + 1);
  EXPECT_EQ(tokens_a_tile(one, small_graph), 1);
  EXPECT_EQ(tokens_a_tile(one, large_graph), 2);
  run_case(spec(F8, 1, 900));
  run_case(spec(F8, few, short_kv));
}

// replan() rewrites the device buffers (tiles, page table) that a run still queued or running
// reads, so it must wait for that run, also on a stream that does not synchronise with the
// legacy one (replan's copies take the legacy stream, which CUDA orders only against blocking
// streams). Device work (100 memsets of 4 GB) holds the stream, so the run is still queued when
// replan() is called; it must then compute c1, not c2. On the H200's driver (580) a trial build
// without replan's wait passed too, with this form and with a host function holding the stream
// (bench/results/h200_s29_replan_wait.txt): that driver's pageable copies waited for the queued
// work themselves, so the wait is kept for what CUDA documents, and the test guards the contract.
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
// splits captures the form that loads every split before the row max (decode.cu,
// split_merge_kernel<32, 4>); re-planned to more splits than it preloads, the same graph node
// must take its general path and still match the reference.
TEST(CudaGraph, MergeFormCapturedShortServesLongContexts) {
  SKIP_WITHOUT_GPU();
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

// Two runs on one stream, no sync between them, the second's q_nope being the first's out: the
// decode launch is a programmatic dependent of the kernel before it (the first run's split merge,
// which lets it launch as soon as the merge starts its work), so a decode kernel that read q
// before griddepcontrol.wait would read the poisoned out, and one that wrote its split partials
// before it would corrupt the first run's merge (the negative control in
// bench/results/h200_v34_pdl_ab.txt). Every decode kernel, eagerly and in a CUDA graph.
TEST(CudaStream, ChainedRunsSeeTheRunBefore) {
  SKIP_WITHOUT_GPU();
  struct Chain {
    KvFormat format;
    int heads, page_size;
    const char* kernel;
    bool exact_scores = false;  // PlanOptions::exact_scores: the fp8 fragment kernel
  };
  const Chain chains[] = {{F8, 16, 64, "fp8 <= 16 rows, TMA"},
                          {F8, 8, 1, "fp8 <= 16 rows, gather"},
                          {F8, 8, 1, "fp8 <= 16 rows, fragments", true},
                          {F8, 128, 64, "fp8 17-64 rows"},
                          {BF, 64, 1, "bf16 17-64 rows"},
                          {BF, 8, 16, "bf16 <= 16 rows, TMA"},
                          {BF, 8, 1, "bf16 <= 16 rows, gather"},
                          {BL, 16, 64, "fp8_e4m3_block"}};
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

// The GPU append writes the same bytes as the host codec.
TEST(CudaCache, AppendIsBitIdenticalToHost) {
  SKIP_WITHOUT_GPU();
  for (KvFormat f : {F8, BF, BL}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      CacheConfig cfg;
      cfg.num_pages = 40;
      cfg.page_size = 16;
      cfg.format = f;
      cfg.scale = f == F8 ? 0.37f : 1.0f;
      PagedLatentCache host(cfg);
      cfg.device = DeviceKind::cuda;
      PagedLatentCache dev(cfg);
      host.allocate(40);
      dev.allocate(40);
      const int n = 300;
      std::mt19937_64 rng(5 + static_cast<int>(f));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::uniform_real_distribution<float> mag(-12.0f, 9.0f);  // incl. beyond 448 and tiny
      std::vector<float> ckv(n * 512), kpe(n * 64);
      for (int i = 0; i < n; ++i) {
        const float m = std::exp2(mag(rng));
        for (int k = 0; k < 512; ++k) ckv[i * 512 + k] = normal(rng) * m;
        for (int k = 0; k < 64; ++k) kpe[i * 64 + k] = normal(rng) * m;
      }
      std::vector<std::uint16_t> ckv16(ckv.size()), kpe16(kpe.size());
      for (std::size_t i = 0; i < ckv.size(); ++i) ckv16[i] = float_to_bf16(ckv[i]);
      for (std::size_t i = 0; i < kpe.size(); ++i) kpe16[i] = float_to_bf16(kpe[i]);
      std::vector<std::int32_t> slots(n);
      for (int i = 0; i < n; ++i) slots[i] = (i * 37) % 640;
      const bool f32 = dt == DType::f32;
      void* hc = f32 ? static_cast<void*>(ckv.data()) : ckv16.data();
      void* hk = f32 ? static_cast<void*>(kpe.data()) : kpe16.data();
      host.append(make_view(slots.data(), DType::i32, {n}), make_view(hc, dt, {n, 512}),
                  make_view(hk, dt, {n, 64}));
      DeviceBuffer ds(slots);
      DeviceBuffer dck(ckv.size() * (f32 ? 4 : 2)), dkp(kpe.size() * (f32 ? 4 : 2));
      detail::cuda_copy_to_device(dck.ptr, hc, dck.bytes);
      detail::cuda_copy_to_device(dkp.ptr, hk, dkp.bytes);
      dev.append(make_view(ds.ptr, DType::i32, {n}, DeviceKind::cuda),
                 make_view(dck.ptr, dt, {n, 512}, DeviceKind::cuda),
                 make_view(dkp.ptr, dt, {n, 64}, DeviceKind::cuda));
      detail::cuda_synchronize(0);
      const TensorView hs = host.storage(), dsv = dev.storage();
      const std::size_t bytes = static_cast<std::size_t>(hs.numel());
      std::vector<std::uint8_t> dev_bytes(bytes);
      detail::cuda_copy_to_host(dev_bytes.data(), dsv.data, bytes);
      const auto* hb = static_cast<const std::uint8_t*>(hs.data);
      std::size_t mismatches = 0, first = bytes;
      for (std::size_t i = 0; i < bytes; ++i)
        if (hb[i] != dev_bytes[i]) {
          ++mismatches;
          first = std::min(first, i);
        }
      EXPECT_EQ(mismatches, 0u) << format_name(f) << " " << dtype_name(dt) << ": first at byte "
                                << first;
    }
  }
}

TEST(CudaMerge, MatchesHostMerge) {
  SKIP_WITHOUT_GPU();
  const int rows = 37, states = 5, dim = 512;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(rows * states * dim), s(rows * states);
  for (auto& x : v) x = normal(rng);
  for (int i = 0; i < rows * states; ++i) s[i] = (i % 7 == 0) ? -INFINITY : 3.0f * normal(rng);
  for (int k = 0; k < states; ++k) s[5 * states + k] = -INFINITY;  // an all-empty row
  std::vector<float> ho(rows * dim), hs(rows), go(rows * dim), gs(rows);
  merge_states(make_view(v.data(), DType::f32, {rows, states, dim}),
               make_view(s.data(), DType::f32, {rows, states}),
               make_view(ho.data(), DType::f32, {rows, dim}),
               make_view(hs.data(), DType::f32, {rows}));
  DeviceBuffer dv(v), ds(s), dout(go.size() * 4), dlse(gs.size() * 4);
  merge_states(make_view(dv.ptr, DType::f32, {rows, states, dim}, DeviceKind::cuda),
               make_view(ds.ptr, DType::f32, {rows, states}, DeviceKind::cuda),
               make_view(dout.ptr, DType::f32, {rows, dim}, DeviceKind::cuda),
               make_view(dlse.ptr, DType::f32, {rows}, DeviceKind::cuda));
  detail::cuda_synchronize(0);
  go = dout.to_host<float>();
  gs = dlse.to_host<float>();
  const test::Comparison co = test::compare_f32(go, ho);
  EXPECT_TRUE(co.nan_ok()) << test::describe(co);
  EXPECT_LE(co.rel_l2, 1e-5) << test::describe(co);
  const test::LseComparison cl = test::compare_lse(gs, hs);
  EXPECT_TRUE(cl.positions_ok()) << test::describe(cl);
  EXPECT_LE(cl.max_err, 1e-5) << test::describe(cl);
  EXPECT_EQ(gs[5], -INFINITY);
}

TEST(CudaValidation, MisalignedCacheIsRejected) {
  SKIP_WITHOUT_GPU();
  test::ProblemSpec s;
  s.format = F8;
  s.batch = 1;
  s.kv_len_min = s.kv_len_max = 40;
  s.token_pad_bytes = 8;  // token stride 584: not a multiple of 16
  test::RandomCase c = test::make_case(s);
  DeviceBuffer cache(c.cache), q(c.q), out(c.rows() * 1024);
  Plan p = plan(c.problem(DeviceKind::cuda));
  RunArgs args;
  args.q_nope = c.q_nope_view(q.ptr, DeviceKind::cuda);
  args.q_pe = c.q_pe_view(q.ptr, DeviceKind::cuda);
  args.kv = c.kv_view(cache.ptr, DeviceKind::cuda);
  args.out = c.out_view(out.ptr, DeviceKind::cuda);
  try {
    run(p, args);
    FAIL() << "misaligned cache accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("kv.ckv"), std::string::npos) << e.what();
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

// A page table on the device (Problem::device_kv_indices) plans what the host one does: the same
// tiles and bit-identical output, run on a non-blocking stream right after plan() (its copies
// have landed when plan() returns); an entry outside the pool is named with its index and value;
// a graph-mode plan made and re-planned from device tables replays each batch.
TEST(CudaPlan, DevicePageTableMatchesTheHostOne) {
  SKIP_WITHOUT_GPU();
  test::ProblemSpec s = decode_spec(F8, 16, 1, 1, 3000, 94);
  s.batch = 6;
  s.spare_pages = 6400;  // the second batch's longer contexts
  s.poison_unused = false;
  test::RandomCase c = test::make_case(s);
  test::HostOutput ref = reference(c);
  DeviceBuffer cache(c.cache), q(c.q), table(c.kv_indices);
  auto on_device = [](const test::RandomCase& k, const DeviceBuffer& t) {
    Problem p = k.problem(DeviceKind::cuda);
    p.kv_indices = {};
    p.device_kv_indices = make_view(
        t.ptr, DType::i32, {static_cast<std::int64_t>(k.kv_indices.size())}, DeviceKind::cuda);
    return p;
  };
  TestStream stream;
  DeviceOutput host_out(c, 256), dev_out(c, 256);
  const Plan from_host = plan(c.problem(DeviceKind::cuda));
  const Plan from_device = plan(on_device(c, table));
  ASSERT_EQ(from_host.tiles().size(), from_device.tiles().size());
  RunArgs a = device_args(c, cache, q, host_out);
  a.stream = stream.s;
  run(from_host, a);
  RunArgs b = device_args(c, cache, q, dev_out);
  b.stream = stream.s;
  run(from_device, b);
  check_cuda(cudaStreamSynchronize(stream.s));
  expect_matches(host_out, ref, "host page table");
  expect_matches(dev_out, ref, "device page table");
  EXPECT_EQ(host_out.out.to_host<std::uint16_t>(), dev_out.out.to_host<std::uint16_t>());

  std::vector<std::int32_t> bad = c.kv_indices;
  const std::size_t at = bad.size() * 2 / 3;
  bad[at] = static_cast<std::int32_t>(c.num_pages) + 5;
  DeviceBuffer bad_table(bad);
  try {
    (void)plan(on_device(c, bad_table));
    ADD_FAILURE() << "a page outside the pool accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "device_kv_indices[" + std::to_string(at) + "]") << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(bad[at]) + " is outside the pool"),
              std::string::npos)
        << e.what();
  }

  Plan g = plan(on_device(c, table), graph_options(c));
  DeviceOutput d(c, 0);
  RunArgs ga = device_args(c, cache, q, d);
  ga.stream = stream.s;
  CapturedGraph graph(stream.s, [&] { run(g, ga); });
  graph.replay();
  expect_matches(d, ref, "graph, device page table");
  test::RandomCase c2 = with_new_lengths(c, 5000, 95);
  DeviceBuffer table2(c2.kv_indices);
  replan(g, on_device(c2, table2));
  d.poison_all();
  graph.replay();
  test::HostOutput ref2 = reference(c2);
  expect_matches(d, ref2, "graph, re-planned on device");
}

}  // namespace
}  // namespace fp8mla
