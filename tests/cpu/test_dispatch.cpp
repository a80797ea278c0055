// The dispatch table (src/core/dispatch.h): its choices pinned against the rule it replaced (a
// 3x3 table of (format, rows), the launcher's overrides and the planner's 16-row cap, written
// out below as they were), forced families, unsupported devices, names, the scale-ratio test,
// and what CPU plans record. Backend-independent: no device is asked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/dispatch.h"
#include "tests/common/expect_error.h"

namespace fp8mla {
namespace {

using detail::DispatchKey;
using F = KernelFamily;

// The rule before the table, for a Hopper device and a power-of-two scale ratio unless `pow2` is
// false: row_tiles 1, 2 or 4 (16-row m-tiles), longest_tile in kv tokens.
F previous_rule(KvFormat format, int row_tiles, bool sparse, int page_size, bool pow2, bool exact,
                std::int64_t longest_tile) {
  const F table = row_tiles > 1                 ? F::wide_rows
                  : format == KvFormat::bf16 ? F::shared_tile
                                             : F::fp8_exact;
  if (format == KvFormat::fp8_e4m3_block && row_tiles == 1 && !exact) return F::fp8_gather;
  if (sparse)
    return format == KvFormat::fp8_e4m3 && row_tiles == 1 && pow2 && !exact ? F::fp8_gather
                                                                             : table;
  if (row_tiles > 1)
    return format == KvFormat::bf16 && page_size >= 64 ? F::bf16_wide_rows : table;
  if (format == KvFormat::bf16)
    return page_size >= 8 && longest_tile < 32 * 64 ? F::bf16_tma : F::bf16_gather;
  if (format != KvFormat::fp8_e4m3 || !pow2 || exact) return table;
  return page_size >= 8 ? F::fp8_tma : F::fp8_gather;
}

DispatchKey key_for(KvFormat format, int rows, bool sparse, int page_size, bool any_ratio,
                    bool exact, std::int64_t longest_tile, int arch = 90) {
  return {.arch = arch,
          .format = format,
          .rows = detail::rows_class(rows),
          .sparse = sparse,
          .pages = detail::page_class(page_size),
          .any_scale_ratio = any_ratio,
          .exact_scores = exact,
          .tiles = detail::tile_class(longest_tile)};
}

const KvFormat kFormats[] = {KvFormat::bf16, KvFormat::fp8_e4m3, KvFormat::fp8_e4m3_block};

TEST(Dispatch, TableKeepsThePreviousChoices) {
  int checked = 0;
  for (const KvFormat format : kFormats)
    for (const int rows : {1, 8, 16, 17, 32, 33, 64})
      for (const bool sparse : {false, true})
        for (const int page : {1, 2, 4, 7, 8, 16, 32, 63, 64, 128})
          for (const bool any_ratio : {false, true})
            for (const bool exact : {false, true})
              for (const std::int64_t longest : {0, 64, 2047, 2048, 9000}) {
                const int row_tiles = rows <= 16 ? 1 : rows <= 32 ? 2 : 4;
                const F want =
                    previous_rule(format, row_tiles, sparse, page, !any_ratio, exact, longest);
                const DispatchKey k =
                    key_for(format, rows, sparse, page, any_ratio, exact, longest);
                EXPECT_EQ(detail::choose_family(k, F::automatic), want)
                    << format_name(format) << " rows " << rows << (sparse ? " sparse" : " dense")
                    << " page " << page << (any_ratio ? " any ratio" : "")
                    << (exact ? " exact" : "") << " longest " << longest;
                // The chosen family serves the key, at any tile length.
                EXPECT_TRUE(detail::family_serves(want, k)) << kernel_family_name(want);
                ++checked;
              }
  EXPECT_EQ(checked, 3 * 7 * 2 * 10 * 2 * 2 * 5);
}

TEST(Dispatch, CpuPlansTakeTheCpuFamilies) {
  const DispatchKey cpu = key_for(KvFormat::fp8_e4m3, 64, false, 1, false, false, 0, 0);
  EXPECT_EQ(detail::choose_family(cpu, F::automatic), F::cpu_fast);
  EXPECT_EQ(detail::choose_family(cpu, F::cpu_reference), F::cpu_reference);
  EXPECT_THROW(detail::choose_family(cpu, F::fp8_tma), Error);
}

TEST(Dispatch, GpusBeforeAmpereAreUnsupported) {
  for (const int arch : {70, 75}) {
    const DispatchKey k = key_for(KvFormat::bf16, 16, false, 64, false, false, 0, arch);
    const std::string sm = "sm_" + std::to_string(arch);
    test::expect_error([&] { detail::choose_family(k, F::automatic); }, {sm.c_str()},
                       ErrorCode::unsupported);
  }
}

// Every GPU from sm_80 but sm_90 runs the portable family for every key; fp8_e4m3 caches with
// fast scores run its fp8-product form where the tensor cores multiply e4m3 (sm_89, sm_12x).
TEST(Dispatch, EveryOtherGpuFromAmpereRunsThePortableFamily) {
  int checked = 0;
  for (const int arch : {80, 86, 87, 89, 100, 103, 110, 120, 121}) {
    const bool fp8_mma = arch == 89 || arch >= 120;
    for (const KvFormat f : {KvFormat::bf16, KvFormat::fp8_e4m3, KvFormat::fp8_e4m3_block})
      for (const int rows : {16, 64})
        for (const bool sparse : {false, true})
          for (const int page : {1, 16, 64})
            for (const bool exact : {false, true}) {
              const DispatchKey k = key_for(f, rows, sparse, page, false, exact, 0, arch);
              const F want = fp8_mma && f == KvFormat::fp8_e4m3 && !exact ? F::portable_fp8
                                                                           : F::portable;
              EXPECT_EQ(detail::choose_family(k, F::automatic), want)
                  << "sm_" << arch << " " << format_name(f) << " rows " << rows;
              ++checked;
            }
  }
  EXPECT_EQ(checked, 9 * 3 * 2 * 2 * 3 * 2);
}

TEST(Dispatch, HopperMayForceThePortableFamily) {
  for (const KvFormat f : {KvFormat::bf16, KvFormat::fp8_e4m3, KvFormat::fp8_e4m3_block})
    for (const int rows : {16, 64})
      for (const bool sparse : {false, true}) {
        const DispatchKey k = key_for(f, rows, sparse, 1, false, false, 0);
        EXPECT_NE(detail::choose_family(k, F::automatic), F::portable);
        EXPECT_EQ(detail::choose_family(k, F::portable), F::portable);
        if (f == KvFormat::fp8_e4m3 && rows == 16)
          EXPECT_EQ(detail::choose_family(k, F::portable_fp8), F::portable_fp8);
        else
          EXPECT_THROW(detail::choose_family(k, F::portable_fp8), Error);
      }
  // fp8 products: not for exact scores, nor where mma.sync has no e4m3 form (sm_80, sm_86).
  EXPECT_THROW(
      detail::choose_family(key_for(KvFormat::fp8_e4m3, 16, false, 1, false, true, 0), F::portable_fp8),
      Error);
  for (const int arch : {80, 86})
    EXPECT_THROW(detail::choose_family(key_for(KvFormat::fp8_e4m3, 16, false, 1, false, false, 0, arch),
                                       F::portable_fp8),
                 Error);
}

// fp16 queries over a bf16 cache run portable_f16_exact on every GPU from sm_80 (its products
// are fp16-exact); over FP8 caches the choice is the bf16 queries' one. Every family the table
// gives bf16 queries still serves fp16 ones when forced (rounding them to bf16), and
// portable_f16_exact serves nothing else.
TEST(Dispatch, F16QueriesOverBf16RunFp16ExactProducts) {
  int checked = 0;
  for (const int arch : {80, 86, 89, 90, 100, 120})
    for (const KvFormat f : kFormats)
      for (const int rows : {16, 64})
        for (const bool sparse : {false, true})
          for (const int page : {1, 64}) {
            DispatchKey k = key_for(f, rows, sparse, page, false, false, 0, arch);
            const F bf16_choice = detail::choose_family(k, F::automatic);
            EXPECT_NE(bf16_choice, F::portable_f16_exact);
            EXPECT_THROW(detail::choose_family(k, F::portable_f16_exact), Error);
            k.f16_queries = true;
            const std::string what = "sm_" + std::to_string(arch) + " " + format_name(f) +
                                     " rows " + std::to_string(rows) + " page " +
                                     std::to_string(page) + (sparse ? " sparse" : " dense");
            if (f == KvFormat::bf16) {
              EXPECT_EQ(detail::choose_family(k, F::automatic), F::portable_f16_exact) << what;
              EXPECT_EQ(detail::choose_family(k, bf16_choice), bf16_choice) << what;
            } else {
              EXPECT_EQ(detail::choose_family(k, F::automatic), bf16_choice) << what;
              EXPECT_THROW(detail::choose_family(k, F::portable_f16_exact), Error) << what;
            }
            ++checked;
          }
  EXPECT_EQ(checked, 6 * 3 * 2 * 2 * 2);
  // The CPU computes fp16 queries exactly on its own families.
  DispatchKey cpu = key_for(KvFormat::bf16, 16, false, 1, false, false, 0, 0);
  cpu.f16_queries = true;
  EXPECT_EQ(detail::choose_family(cpu, F::automatic), F::cpu_fast);
  EXPECT_THROW(detail::choose_family(cpu, F::portable_f16_exact), Error);
}

TEST(Dispatch, SparseFp8TilesBeyondOneWaveRunTwoCtasAnSm) {
  // fp8_gather runs one CTA an SM: sparse fp8_e4m3 tiles beyond one wave of it go to fp8_exact,
  // whose two CTAs an SM overlap two tiles' chains. The block format and dense pages keep their
  // families; forcing fp8_gather still serves the key.
  EXPECT_EQ(detail::wave_class(132, 132), detail::WaveClass::one);
  EXPECT_EQ(detail::wave_class(133, 132), detail::WaveClass::several);
  for (const int page : {1, 64}) {
    DispatchKey sparse = key_for(KvFormat::fp8_e4m3, 16, true, page, false, false, 2048);
    EXPECT_EQ(detail::choose_family(sparse, F::automatic), F::fp8_gather) << page;
    sparse.waves = detail::WaveClass::several;
    EXPECT_EQ(detail::choose_family(sparse, F::automatic), F::fp8_exact) << page;
    EXPECT_EQ(detail::choose_family(sparse, F::fp8_gather), F::fp8_gather) << page;
    DispatchKey block = key_for(KvFormat::fp8_e4m3_block, 16, true, page, false, false, 2048);
    block.waves = detail::WaveClass::several;
    EXPECT_EQ(detail::choose_family(block, F::automatic), F::fp8_gather) << page;
    DispatchKey dense = key_for(KvFormat::fp8_e4m3, 16, false, page, false, false, 2048);
    dense.waves = detail::WaveClass::several;
    EXPECT_EQ(detail::choose_family(dense, F::automatic), page == 1 ? F::fp8_gather : F::fp8_tma)
        << page;
  }
}

TEST(Dispatch, ForcedFamilyServesOrIsNamed) {
  // Forced where a row of the family covers the key: kept, even where the table prefers another.
  const DispatchKey fp8_small = key_for(KvFormat::fp8_e4m3, 16, false, 64, false, false, 0);
  EXPECT_EQ(detail::choose_family(fp8_small, F::automatic), F::fp8_tma);
  EXPECT_EQ(detail::choose_family(fp8_small, F::fp8_exact), F::fp8_exact);
  const DispatchKey bf16_long = key_for(KvFormat::bf16, 16, false, 64, false, false, 5000);
  EXPECT_EQ(detail::choose_family(bf16_long, F::automatic), F::bf16_gather);
  EXPECT_EQ(detail::choose_family(bf16_long, F::bf16_tma), F::bf16_tma);
  // Rows that only forcing reaches: the block format's <= 16-row tiles on fp8_exact, wide_rows
  // and shared_tile.
  const DispatchKey block_small = key_for(KvFormat::fp8_e4m3_block, 8, true, 1, false, false, 0);
  EXPECT_EQ(detail::choose_family(block_small, F::automatic), F::fp8_gather);
  EXPECT_EQ(detail::choose_family(block_small, F::fp8_exact), F::fp8_exact);
  EXPECT_EQ(detail::choose_family(block_small, F::wide_rows), F::wide_rows);
  EXPECT_EQ(detail::choose_family(block_small, F::shared_tile), F::shared_tile);
  // Not covered: wrong format, rows, page size, scores, ratio, device.
  const struct {
    DispatchKey key;
    F family;
  } refused[] = {
      {fp8_small, F::bf16_tma},
      {fp8_small, F::wide_rows},
      {key_for(KvFormat::fp8_e4m3, 16, false, 4, false, false, 0), F::fp8_tma},
      {key_for(KvFormat::fp8_e4m3, 16, false, 64, false, true, 0), F::fp8_tma},
      {key_for(KvFormat::fp8_e4m3, 16, false, 64, true, false, 0), F::fp8_gather},
      {key_for(KvFormat::fp8_e4m3, 16, true, 64, false, false, 0), F::fp8_tma},
      {key_for(KvFormat::bf16, 64, false, 16, false, false, 0), F::bf16_wide_rows},
      {key_for(KvFormat::bf16, 16, false, 16, false, false, 0), F::wide_rows},
      {key_for(KvFormat::fp8_e4m3, 16, false, 64, false, false, 0, 0), F::fp8_tma},
      {fp8_small, F::cpu_fast},
  };
  for (const auto& r : refused) {
    SCOPED_TRACE(kernel_family_name(r.family));
    const Error e = test::error_of([&] { detail::choose_family(r.key, r.family); });
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), "options.kernel_family");
    EXPECT_NE(std::string(e.what()).find(kernel_family_name(r.family)), std::string::npos)
        << e.what();
  }
}

