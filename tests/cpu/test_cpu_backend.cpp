// The CPU backend (src/cpu): the float64 reference and the threaded fast path (merge_states:
// test_merge_states.cpp).
//
// The reference is checked against answers known in closed form; the fast path is then checked
// against the reference on a grid of random problems. Tolerance of fast vs reference: both read
// bit-identical dequantized values through KvReader, so the difference measures float32 vs
// float64 accumulation (dot products of 576 terms, the softmax sum, the weighted sum of values)
// plus the output's bf16 rounding (half an ulp is 2^-9 relative; the two results round to
// different neighbours only near a rounding boundary). Rel L2 <= 4e-3 bounds that with room;
// lse is float32 of a sum of exps: |err| <= 1e-4 * max(1, |lse|). Measured on the grid: rel L2
// at most ~1e-4, lse error at most ~3e-7, so a real bug (a dropped rope term, a wrong mask, a
// missing rescale) shows up orders of magnitude above the bound.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/format.h"
#include "src/core/backend.h"
#include "src/core/plan_state.h"
#include "src/cpu/kv_reader.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

using test::CacheLayout;
using test::ProblemSpec;

constexpr double kRelL2Tol = 4e-3;
constexpr double kLseTol = 1e-4;

// ---- the grid: one row per case, fresh data per row (seeded from its name) ----

constexpr KvFormat kBf16 = KvFormat::bf16;
constexpr KvFormat kFp8 = KvFormat::fp8_e4m3;
constexpr KvFormat kBlock = KvFormat::fp8_e4m3_block;

// Layout and value variations on top of a row's shape.
enum class Variant {
  plain,
  scaled,    // fp8_e4m3 scales ckv 0.5, kpe 2
  split_u8,  // separate ckv / kpe regions, u8-typed views, 32 bytes after each token
  split_q,   // separate regions, q_nope / q_pe views of one buffer, 64-byte token pad
  wide_q,    // q views of one buffer, 16-byte token pad, magnitudes 2^[-6, 6]
};

struct GridRow {
  const char* name;
  int batch, heads, page_size;
  KvFormat format;
  int qo_min, qo_max, kv_min, kv_max;
  double empty;  // probability of kv_len = 0
  bool causal;
  int topk;        // > 0: sparse
  double invalid;  // sparse: probability of a -1 entry
  Variant variant;
};
using enum Variant;

