// The planner's partition (src/core/plan.cpp): coverage, tile shape, determinism, split
// policy, graph-mode replan. Backend-independent: only plan() / replan() are called.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/plan_state.h"
#include "tests/common/expect_error.h"

namespace fp8mla {
namespace {

using I32 = std::vector<std::int32_t>;

// Owns the arrays a Problem points into.
struct Batch {
  int num_heads = 8;
  int page_size = 1;
  std::int64_t num_pages = 1;
  bool causal = true;
  int topk = 0;
  I32 qo_indptr{0};
  I32 kv_indptr{0};
  I32 kv_indices;
  I32 kv_len;
  I32 sparse_indices;

  // Appends a request whose pages are the next free ids (the pool grows to fit).
  void add(int qo_len, int kv_len_r) {
    qo_indptr.push_back(qo_indptr.back() + qo_len);
    const int pages = (kv_len_r + page_size - 1) / page_size;
    for (int i = 0; i < pages; ++i)
      kv_indices.push_back(static_cast<std::int32_t>(i + kv_indptr.back()));
    kv_indptr.push_back(kv_indptr.back() + pages);
    kv_len.push_back(kv_len_r);
    num_pages = std::max<std::int64_t>(1, kv_indptr.back());
  }
  // Sparse mode: every token gets `k` slots (some -1); kv arrays stay as given.
  void make_sparse(int k, std::mt19937& rng) {
    topk = k;
    const std::int64_t slots = num_pages * page_size;
    std::uniform_int_distribution<std::int64_t> slot(-1, slots - 1);
    sparse_indices.resize(static_cast<std::size_t>(qo_indptr.back()) * k);
    for (auto& v : sparse_indices) v = static_cast<std::int32_t>(slot(rng));
  }
  Problem problem() const {
    Problem p;
    p.num_heads = num_heads;
    p.page_size = page_size;
    p.num_pages = num_pages;
    p.causal = causal;
    p.sm_scale = 0.0625f;
    p.qo_indptr = qo_indptr;
    p.kv_indptr = kv_indptr;
    p.kv_indices = kv_indices;
    p.kv_len = kv_len;
    p.topk = topk;
    p.sparse_indices = sparse_indices;
    return p;
  }
};

PlanOptions units(int sm_count, int ctas_per_sm = 2, int min_chunk = 256) {
  PlanOptions o;
  o.sm_count = sm_count;
  o.ctas_per_sm = ctas_per_sm;
  o.min_chunk_tokens = min_chunk;
  return o;
}

auto key(const WorkTile& t) {
  return std::tuple(t.request, t.q_begin, t.q_count, t.head_begin, t.head_count, t.kv_begin,
                    t.kv_end, t.split);
}

std::int64_t groups(const Plan& p) {
  const auto& s = p.state();
  const int head_blocks = (s.num_heads + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
  const int max_rows = s.options.max_tile_rows > 0 ? s.options.max_tile_rows : kMaxRowsPerTile;
  const int q_per_tile = s.topk > 0 ? 1 : std::max(1, max_rows / s.num_heads);
  std::int64_t g = 0;
  for (int r = 0; r < s.batch; ++r) {
    const int q = s.qo_indptr[r + 1] - s.qo_indptr[r];
    g += (q + q_per_tile - 1) / q_per_tile * head_blocks;
  }
  return g;
}

// Every (request, query token, head) is covered by num_splits[r] tiles whose kv ranges, in
// split order, partition [0, L_r) exactly; tiles are well formed, contiguous per request and in
// split order; partial blocks tile [0, partial_rows).
void expect_valid_partition(const Plan& p) {
  const auto& s = p.state();
  const int h = s.num_heads;
  const bool sparse = s.topk > 0;
  std::vector<std::vector<std::tuple<int, int, int>>> cover(  // (kv_begin, kv_end, split)
      static_cast<std::size_t>(s.total_q) * h);
  int last_request = -1;
  int last_split = -2;
  for (const WorkTile& t : p.tiles()) {
    ASSERT_GE(t.request, last_request) << "tiles of a request must be contiguous, in order";
    if (t.request != last_request) last_split = -2;
    ASSERT_GE(t.split, last_split) << "tiles of a request must be in split order";
    last_request = t.request;
    last_split = t.split;
    const int qo_len = s.qo_indptr[t.request + 1] - s.qo_indptr[t.request];
    ASSERT_GE(t.q_count, 1);
    ASSERT_GE(t.head_count, 1);
    ASSERT_LE(t.q_count * t.head_count, kMaxRowsPerTile);
    if (t.q_count > 1 && s.options.max_tile_rows > 0) {
      ASSERT_LE(t.q_count * t.head_count, s.options.max_tile_rows);
    }
    if (sparse) {
      ASSERT_EQ(t.q_count, 1);
    }
    ASSERT_GE(t.q_begin, 0);
    ASSERT_LE(t.q_begin + t.q_count, qo_len);
    ASSERT_GE(t.head_begin, 0);
    ASSERT_LE(t.head_begin + t.head_count, h);
    ASSERT_LE(t.kv_begin, t.kv_end);
    for (int q = t.q_begin; q < t.q_begin + t.q_count; ++q) {
      for (int hd = t.head_begin; hd < t.head_begin + t.head_count; ++hd) {
        cover[static_cast<std::size_t>(s.qo_indptr[t.request] + q) * h + hd].emplace_back(
            t.kv_begin, t.kv_end, t.split);
      }
    }
  }
  std::int64_t partial_next = 0;
  for (int r = 0; r < s.batch; ++r) {
    const int qo_len = s.qo_indptr[r + 1] - s.qo_indptr[r];
    const int len = sparse ? s.topk : s.kv_len[r];
    const int splits = s.num_splits[r];
    ASSERT_GE(splits, 1);
    ASSERT_EQ(s.partial_offset[r], partial_next) << "request " << r;
    if (splits > 1) partial_next += static_cast<std::int64_t>(splits) * qo_len * h;
    for (int q = 0; q < qo_len; ++q) {
      for (int hd = 0; hd < h; ++hd) {
        auto ranges = cover[static_cast<std::size_t>(s.qo_indptr[r] + q) * h + hd];
        ASSERT_EQ(static_cast<int>(ranges.size()), splits)
            << "request " << r << " token " << q << " head " << hd;
        std::sort(ranges.begin(), ranges.end());
        int next = 0;
        for (int i = 0; i < splits; ++i) {
          const auto [begin, end, split] = ranges[i];
          ASSERT_EQ(begin, next) << "request " << r << " split " << i;
          ASSERT_TRUE(end > begin || len == 0);
          ASSERT_EQ(split, splits > 1 ? i : -1);
          next = end;
        }
        ASSERT_EQ(next, len) << "request " << r;
      }
    }
  }
  EXPECT_EQ(s.partial_rows, partial_next);
  const std::int64_t target = static_cast<std::int64_t>(s.sm_count) * s.ctas_per_sm;
  EXPECT_LE(static_cast<std::int64_t>(p.tiles().size()), target + groups(p));
}

Batch random_batch(std::mt19937& rng, bool sparse) {
  static constexpr int kHeads[] = {1, 2, 5, 8, 16, 20, 32, 64, 65, 100, 128};
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Batch b;
  b.num_heads = kHeads[pick(0, static_cast<int>(std::size(kHeads)) - 1)];
  b.page_size = 1 << pick(0, 7);
  b.causal = pick(0, 1) == 1;
  const int batch = pick(1, 12);
  for (int r = 0; r < batch; ++r) {
    const int qo_len = pick(0, 4) == 0 ? pick(0, 40) : pick(0, 3);
    int kv_len_r = pick(0, 5) == 0 ? 0 : pick(1, pick(0, 1) ? 600 : 20000);
    if (b.causal && kv_len_r > 0) kv_len_r = std::max(kv_len_r, qo_len);
    b.add(qo_len, kv_len_r);
  }
  if (sparse) {
    b.make_sparse(pick(1, 3000), rng);
    if (pick(0, 1) == 1) {  // the page table is optional in sparse mode
      b.kv_indptr.clear();
      b.kv_indices.clear();
      b.kv_len.clear();
    }
  }
  return b;
}

PlanOptions random_options(std::mt19937& rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  static constexpr int kMinChunk[] = {1, 64, 100, 256, 1024};
  static constexpr int kMaxRows[] = {0, 0, 1, 7, 16, 32};
  PlanOptions o = units(pick(1, 160), pick(1, 3), kMinChunk[pick(0, 4)]);
  o.max_tile_rows = kMaxRows[pick(0, 5)];
  return o;
}

TEST(PlanPartition, RandomDenseProblemsArePartitionedExactly) {
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 300; ++iter) {
    const Batch b = random_batch(rng, false);
    const Plan p = plan(b.problem(), random_options(rng));
    SCOPED_TRACE(::testing::Message() << "iteration " << iter << " heads " << b.num_heads);
    expect_valid_partition(p);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(PlanPartition, RandomSparseProblemsArePartitionedExactly) {
  std::mt19937 rng(99);
  for (int iter = 0; iter < 150; ++iter) {
    const Batch b = random_batch(rng, true);
    const Plan p = plan(b.problem(), random_options(rng));
    SCOPED_TRACE(::testing::Message() << "iteration " << iter << " topk " << b.topk);
    expect_valid_partition(p);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(PlanPartition, HeadAndQueryBlocking) {
  Batch b;
  b.num_heads = 8;
  b.add(/*qo_len=*/20, 4096);  // 64 / 8 = 8 tokens per tile: blocks of 8, 8, 4
  const Plan p8 = plan(b.problem(), units(1, 1, 1 << 20));
  ASSERT_EQ(p8.tiles().size(), 3u);
  EXPECT_EQ(p8.tiles()[0].q_count, 8);
  EXPECT_EQ(p8.tiles()[2].q_begin, 16);
  EXPECT_EQ(p8.tiles()[2].q_count, 4);
  EXPECT_EQ(p8.tiles()[0].head_count, 8);

  b.num_heads = 100;  // blocks of 64 + 36 heads, one token each
  const Plan p100 = plan(b.problem(), units(1, 1, 1 << 20));
  ASSERT_EQ(p100.tiles().size(), 40u);
  EXPECT_EQ(p100.tiles()[0].head_count, 64);
  EXPECT_EQ(p100.tiles()[20].head_begin, 64);
  EXPECT_EQ(p100.tiles()[20].head_count, 36);
  for (const WorkTile& t : p100.tiles()) EXPECT_EQ(t.q_count, 1);

  // options.max_tile_rows caps the tokens a tile packs: 16 rows of 8 heads are 2 tokens (blocks
  // of 2 x 10); of 16 heads 1 token; of 32 heads still 1 token (a tile keeps one).
  PlanOptions capped = units(1, 1, 1 << 20);
  capped.max_tile_rows = 16;
  b.num_heads = 8;
  const Plan c8 = plan(b.problem(), capped);
  ASSERT_EQ(c8.tiles().size(), 10u);
  EXPECT_EQ(c8.tiles()[9].q_begin, 18);
  EXPECT_EQ(c8.tiles()[9].q_count, 2);
  for (const int heads : {16, 32}) {
    b.num_heads = heads;
    const Plan c = plan(b.problem(), capped);
    ASSERT_EQ(c.tiles().size(), 20u) << heads << " heads";
    for (std::size_t i = 0; i < c.tiles().size(); ++i) {
      EXPECT_EQ(c.tiles()[i].q_begin, static_cast<int>(i));
      EXPECT_EQ(c.tiles()[i].q_count, 1);
      EXPECT_EQ(c.tiles()[i].head_count, heads);
    }
  }
}

TEST(PlanPartition, SameInputGivesIdenticalPlans) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 50; ++iter) {
    const Batch b = random_batch(rng, iter % 2 == 1);
    const PlanOptions o = random_options(rng);
    const Plan a = plan(b.problem(), o);
    const Plan c = plan(b.problem(), o);
    ASSERT_EQ(a.tiles().size(), c.tiles().size());
    for (std::size_t i = 0; i < a.tiles().size(); ++i) {
      ASSERT_EQ(key(a.tiles()[i]), key(c.tiles()[i])) << "tile " << i;
    }
    ASSERT_TRUE(std::ranges::equal(a.num_splits(), c.num_splits()));
    ASSERT_EQ(a.partial_rows(), c.partial_rows());
  }
}

TEST(PlanSplit, SingleLongRequestFillsTheMachine) {
  for (int heads : {8, 16, 128}) {
    Batch b;
    b.num_heads = heads;
    b.page_size = 64;
    b.add(1, 65536);
    const Plan p = plan(b.problem(), units(132));
    EXPECT_GE(p.tiles().size(), 132u) << heads << " heads";
    EXPECT_GT(p.num_splits()[0], 1);
    EXPECT_EQ(p.partial_rows(), static_cast<std::int64_t>(p.num_splits()[0]) * heads);
    expect_valid_partition(p);
  }
}

TEST(PlanSplit, SplitsAreAlignedAndNearEqual) {
  Batch b;
  b.add(1, 4100);
  // min_chunk 1024: the cheapest chunk cuts 4100 tokens into 5 splits, balanced to
  // round_up(ceil(4100 / 5), 64) = 832 tokens instead of 4 x 1024 + 4.
  const Plan p = plan(b.problem(), units(132, 1, 1024));
  ASSERT_EQ(p.num_splits()[0], 5);
  ASSERT_EQ(p.tiles().size(), 5u);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(key(p.tiles()[i]), key(WorkTile{0, 0, 1, 0, 8, 832 * i, 832 * (i + 1), i}));
  EXPECT_EQ(key(p.tiles()[4]), key(WorkTile{0, 0, 1, 0, 8, 3328, 4100, 4}));
}

TEST(PlanSplit, ShortRequestsAreNotSplit) {
  // 300 tokens on 132 units: two 192-token splits plus a merge cost more than one tile.
  Batch b;
  b.add(1, 300);
  const Plan p = plan(b.problem(), units(132));
  ASSERT_EQ(p.tiles().size(), 1u);
  EXPECT_EQ(key(p.tiles()[0]), key(WorkTile{0, 0, 1, 0, 8, 0, 300, -1}));
}

TEST(PlanSplit, TilesFillWholeWaves) {
  // 128 requests of 8192 tokens on 132 units x 2: c_min = 4032 would give 3 splits each
  // (384 tiles, 1.45 waves); the planner takes 2 splits (256 tiles, one wave).
  Batch b;
  for (int r = 0; r < 128; ++r) b.add(1, 8192);
  const Plan p = plan(b.problem(), units(132, 2));
  EXPECT_EQ(p.tiles().size(), 256u);
  for (std::int32_t n : p.num_splits()) EXPECT_EQ(n, 2);
  // One CTA per SM: one wave of whole requests.
  const Plan q = plan(b.problem(), units(132, 1));
  EXPECT_EQ(q.tiles().size(), 128u);
  EXPECT_EQ(q.partial_rows(), 0);
}

TEST(PlanSplit, NoSplitWhenTheBatchFillsTheTarget) {
  Batch b;
  for (int r = 0; r < 264; ++r) b.add(1, 4096);
  const Plan p = plan(b.problem(), units(132));
  EXPECT_EQ(p.tiles().size(), 264u);
  EXPECT_EQ(p.partial_rows(), 0);
  for (std::int32_t n : p.num_splits()) EXPECT_EQ(n, 1);
  for (const WorkTile& t : p.tiles()) EXPECT_EQ(t.split, -1);
}

TEST(PlanSplit, MinChunkTokensBoundsTheSplit) {
  Batch b;
  b.add(1, 4096);
  const Plan p = plan(b.problem(), units(132, 2, 1024));
  EXPECT_EQ(p.num_splits()[0], 4);
}

TEST(PlanEdge, EmptyContextRowsStillGetATile) {
  Batch b;
  b.add(2, 0);
  b.add(0, 300);  // no query tokens: no tiles
  b.add(3, 100);
  const Plan p = plan(b.problem(), units(132));
  expect_valid_partition(p);
  int empty = 0;
  for (const WorkTile& t : p.tiles()) {
    EXPECT_NE(t.request, 1);
    if (t.request == 0) {
      ++empty;
      EXPECT_EQ(t.kv_begin, 0);
      EXPECT_EQ(t.kv_end, 0);
      EXPECT_EQ(t.split, -1);
    }
  }
  EXPECT_GE(empty, 1);
  EXPECT_EQ(p.num_splits()[0], 1);
}

TEST(PlanEdge, AllRequestsWithoutQueries) {
  Batch b;
  b.add(0, 10);
  const Plan p = plan(b.problem(), units(4));
  EXPECT_EQ(p.total_q(), 0);
  EXPECT_TRUE(p.tiles().empty());
}

TEST(PlanEdge, CopiesTheInputAndReportsIt) {
  Batch b;
  b.num_heads = 16;
  b.add(1, 50);
  Plan p = plan(b.problem(), units(4));
  b.kv_indices.assign(b.kv_indices.size(), 0);  // plan() copied what it keeps
  EXPECT_EQ(p.state().kv_indices[1], 1);
  EXPECT_EQ(p.batch(), 1);
  EXPECT_EQ(p.num_heads(), 16);
  EXPECT_EQ(p.device(), DeviceKind::cpu);
  EXPECT_EQ(p.kv_format(), KvFormat::fp8_e4m3);
  const Plan moved = std::move(p);
  EXPECT_EQ(moved.batch(), 1);
  EXPECT_THROW((void)p.batch(), Error);  // a moved-from plan is empty (documented)
}

TEST(PlanEdge, CpuUnitsDefaultToThreads) {
  Batch b;
  b.add(1, 1 << 16);
  PlanOptions o = units(0);
  o.num_threads = 3;
  EXPECT_EQ(plan(b.problem(), o).state().sm_count, 3);
}

// ---- graph mode ----

PlanOptions graph_options() {
  PlanOptions o = units(16);
  o.cuda_graph = true;
  o.max_batch = 8;
  o.max_total_q = 32;
  o.max_kv_indices = 1 << 16;
  return o;
}

TEST(PlanGraph, ReplanKeepsCapacitiesAndMatchesAFreshPlan) {
  Batch small;
  small.add(1, 100);
  Plan p = plan(small.problem(), graph_options());
  const auto tile_cap = p.state().tile_capacity;
  const auto row_cap = p.state().partial_rows_capacity;

  std::mt19937 rng(5);
  for (int iter = 0; iter < 40; ++iter) {
    Batch b;
    const int batch = std::uniform_int_distribution<int>(1, 8)(rng);
    for (int r = 0; r < batch; ++r) {
      b.add(std::uniform_int_distribution<int>(0, 4)(rng),
            std::uniform_int_distribution<int>(4, 8000)(rng));
    }
    replan(p, b.problem());
    EXPECT_EQ(p.state().tile_capacity, tile_cap);
    EXPECT_EQ(p.state().partial_rows_capacity, row_cap);
    const Plan fresh = plan(b.problem(), graph_options());
    ASSERT_EQ(p.tiles().size(), fresh.tiles().size());
    for (std::size_t i = 0; i < p.tiles().size(); ++i) {
      ASSERT_EQ(key(p.tiles()[i]), key(fresh.tiles()[i]));
    }
    expect_valid_partition(p);
  }
}

TEST(PlanGraph, CapacityHoldsForStressShapes) {
  // Requests just above the chunk, with few units and no minimum chunk, split the most.
  std::mt19937 rng(11);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  static constexpr int kHeads[] = {1, 3, 8, 21, 64, 65, 128};
  for (int iter = 0; iter < 300; ++iter) {
    PlanOptions o = graph_options();
    o.min_chunk_tokens = 1;
    o.sm_count = pick(1, 16);
    o.ctas_per_sm = pick(1, 2);
    o.max_tile_rows = iter % 2 == 0 ? 0 : pick(1, kMaxRowsPerTile);
    Batch b;
    b.num_heads = kHeads[pick(0, static_cast<int>(std::size(kHeads)) - 1)];
    const int batch = pick(1, 8);
    for (int r = 0; r < batch; ++r) b.add(pick(0, 4), pick(4, pick(0, 1) == 1 ? 200 : 8000));
    if (iter % 3 == 0) b.make_sparse(pick(1, 700), rng);
    const Plan p = plan(b.problem(), o);  // plan() throws internal if a bound were broken
    EXPECT_LE(static_cast<std::int64_t>(p.tiles().size()), p.state().tile_capacity);
    EXPECT_LE(p.partial_rows(), p.state().partial_rows_capacity);
  }
}

TEST(PlanGraph, ReplanRejectsBiggerProblemsAndKeepsThePlan) {
  Batch small;
  small.add(1, 100);
  Plan p = plan(small.problem(), graph_options());
  const auto tiles_before = p.tiles().size();
  Batch big;
  for (int r = 0; r < 9; ++r) big.add(1, 10);
  test::expect_error([&] { replan(p, big.problem()); }, {"options.max_batch = 8"});
  EXPECT_EQ(p.tiles().size(), tiles_before);
  EXPECT_EQ(p.batch(), 1);
}

TEST(PlanGraph, ReplanRejectsChangedShapeOfTheGraph) {
  Batch b;
  b.add(1, 100);
  Plan p = plan(b.problem(), graph_options());
  auto expect_rejected = [&](const Problem& changed, const char* name) {
    SCOPED_TRACE(::testing::Message() << "replan with a changed " << name);
    const Error e = test::error_of([&] { replan(p, changed); });
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), name) << e.what();
  };
  Problem heads = b.problem();
  heads.num_heads = 16;
  expect_rejected(heads, "num_heads");
  Problem format = b.problem();
  format.kv_format = KvFormat::bf16;
  expect_rejected(format, "kv_format");
  Problem page = b.problem();
  page.page_size = 2;
  expect_rejected(page, "page_size");

  Plan plain = plan(b.problem(), units(4));
  EXPECT_THROW(replan(plain, b.problem()), Error);
}

}  // namespace
}  // namespace fp8mla