TEST(Dispatch, NamesRoundTrip) {
  for (const F f : {F::automatic, F::cpu_fast, F::cpu_reference, F::shared_tile, F::fp8_exact,
                    F::fp8_tma, F::fp8_gather, F::bf16_tma, F::bf16_gather, F::wide_rows,
                    F::bf16_wide_rows, F::portable, F::portable_fp8, F::portable_f16_exact})
    EXPECT_EQ(parse_kernel_family(kernel_family_name(f)), f) << kernel_family_name(f);
  EXPECT_STREQ(kernel_family_name(F::automatic), "auto");
  test::expect_error([] { parse_kernel_family("fp8frag"); }, {"fp8_exact"});
}

TEST(Dispatch, ScaleRatioIsAPowerOfTwo) {
  for (const float sm_scale : {0.07f, 1.0f / std::sqrt(192.0f), 0.4f}) {
    EXPECT_TRUE(detail::pow2_scale_ratio(sm_scale, 1.0f, 1.0f));
    EXPECT_TRUE(detail::pow2_scale_ratio(sm_scale, 0.37f, 0.37f));
    EXPECT_TRUE(detail::pow2_scale_ratio(sm_scale, 0.03125f, 32.0f));
    EXPECT_TRUE(detail::pow2_scale_ratio(sm_scale, 2.0f, 0.25f));
    EXPECT_FALSE(detail::pow2_scale_ratio(sm_scale, 1e-3f, 1e3f));
    EXPECT_FALSE(detail::pow2_scale_ratio(sm_scale, 1.0f, 3.0f));
  }
  EXPECT_FALSE(detail::pow2_scale_ratio(1.0f, 1e-45f, 1.0f));  // subnormal products
}