// Heads 1..128, page sizes 1..128, the three formats, decode / MTP / prefill-like query lengths
// causal and not, ragged kv_len with zeros and non-multiples of the page size, sparse topk with
// -1 entries (and rows whose every entry is -1), split ckv/kpe layouts, padded strides.
// Columns: name, batch, heads, page size, format, qo_len min / max, kv_len min / max,
// P(kv_len = 0), causal, topk (> 0: sparse), P(index = -1), variant.
// clang-format off
const GridRow kGrid[] = {
  {"decode_h1_ps1_fp8",      5,   1,   1, kFp8,   1,  1,    0,  200,  0.2, 0,    0,   0, plain},
  {"decode_h8_ps16_bf16",    4,   8,  16, kBf16,  1,  1,    0,  300,  0.2, 0,    0,   0, plain},
  {"decode_h16_ps64_block",  4,  16,  64, kBlock, 1,  1,    1,  400,    0, 0,    0,   0, plain},
  {"decode_h20_ps128_scale", 4,  20, 128, kFp8,   1,  1,    0,  300,    0, 0,    0,   0, scaled},
  {"decode_h64_ps16_block",  3,  64,  16, kBlock, 1,  1,    0,  200,  0.3, 0,    0,   0, plain},
  {"decode_h128_ps64_fp8",   2, 128,  64, kFp8,   1,  1,    1,  150,    0, 0,    0,   0, plain},
  {"decode_h128_ps8_bf16",   2, 128,   8, kBf16,  1,  1,    0,  300,    0, 0,    0,   0, plain},
  {"decode_long_h16_ps32",   3,  16,  32, kFp8,   1,  1, 1000, 5000,    0, 0,    0,   0, plain},
  {"mtp_causal_h16_ps16",    4,  16,  16, kFp8,   1,  4,    4,  200,    0, 1,    0,   0, plain},
  {"mtp_causal_h8_ps1_bf16", 3,   8,   1, kBf16,  1, 16,   16,  120,  0.3, 1,    0,   0, plain},
  {"prefill_causal_h1_ps64", 4,   1,  64, kBlock, 1, 16,   16,  300, 0.25, 1,    0,   0, plain},
  {"causal_h128_ps16_fp8",   2, 128,  16, kFp8,   1,  3,    3,  100,    0, 1,    0,   0, plain},
  {"noncausal_h20_ps128",    3,  20, 128, kBlock, 2, 16,    0,  150,  0.3, 0,    0,   0, plain},
  {"noncausal_h64_ps1_fp8",  2,  64,   1, kFp8,   1,  2,    1,  200,    0, 0,    0,   0, plain},
  {"sparse_h16_ps64_fp8",    4,  16,  64, kFp8,   1,  1,    0,  300,  0.1, 0,   64, .15, plain},
  {"sparse_h64_ps1_block",   3,  64,   1, kBlock, 1,  2,    1,  300,    0, 0,  128, .15, plain},
  {"sparse_h128_ps16_bf16",  2, 128,  16, kBf16,  1,  1,    1,  200,    0, 0,   32,  .5, plain},
  {"sparse_h8_topk300_fp8",  4,   8,  16, kFp8,   1,  3,    0,  200, 0.25, 0,  300, .15, plain},
  {"sparse_h1_ps128_inv90",  6,   1, 128, kBlock, 1,  2,    0,  100,  0.5, 0,   48,  .9, plain},
  {"sparse_h128_topk2048",   1, 128,  64, kBlock, 1,  1, 3000, 3000,    0, 0, 2048, .05, plain},
  {"split_u8_pad_h16",       3,  16,  16, kFp8,   1,  1,    0,  250,    0, 0,    0,   0, split_u8},
  {"split_bf16_q_pad_h8",    3,   8,  64, kBf16,  1,  3,    3,  250,    0, 1,    0,   0, split_q},
  {"block_pad_q_h20_wide",   3,  20,   1, kBlock, 1,  1,    0,  200,    0, 0,    0,   0, wide_q},
  {"all_empty_h8",           3,   8,  16, kFp8,   1,  4,    0,    0,    0, 0,    0,   0, plain},
};
// clang-format on