// The planner's 16-row cap against the rule it replaced (src/core/plan.cpp before the table),
// over a grid of problems: heads, query and kv lengths, batch sizes, SM counts, formats, sparse,
// exact scores, graph mode.
struct Requests {
  std::vector<std::int32_t> qo{0}, kv_len;
  void add(int qo_len, int kv) {
    qo.push_back(qo.back() + qo_len);
    kv_len.push_back(kv);
  }
};

int previous_cap(const Problem& p, const PlanOptions& o, int rows_uncapped, int sm_count) {
  if (o.max_tile_rows > 0) return o.max_tile_rows;
  if (p.device != DeviceKind::cuda || p.kv_format != KvFormat::fp8_e4m3 || p.topk > 0 ||
      o.exact_scores || p.num_heads > 16)
    return 64;
  if (rows_uncapped <= 16) return 64;
  const std::int64_t q_per_tile = 16 / p.num_heads;
  std::int64_t tiles = 0, tokens = 0;
  if (o.cuda_graph) {
    const std::int64_t q = o.max_qo_len > 0 ? o.max_qo_len : o.max_total_q;
    tiles = std::int64_t{o.max_batch} * ((q + q_per_tile - 1) / q_per_tile);
    tokens = o.max_kv_indices * p.page_size;
  } else {
    for (std::size_t r = 0; r + 1 < p.qo_indptr.size(); ++r) {
      const std::int64_t qo = p.qo_indptr[r + 1] - p.qo_indptr[r];
      tiles += (qo + q_per_tile - 1) / q_per_tile;
      if (qo > 0) tokens += p.kv_len[r];
    }
  }
  return tokens <= 128 * sm_count && tiles * 4 <= sm_count ? 16 : 64;
}

TEST(Dispatch, SixteenRowCapKeepsThePreviousRule) {
  int capped = 0, checked = 0;
  for (const KvFormat format : kFormats)
    for (const int heads : {1, 2, 4, 8, 16, 20, 64})
      for (const int qo_len : {1, 2, 3, 8})
        for (const int batch : {1, 4, 20})
          for (const int kv : {0, 100, 900, 5000})
            for (const int sms : {16, 132})
              for (const int topk : {0, 64})
                for (const bool exact : {false, true})
                  for (const bool graph : {false, true}) {
                    Requests q;
                    for (int r = 0; r < batch; ++r) q.add(r == 0 ? 0 : qo_len, kv);
                    Problem p;
                    p.num_heads = heads;
                    p.page_size = 16;
                    p.kv_format = format;
                    p.topk = topk;
                    p.device = DeviceKind::cuda;
                    p.qo_indptr = q.qo;
                    p.kv_len = q.kv_len;
                    PlanOptions o;
                    o.exact_scores = exact;
                    if (graph) {
                      o.cuda_graph = true;
                      o.max_batch = batch;
                      o.max_total_q = batch * qo_len;
                      o.max_qo_len = qo_len;
                      o.max_kv_indices = std::int64_t{batch} * (kv / 16 + 1);
                    }
                    const int per_tile = topk > 0 ? 1 : std::max(1, 64 / heads);
                    const int rows = std::min(heads, 64) * std::min(qo_len, per_tile);
                    const DispatchKey key16 =
                        key_for(format, 16, topk > 0, p.page_size, false, exact, 0);
                    const int want = previous_cap(p, o, rows, sms);
                    EXPECT_EQ(detail::choose_max_tile_rows(p, o, key16, rows, sms), want)
                        << format_name(format) << " heads " << heads << " qo " << qo_len
                        << " batch " << batch << " kv " << kv << " sms " << sms << " topk "
                        << topk << (exact ? " exact" : "") << (graph ? " graph" : "");
                    capped += want == 16;
                    ++checked;
                  }
  EXPECT_GT(capped, 0);  // the grid reaches both answers
  EXPECT_LT(capped, checked);
  // A given cap is kept; an any-ratio plan's 16-row tiles take fp8_exact, so it keeps 64.
  Requests q;
  q.add(2, 100);
  Problem p;
  p.num_heads = 8;
  p.page_size = 16;
  p.device = DeviceKind::cuda;
  p.qo_indptr = q.qo;
  p.kv_len = q.kv_len;
  PlanOptions o;
  EXPECT_EQ(detail::choose_max_tile_rows(p, o, key_for(KvFormat::fp8_e4m3, 16, false, 16, false,
                                                       false, 0),
                                         16, 132),
            64);  // uncapped tiles of 16 rows: nothing to cap
  EXPECT_EQ(detail::choose_max_tile_rows(
                p, o, key_for(KvFormat::fp8_e4m3, 16, false, 16, false, false, 0), 24, 132),
            16);
  o.any_scale_ratio = true;
  EXPECT_EQ(detail::choose_max_tile_rows(
                p, o, key_for(KvFormat::fp8_e4m3, 16, false, 16, true, false, 0), 24, 132),
            64);
  o.max_tile_rows = 32;
  EXPECT_EQ(detail::choose_max_tile_rows(
                p, o, key_for(KvFormat::fp8_e4m3, 16, false, 16, true, false, 0), 24, 132),
            32);
}