ProblemSpec to_spec(const GridRow& row) {
  ProblemSpec s{.batch = row.batch,
                .num_heads = row.heads,
                .page_size = row.page_size,
                .format = row.format,
                .qo_len_min = row.qo_min,
                .qo_len_max = row.qo_max,
                .kv_len_min = row.kv_min,
                .kv_len_max = row.kv_max,
                .empty_fraction = row.empty,
                .causal = row.causal,
                .topk = row.topk,
                .invalid_fraction = row.invalid};
  switch (row.variant) {
    case Variant::plain:
      break;
    case Variant::scaled:
      s.ckv_scale = 0.5f;
      s.kpe_scale = 2.0f;
      break;
    case Variant::split_u8:
      s.layout = CacheLayout::split;
      s.token_pad_bytes = 32;
      s.fp8_as_u8 = true;
      break;
    case Variant::split_q:
      s.layout = CacheLayout::split;
      s.token_pad_bytes = 64;
      s.fused_q = true;
      break;
    case Variant::wide_q:
      s.token_pad_bytes = 16;
      s.fused_q = true;
      s.magnitude_log2 = 6.0f;
      break;
  }
  s.seed = 1469598103934665603ull;  // FNV-1a of the name: a fixed, distinct seed per row
  for (const char* c = row.name; *c != '\0'; ++c) {
    s.seed = (s.seed ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  }
  return s;
}

// gtest prints a parameter with this instead of its bytes.
void PrintTo(const GridRow& row, std::ostream* os) {
  *os << row.name;
}

// ---- helpers ----

// Options that split every request longer than 64 tokens (chunks of 64, many units).
PlanOptions split_heavy() {
  PlanOptions o;
  o.sm_count = 512;
  o.min_chunk_tokens = 1;
  return o;
}

struct Result {
  std::vector<std::uint16_t> out;
  std::vector<float> lse;
};

// Runs `plan` on `c` (through the public run(), which dispatches to cpu_run or, with
// options.cpu_reference, cpu_reference) with guarded, poisoned outputs.
Result run_case(test::RandomCase& c, const Plan& p, const TensorView* sparse = nullptr) {
  test::HostOutput o(c, 1024);
  RunArgs args = c.host_args(o);
  if (sparse != nullptr) args.sparse_indices = *sparse;
  run(p, args);
  EXPECT_TRUE(o.guards_intact()) << "a write outside out / lse";
  return {{o.out().begin(), o.out().end()}, {o.lse().begin(), o.lse().end()}};
}

Result reference(test::RandomCase& c, const TensorView* sparse = nullptr) {
  PlanOptions o;
  o.cpu_reference = true;
  return run_case(c, plan(c.problem(), o), sparse);
}

void expect_close(const Result& got, const Result& ref, const std::string& what) {
  const test::Comparison out = test::compare_bf16(got.out, ref.out);
  EXPECT_TRUE(out.nan_ok()) << what << ": " << describe(out);
  EXPECT_LE(out.rel_l2, kRelL2Tol) << what << ": " << describe(out);
  const test::LseComparison lse = test::compare_lse(got.lse, ref.lse);
  EXPECT_TRUE(lse.positions_ok()) << what << ": " << describe(lse);
  EXPECT_LE(lse.max_err, kLseTol) << what << ": " << describe(lse);
}

// ---- fast path vs reference on the grid ----

class CpuBackendGrid : public ::testing::TestWithParam<GridRow> {};

TEST_P(CpuBackendGrid, FastMatchesReference) {
  const ProblemSpec spec = to_spec(GetParam());
  test::RandomCase c = test::make_case(spec);
  SCOPED_TRACE(test::describe(spec));
  const Result ref = reference(c);
  // No NaN in the reference: it never read a poisoned (unlisted or past-kv_len) slot.
  for (std::uint16_t b : ref.out) ASSERT_FALSE(std::isnan(bf16_to_float(b)));
  for (float v : ref.lse) ASSERT_FALSE(std::isnan(v));

  const Plan unsplit = plan(c.problem());
  expect_close(run_case(c, unsplit), ref, "default plan");
  const Plan split = plan(c.problem(), split_heavy());
  expect_close(run_case(c, split), ref, "split-heavy plan");
  PlanOptions one_token;  // a tile a query token (options.max_tile_rows): q blocks past 0
  one_token.max_tile_rows = 1;
  expect_close(run_case(c, plan(c.problem(), one_token)), ref, "one-token tiles");
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuBackendGrid, ::testing::ValuesIn(kGrid),
                         [](const auto& row) { return std::string(row.param.name); });

// ---- the reference itself, against closed-form answers ----

// One head, bf16 cache, one page of two tokens. q_nope = 0 and q_pe = e0, so the scores are
// sm_scale * kpe_j[0] = {0, ln 3}: softmax weights {1/4, 3/4}, lse = ln(1 + 3) = ln 4.
// Values: v0 = 4 e1, v1 = e0 + 8 e2, so o = (3/4, 1, 6, 0, ...), exact in bf16.
// Request 0: two query tokens, causal: token 0 sees only token 0 (o = v0, lse = 0).
// Request 1: one query token and no cache (o = 0, lse = -inf).
// Shifted: causal_len = {3, 0}, as a context-parallel shard whose context runs one token past
// the two held: token 0 then sees both tokens too.
TEST(CpuBackendReference, TinyCaseHasTheClosedFormAnswer) {
  std::vector<std::uint16_t> cache(2 * kDimQk, 0);  // [1 page, 2 tokens, 576] bf16
  cache[kDimCkv] = 0;                               // token 0: kpe[0] = 0
  cache[1] = float_to_bf16(4.0f);                   // token 0: ckv[1] = 4
  cache[kDimQk + 0] = float_to_bf16(1.0f);          // token 1: ckv[0] = 1
  cache[kDimQk + 2] = float_to_bf16(8.0f);          // token 1: ckv[2] = 8
  cache[kDimQk + kDimCkv] = float_to_bf16(1.0f);    // token 1: kpe[0] = 1
  std::vector<std::uint16_t> q_nope(3 * kDimCkv, 0);
  std::vector<std::uint16_t> q_pe(3 * kDimKpe, 0);
  for (int t = 0; t < 3; ++t) q_pe[t * kDimKpe] = float_to_bf16(1.0f);

  const std::vector<std::int32_t> qo_indptr{0, 2, 3}, kv_indptr{0, 1, 1}, kv_indices{0},
      kv_len{2, 0};
  Problem pr;
  pr.num_heads = 1;
  pr.page_size = 2;
  pr.num_pages = 1;
  pr.kv_format = KvFormat::bf16;
  pr.causal = true;
  pr.sm_scale = static_cast<float>(std::log(3.0));
  pr.qo_indptr = qo_indptr;
  pr.kv_indptr = kv_indptr;
  pr.kv_indices = kv_indices;
  pr.kv_len = kv_len;

  const std::vector<std::int32_t> shifted_len{3, 0};
  for (const bool shifted : {false, true})
    for (bool use_reference : {true, false}) {
      SCOPED_TRACE(std::string(use_reference ? "reference" : "fast path") +
                   (shifted ? ", causal_len {3, 0}" : ""));
      pr.causal_len =
          shifted ? std::span<const std::int32_t>(shifted_len) : std::span<const std::int32_t>();
      PlanOptions options;
      options.cpu_reference = use_reference;
      const Plan p = plan(pr, options);
      test::HostOutput o(3, 1);
      RunArgs args;
      args.q_nope = make_view(q_nope.data(), DType::bf16, {3, 1, kDimCkv});
      args.q_pe = make_view(q_pe.data(), DType::bf16, {3, 1, kDimKpe});
      args.kv.format = KvFormat::bf16;
      args.kv.ckv =
          make_strided_view(cache.data(), DType::bf16, {1, 2, kDimCkv}, {2 * kDimQk, kDimQk, 1});
      args.kv.kpe = make_strided_view(cache.data() + kDimCkv, DType::bf16, {1, 2, kDimKpe},
                                      {2 * kDimQk, kDimQk, 1});
      args.out = o.out_view();
      args.lse = o.lse_view();
      run(p, args);
      auto out = [&](int t, int d) { return bf16_to_float(o.out()[t * kDimCkv + d]); };
      // Token 0 sees token 0 only (shifted: both, as token 1).
      if (shifted) {
        EXPECT_EQ(out(0, 0), 0.75f);
        EXPECT_EQ(out(0, 1), 1.0f);
        EXPECT_EQ(out(0, 2), 6.0f);
        EXPECT_NEAR(o.lse()[0], std::log(4.0), 1e-6);
      } else {
        EXPECT_EQ(out(0, 1), 4.0f);
        EXPECT_EQ(o.lse()[0], 0.0f);
      }
      // Token 1 sees both.
      EXPECT_EQ(out(1, 0), 0.75f);
      EXPECT_EQ(out(1, 1), 1.0f);
      EXPECT_EQ(out(1, 2), 6.0f);
      EXPECT_NEAR(o.lse()[1], std::log(4.0), 1e-6);
      // Token 2 (request 1) sees nothing.
      EXPECT_EQ(o.lse()[2], -std::numeric_limits<float>::infinity());
      for (int t = 0; t < 3; ++t) {
        for (int d = 0; d < kDimCkv; ++d) {
          const bool set = (t == 0 && (shifted ? d <= 2 : d == 1)) || (t == 1 && d <= 2);
          if (!set) {
            EXPECT_EQ(out(t, d), 0.0f) << "t=" << t << " d=" << d;
          }
        }
      }
    }
}

// KvReader (shared by both paths) decodes exactly what decode_token does, for every format.
TEST(CpuBackendReference, KvReaderMatchesDecodeToken) {
  for (KvFormat f : {kBf16, kFp8, kBlock}) {
    ProblemSpec spec = to_spec({"reader", 2, 1, 4, f, 1, 1, 0, 40, 0, 0, 0, 0, plain});
    spec.token_pad_bytes = 8;
    spec.ckv_scale = spec.kpe_scale = 0.25f;  // one scale: decode_token takes one
    test::RandomCase c = test::make_case(spec);
    const detail::KvReader reader(c.kv_view(c.cache.data()));
    const std::int64_t stride = token_bytes(f) + spec.token_pad_bytes;
    std::vector<float> got(kDimQk), want(kDimQk);
    for (int r = 0; r < spec.batch; ++r) {
      for (std::int64_t slot : c.request_slots(r)) {
        reader.read(slot / spec.page_size, slot % spec.page_size, got.data());
        decode_token(f, spec.ckv_scale,
                     std::span(c.cache).subspan(static_cast<std::size_t>(slot * stride),
                                                static_cast<std::size_t>(token_bytes(f))),
                     want);
        for (int d = 0; d < kDimQk; ++d) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(got[d]), std::bit_cast<std::uint32_t>(want[d]))
              << format_name(f) << " slot " << slot << " d " << d;
        }
      }
    }
  }
}

// The vectorised e4m3 decoder in KvReader against fp8_e4m3_to_float for all 256 codes, times a
// per-tensor scale (fp8_e4m3) and times each group's block scale (fp8_e4m3_block).
TEST(CpuBackendReference, KvReaderDecodesEveryFp8Code) {
  std::vector<std::uint8_t> fp8(kDimQk);
  for (int i = 0; i < kDimQk; ++i) fp8[i] = static_cast<std::uint8_t>(i * 7 % 256);  // all codes
  std::vector<std::uint8_t> block(656);
  for (int i = 0; i < kDimCkv; ++i) block[i] = static_cast<std::uint8_t>(i % 256);
  const float block_scales[kBlockScales] = {0x1p-13f, 1.0f, 0x1p+10f, 0.3f};
  std::memcpy(block.data() + kBlockScaleOffset, block_scales, sizeof(block_scales));
  auto expect_same = [](float got, float want, const std::string& what) {
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << what;
    } else {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(want)) << what;
    }
  };
  std::vector<float> got(kDimQk);
  for (float scale : {1.0f, 0.0173f, 3.0f}) {
    KvCacheView kv;
    kv.format = kFp8;
    kv.ckv = make_strided_view(fp8.data(), DType::u8, {1, 1, kDimCkv}, {kDimQk, kDimQk, 1});
    kv.kpe = make_strided_view(fp8.data() + kDimCkv, DType::fp8_e4m3, {1, 1, kDimKpe},
                               {kDimQk, kDimQk, 1});
    kv.ckv_scale = scale;
    kv.kpe_scale = 2.0f * scale;
    detail::KvReader(kv).read(0, 0, got.data());
    for (int i = 0; i < kDimQk; ++i) {
      const float s = i < kDimCkv ? scale : 2.0f * scale;
      expect_same(got[i], fp8_e4m3_to_float(fp8[i]) * s, "fp8 code " + std::to_string(fp8[i]));
    }
  }
  KvCacheView kv;
  kv.format = kBlock;
  kv.ckv = make_view(block.data(), DType::u8, {1, 1, 656});
  detail::KvReader(kv).read(0, 0, got.data());
  for (int i = 0; i < kDimCkv; ++i) {
    expect_same(got[i], fp8_e4m3_to_float(block[i]) * block_scales[i / kBlockGroup],
                "block code " + std::to_string(block[i]));
  }
}