// CPU plans record their family; kernel_family forces one or is refused by name.
TEST(Dispatch, PlanRecordsItsFamily) {
  const std::vector<std::int32_t> qo{0, 1}, kvp{0, 1}, idx{0}, len{5};
  Problem p;
  p.num_heads = 4;
  p.page_size = 8;
  p.num_pages = 1;
  p.sm_scale = 0.1f;
  p.qo_indptr = qo;
  p.kv_indptr = kvp;
  p.kv_indices = idx;
  p.kv_len = len;
  EXPECT_EQ(plan(p).kernel_family(), F::cpu_fast);
  EXPECT_STREQ(plan(p).kernel_name(), "cpu_fast");
  PlanOptions o;
  o.cpu_reference = true;
  EXPECT_STREQ(plan(p, o).kernel_name(), "cpu_reference");
  o = {};
  o.kernel_family = F::cpu_reference;
  EXPECT_EQ(plan(p, o).kernel_family(), F::cpu_reference);
  o.kernel_family = F::fp8_tma;
  const Error e = test::error_of([&] { (void)plan(p, o); });
  EXPECT_EQ(e.argument(), "options.kernel_family") << "fp8_tma for a CPU plan";
  EXPECT_NE(std::string(e.what()).find("fp8_tma"), std::string::npos) << e.what();
}

}  // namespace
}  // namespace fp8mla