// A NaN in the cache reaches exactly the rows that see it: with causal MTP only the last query
// token sees the request's last cache token, and the rows before it stay finite (the fast path
// never multiplies a value a row cannot see, not even by a zero weight).
TEST(CpuBackendReference, NanInTheCacheReachesOnlyTheRowsThatSeeIt) {
  test::RandomCase c =
      test::make_case(to_spec({"nan", 2, 8, 16, kBf16, 4, 4, 200, 300, 0, 1, 0, 0, plain}));
  for (int r = 0; r < c.spec.batch; ++r) {
    const std::int64_t slot = c.request_slots(r).back();
    const std::vector<float> nan_token(kDimQk, std::nanf(""));
    std::vector<std::uint8_t> bytes(token_bytes(kBf16));
    encode_token(kBf16, 1.0f, nan_token, bytes);
    // Fused bf16 layout: token `slot` at slot * 1152 bytes.
    std::copy(bytes.begin(), bytes.end(), c.cache.begin() + slot * token_bytes(kBf16));
  }
  const Result ref = reference(c);
  for (const Result& got :
       {ref, run_case(c, plan(c.problem())), run_case(c, plan(c.problem(), split_heavy()))}) {
    for (int t = 0; t < c.total_q; ++t) {
      const bool sees_nan = t % 4 == 3;
      for (int h = 0; h < c.spec.num_heads; ++h) {
        const std::size_t row = static_cast<std::size_t>(t * c.spec.num_heads + h);
        ASSERT_EQ(std::isnan(bf16_to_float(got.out[row * kDimCkv])), sees_nan) << "t=" << t;
        ASSERT_EQ(std::isnan(got.lse[row]), sees_nan) << "t=" << t;
      }
    }
  }
}

// ---- splits, threads, sparse overrides, output bounds ----

TEST(CpuBackendSplit, SplitHeavyMatchesUnsplitAndReference) {
  test::RandomCase c = test::make_case(
      to_spec({"split_heavy", 3, 16, 64, kBlock, 1, 2, 1500, 3000, 0, 1, 0, 0, plain}));
  PlanOptions heavy;
  heavy.sm_count = 64;
  const Plan split = plan(c.problem(), heavy);
  ASSERT_GT(split.partial_rows(), 0);
  for (std::int32_t n : split.num_splits()) EXPECT_GT(n, 4);
  PlanOptions one_unit;
  one_unit.sm_count = 1;
  const Plan unsplit = plan(c.problem(), one_unit);
  ASSERT_EQ(unsplit.partial_rows(), 0);
  const Result a = run_case(c, split);
  const Result b = run_case(c, unsplit);
  expect_close(a, b, "split vs unsplit");
  expect_close(a, reference(c), "split vs reference");
}

// Each tile is computed by one thread and merges do the same arithmetic whichever thread runs
// them, so the result does not depend on the thread count.
TEST(CpuBackendSplit, ThreadCountDoesNotChangeTheResult) {
  test::RandomCase c =
      test::make_case(to_spec({"threads", 5, 20, 16, kFp8, 1, 1, 0, 900, 0, 0, 0, 0, plain}));
  std::vector<Result> results;
  for (int threads : {1, 2, 5}) {
    PlanOptions o = split_heavy();
    o.num_threads = threads;
    results.push_back(run_case(c, plan(c.problem(), o)));
  }
  for (std::size_t i = 1; i < results.size(); ++i) {
    EXPECT_EQ(results[i].out, results[0].out);
    for (std::size_t j = 0; j < results[0].lse.size(); ++j) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(results[i].lse[j]),
                std::bit_cast<std::uint32_t>(results[0].lse[j]));
    }
  }
}

// Run-time indices replace the planned ones; entries outside the pool count as -1.
TEST(CpuBackendSparse, RunTimeIndicesReplacePlannedOnesAndSkipOutOfRange) {
  const ProblemSpec spec =
      to_spec({"sparse_override", 3, 16, 16, kFp8, 1, 1, 50, 200, 0, 0, 96, 0.15, plain});
  test::RandomCase c = test::make_case(spec);
  const std::int64_t slots = c.num_pages * spec.page_size;
  std::mt19937_64 rng(14);
  std::vector<std::int32_t> given(c.sparse_indices.size());
  std::vector<std::int32_t> cleaned(given.size());  // the same with invalid entries as -1
  for (int r = 0; r < spec.batch; ++r) {
    const std::vector<std::int64_t> mine = c.request_slots(r);
    for (int t = c.qo_indptr[r]; t < c.qo_indptr[r + 1]; ++t) {
      for (int k = 0; k < spec.topk; ++k) {
        const auto i = static_cast<std::size_t>(t) * spec.topk + k;
        const std::int64_t junk[] = {slots, slots + 5, -7, std::numeric_limits<std::int32_t>::max(),
                                     std::numeric_limits<std::int32_t>::min()};
        const bool valid = rng() % 4 != 0;
        given[i] = static_cast<std::int32_t>(valid ? mine[rng() % mine.size()] : junk[rng() % 5]);
        cleaned[i] = valid ? given[i] : -1;
      }
    }
  }
  const TensorView given_view = c.sparse_view(given.data());
  const Result ref = reference(c, &given_view);
  expect_close(run_case(c, plan(c.problem()), &given_view), ref, "fast, run-time indices");
  expect_close(run_case(c, plan(c.problem(), split_heavy()), &given_view), ref,
               "fast split-heavy, run-time indices");
  // The same indices planned (invalid ones as -1) give the same reference, bit for bit.
  c.sparse_indices = cleaned;
  const Result planned = reference(c);
  EXPECT_EQ(planned.out, ref.out);
}

// out and lse with padding between rows: every real element written, no pad element touched.
TEST(CpuBackendOutput, WritesExactlyTheOutputElements) {
  test::RandomCase c =
      test::make_case(to_spec({"output", 4, 20, 16, kBlock, 1, 3, 0, 400, 0.25, 1, 0, 0, plain}));
  const std::int64_t heads = c.spec.num_heads;
  constexpr std::int64_t kRowPad = 64;  // out: [total_q, H, 512 + 64], lse: [total_q, H + 3]
  constexpr std::int64_t kGuard = 4096;
  for (const PlanOptions& options : {PlanOptions{}, split_heavy()}) {
    const std::int64_t out_row = kDimCkv + kRowPad;
    std::vector<std::uint16_t> out(
        static_cast<std::size_t>(c.total_q * heads * out_row + 2 * kGuard));
    std::vector<float> lse(static_cast<std::size_t>(c.total_q * (heads + 3) + 2 * kGuard));
    test::poison(out);
    test::poison(lse);
    test::HostOutput unused(c);
    RunArgs args = c.host_args(unused);
    args.out = make_strided_view(out.data() + kGuard, DType::bf16, {c.total_q, heads, kDimCkv},
                                 {heads * out_row, out_row, 1});
    args.lse =
        make_strided_view(lse.data() + kGuard, DType::f32, {c.total_q, heads}, {heads + 3, 1});
    run(plan(c.problem(), options), args);
    for (std::size_t i = 0; i < out.size(); ++i) {
      const auto j = static_cast<std::int64_t>(i) - kGuard;
      const bool inside = j >= 0 && j < c.total_q * heads * out_row && j % out_row < kDimCkv;
      ASSERT_EQ(out[i] != test::kPoisonBf16, inside) << "out element " << j;
    }
    for (std::size_t i = 0; i < lse.size(); ++i) {
      const auto j = static_cast<std::int64_t>(i) - kGuard;
      const bool inside = j >= 0 && j < c.total_q * (heads + 3) && j % (heads + 3) < heads;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(lse[i]) != test::kPoisonF32, inside)
          << "lse element " << j;
    }
  }
}

// ---- throughput (not run by default: --gtest_also_run_disabled_tests) ----

TEST(CpuBackendPerf, DISABLED_DecodeThroughput) {
  for (KvFormat f : {kFp8, kBlock, kBf16}) {
    test::RandomCase c =
        test::make_case(to_spec({"perf", 16, 8, 64, f, 1, 1, 4096, 4096, 0, 0, 0, 0, plain}));
    const Plan p = plan(c.problem());
    test::HostOutput o(c);
    const RunArgs args = c.host_args(o);
    run(p, args);  // warm up
    constexpr int kIters = 10;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kIters; ++i) run(p, args);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kIters;
    const double tokens = 16.0 * 4096;
    std::printf("%-15s 16 x 4096 x 8 heads: %.2f ms/run, %.1f M tokens/s, %.2f GB/s of cache\n",
                format_name(f), 1e3 * s, tokens / s / 1e6,
                tokens * static_cast<double>(token_bytes(f)) / s / 1e9);
  }
}

}  // namespace
}  // namespace fp8mla
