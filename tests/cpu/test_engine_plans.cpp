// What serving engines need from a plan beyond the basic contract (issue: reach the engines):
// f16 queries and outputs (FlashInfer's fp16 path; CUDA's in tests/cuda/test_cuda_f16.cpp), a
// page table the plan borrows and reads at run time (FlashInfer's graph mode reads the caller's
// index buffer), and the stream-ordered replan() form (on the CPU: the same as replan()).
//
// Every check compares against the float64 reference on fresh random data with poisoned outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "src/core/f16.h"
#include "tests/common/expect_error.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

using test::expect_error;
using test::ProblemSpec;

TensorView i32_view(std::vector<std::int32_t>& v) {
  TensorView t;
  t.data = v.data();
  t.dtype = DType::i32;
  t.ndim = 1;
  t.shape[0] = static_cast<std::int64_t>(v.size());
  t.stride[0] = 1;
  return t;
}

// ---- fp16 conversions ----

#if defined(__FLT16_MAX__)
// Against the compiler's _Float16 (IEEE RNE) on every fp16 value and on floats around them.
TEST(F16Conversion, MatchesTheCompilersFloat16) {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const _Float16 ref = std::bit_cast<_Float16>(bits);
    const float f = detail::f16_bits_to_float(bits);
    if (std::isnan(static_cast<float>(ref))) {
      EXPECT_TRUE(std::isnan(f)) << h;
      continue;
    }
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f),
              std::bit_cast<std::uint32_t>(static_cast<float>(ref)))
        << "f16 bits " << h;
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any;
  for (int i = 0; i < 2000000; ++i) {
    // Floats across fp16's range and beyond (exponents 2^-30 .. 2^17), signs, exact ties.
    std::uint32_t bits = any(rng);
    const std::uint32_t exponent = 97 + (bits >> 24) % 48;
    bits = (bits & 0x807fffffu) | (exponent << 23);
    if (i % 4 == 0) bits &= ~0xfffu;  // many exact halfway cases
    const float f = std::bit_cast<float>(bits);
    const auto ref = std::bit_cast<std::uint16_t>(static_cast<_Float16>(f));
    ASSERT_EQ(detail::float_to_f16_bits(f), ref) << "float " << f;
  }
  EXPECT_EQ(detail::float_to_f16_bits(65520.0f), 0x7c00);
  EXPECT_EQ(detail::float_to_f16_bits(-65519.99f), 0xfbff);
  EXPECT_EQ(detail::float_to_f16_bits(std::nanf("")) & 0x7e00, 0x7e00);
}
#endif

TEST(F16Conversion, DoubleRoundsOnce) {
  // 1 + 2^-11 + 2^-40 rounds up to 1 + 2^-10 in one step; through float (1 + 2^-11, a tie) it
  // would round to even, down to 1.
  EXPECT_EQ(detail::double_to_f16_bits(1.0 + 0x1p-11 + 0x1p-40), 0x3c01);
  EXPECT_EQ(detail::double_to_f16_bits(1.0 + 0x1p-11), 0x3c00);
  EXPECT_EQ(detail::double_to_f16_bits(-2.5), 0xc100);
}

// ---- f16 queries and outputs on the CPU backend ----

// q of the case, re-encoded as f16 (exact: bf16 values have 8 significant bits, and the few
// below fp16's normal range are set to 0 in the case first).
std::vector<std::uint16_t> f16_copy_of_q(test::RandomCase& c) {
  for (std::uint16_t& v : c.q) {
    if (std::fabs(bf16_to_float(v)) < 0x1p-14f) v = 0;
  }
  std::vector<std::uint16_t> q(c.q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    const float v = bf16_to_float(c.q[i]);
    q[i] = detail::float_to_f16_bits(v);
    EXPECT_EQ(detail::f16_bits_to_float(q[i]), v) << "q[" << i << "] is not exact in fp16";
  }
  return q;
}

TensorView as_f16(TensorView v) {
  v.dtype = DType::f16;
  return v;
}

struct F16Row {
  const char* name;
  int batch, heads, page_size;
  KvFormat format;
  int qo_max;
  bool causal;
};

TEST(F16Queries, FastAndReferenceAgreeAndMatchTheBf16Answer) {
  const F16Row rows[] = {
      {"decode_fp8_ps1", 4, 16, 1, KvFormat::fp8_e4m3, 1, false},
      {"mtp_bf16_ps16", 3, 8, 16, KvFormat::bf16, 4, true},
      {"split_block_ps64", 2, 4, 64, KvFormat::fp8_e4m3_block, 3, true},
  };
  for (const F16Row& row : rows) {
    SCOPED_TRACE(row.name);
    ProblemSpec spec{.batch = row.batch,
                     .num_heads = row.heads,
                     .page_size = row.page_size,
                     .format = row.format,
                     .qo_len_max = row.qo_max,
                     .kv_len_max = 700,
                     .empty_fraction = 0.2,
                     .causal = row.causal,
                     .seed = 31};
    spec.qo_len_min = 1;
    test::RandomCase c = test::make_case(spec);
    std::vector<std::uint16_t> q16 = f16_copy_of_q(c);

    // bf16 reference (the established path) and the f16 outputs of both CPU paths.
    test::HostOutput bf16_ref(c);
    {
      PlanOptions o;
      o.cpu_reference = true;
      run(plan(c.problem(), o), c.host_args(bf16_ref));
    }
    auto f16_run = [&](bool reference) {
      test::HostOutput out(c, 64);
      Problem p = c.problem();
      p.q_dtype = DType::f16;
      p.out_dtype = DType::f16;
      PlanOptions o;
      o.cpu_reference = reference;
      o.sm_count = 3;  // split long requests on the fast path
      o.min_chunk_tokens = 64;
      const Plan pl = plan(p, o);
      RunArgs a = c.host_args(out);
      a.q_nope = as_f16(c.q_nope_view(q16.data()));
      a.q_pe = as_f16(c.q_pe_view(q16.data()));
      a.out = as_f16(out.out_view());
      run(pl, a);
      EXPECT_TRUE(out.guards_intact());
      return out;
    };
    test::HostOutput ref16 = f16_run(true);
    test::HostOutput fast16 = f16_run(false);

    // The f16 answers as float, then as bf16 bits, against the bf16 reference: the f16 result is
    // the same float64 value rounded to 10 mantissa bits instead of 7.
    auto widen = [](std::span<const std::uint16_t> h) {
      std::vector<std::uint16_t> out(h.size());
      for (std::size_t i = 0; i < h.size(); ++i) {
        out[i] = float_to_bf16(detail::f16_bits_to_float(h[i]));
      }
      return out;
    };
    const std::vector<std::uint16_t> ref16_as_bf16 = widen(ref16.out());
    const auto vs_bf16 = test::compare_bf16(ref16_as_bf16, bf16_ref.out());
    EXPECT_TRUE(vs_bf16.nan_ok()) << test::describe(vs_bf16);
    EXPECT_LE(vs_bf16.rel_l2, 4e-3) << test::describe(vs_bf16);
    const std::vector<std::uint16_t> fast16_as_bf16 = widen(fast16.out());
    const auto fast_vs_ref = test::compare_bf16(fast16_as_bf16, ref16_as_bf16);
    EXPECT_TRUE(fast_vs_ref.nan_ok()) << test::describe(fast_vs_ref);
    EXPECT_LE(fast_vs_ref.rel_l2, 4e-3) << test::describe(fast_vs_ref);
    // f16 keeps more of the value than bf16: most elements differ from the bf16 answer's bits
    // once widened, so an f16 output that is really bf16 would show up here.
    std::int64_t finer = 0, nonzero = 0;
    for (std::size_t i = 0; i < ref16_as_bf16.size(); ++i) {
      const float a = detail::f16_bits_to_float(fast16.out()[i]);
      nonzero += a != 0.0f;
      finer += a != bf16_to_float(float_to_bf16(a));
    }
    EXPECT_GT(finer, nonzero / 2) << "of " << nonzero << " nonzero outputs";
    const auto lse = test::compare_lse(fast16.lse(), bf16_ref.lse());
    EXPECT_TRUE(lse.positions_ok()) << test::describe(lse);
    EXPECT_LE(lse.max_err, 1e-4) << test::describe(lse);
  }
}

TEST(F16Queries, RunRejectsADtypeOtherThanPlanned) {
  test::RandomCase c = test::make_case({.batch = 2, .num_heads = 4, .page_size = 16, .seed = 3});
  test::HostOutput out(c);
  Problem p = c.problem();
  p.q_dtype = DType::f16;
  const Plan pl = plan(p);
  RunArgs a = c.host_args(out);  // bf16 q
  expect_error([&] { run(pl, a); }, {"q_nope.dtype", "f16", "bf16"});
  a.q_nope = as_f16(a.q_nope);
  a.q_pe = as_f16(a.q_pe);
  a.out = as_f16(a.out);  // planned out_dtype is bf16
  expect_error([&] { run(pl, a); }, {"out.dtype", "bf16", "f16"});
}

// CUDA plans take f16 queries and outputs as the CPU's do (tests/cuda/test_cuda_f16.cpp runs
// them): validation refuses neither dtype on CUDA.
TEST(F16Queries, CudaPlansTakeF16QueriesAndOutputs) {
  test::RandomCase c = test::make_case({.batch = 2, .num_heads = 4, .page_size = 16, .seed = 4});
  Problem p = c.problem(DeviceKind::cuda);
  p.q_dtype = DType::f16;
  p.out_dtype = DType::f16;
  try {
    (void)plan(p);  // plans where a GPU is visible
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find("q_dtype"), std::string::npos) << what;
    EXPECT_EQ(what.find("out_dtype"), std::string::npos) << what;
  }
}

// ---- borrowed page tables ----

// The case's pool with its pages moved: page p's bytes go to page perm[p].
std::vector<std::uint8_t> permuted_pool(const test::RandomCase& c,
                                        const std::vector<std::int32_t>& perm) {
  const KvCacheView kv = c.kv_view(const_cast<std::uint8_t*>(c.cache.data()));
  const std::int64_t page_bytes =
      kv.ckv.stride[0] * static_cast<std::int64_t>(dtype_size(kv.ckv.dtype));
  EXPECT_EQ(page_bytes * c.num_pages, static_cast<std::int64_t>(c.cache.size()))
      << "the fused layout is one region of whole pages";
  std::vector<std::uint8_t> moved(c.cache.size());
  for (std::int64_t page = 0; page < c.num_pages; ++page) {
    std::memcpy(moved.data() + perm[page] * page_bytes, c.cache.data() + page * page_bytes,
                static_cast<std::size_t>(page_bytes));
  }
  return moved;
}

class BorrowedPages : public ::testing::TestWithParam<bool> {};  // graph mode or not

// Run reads the page ids at run time: rewriting the borrowed buffer in place (pages moved in the
// pool, ids rewritten to match) gives the same answer, bit for bit. A plan that copied the ids
// at plan() reads the old pages (shown with the copying plan on the same rewrite).
TEST_P(BorrowedPages, RunReadsTheCallersBufferAtRunTime) {
  const bool graph = GetParam();
  for (const KvFormat format : {KvFormat::fp8_e4m3, KvFormat::bf16}) {
    SCOPED_TRACE(format_name(format));
    test::RandomCase c = test::make_case({.batch = 5,
                                          .num_heads = 8,
                                          .page_size = 4,
                                          .format = format,
                                          .qo_len_max = 3,
                                          .kv_len_max = 90,
                                          .causal = true,
                                          .seed = 11});
    std::vector<std::int32_t> table = c.kv_indices;  // the caller's buffer
    table.resize(table.size() + 7, -5);              // room past kv_indptr[batch], never read
    Problem p = c.problem();
    p.kv_indices = {};
    p.borrowed_kv_indices = i32_view(table);
    PlanOptions o;
    o.cpu_reference = true;
    if (graph) {
      o.cuda_graph = true;
      o.max_batch = 8;
      o.max_total_q = 32;
      o.max_kv_indices = static_cast<std::int64_t>(table.size());
    }
    const Plan borrowed = plan(p, o);
    const Plan copied = plan(c.problem(), o);

    test::HostOutput want(c), first(c, 32);
    run(copied, c.host_args(want));
    run(borrowed, c.host_args(first));
    ASSERT_TRUE(first.guards_intact());
    EXPECT_EQ(0, std::memcmp(first.out().data(), want.out().data(), first.out().size_bytes()));

    // Move every page and rewrite the ids in place, as an engine's allocator may between steps.
    std::vector<std::int32_t> perm(static_cast<std::size_t>(c.num_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
    std::vector<std::uint8_t> moved = permuted_pool(c, perm);
    for (std::size_t i = 0; i < c.kv_indices.size(); ++i) table[i] = perm[c.kv_indices[i]];

    test::HostOutput after(c, 32), stale(c);
    RunArgs a = c.host_args(after);
    a.kv = c.kv_view(moved.data());
    run(borrowed, a);
    ASSERT_TRUE(after.guards_intact());
    EXPECT_EQ(0, std::memcmp(after.out().data(), want.out().data(), after.out().size_bytes()))
        << "the borrowed plan did not read the rewritten page ids";
    EXPECT_EQ(0, std::memcmp(after.lse().data(), want.lse().data(), after.lse().size_bytes()));

    RunArgs s = c.host_args(stale);
    s.kv = c.kv_view(moved.data());
    run(copied, s);
    EXPECT_NE(0, std::memcmp(stale.out().data(), want.out().data(), stale.out().size_bytes()))
        << "the test cannot tell a borrowed table from a copied one";
  }
}

INSTANTIATE_TEST_SUITE_P(GraphOrNot, BorrowedPages, ::testing::Bool());

TEST(BorrowedPagesRun, AnIdOutsideThePoolIsAnErrorBeforeAnythingIsWritten) {
  for (const bool reference : {false, true}) {
    test::RandomCase c = test::make_case({.batch = 3,
                                          .num_heads = 4,
                                          .page_size = 8,
                                          .kv_len_min = 20,
                                          .kv_len_max = 60,
                                          .seed = 12});
    std::vector<std::int32_t> table = c.kv_indices;
    Problem p = c.problem();
    p.kv_indices = {};
    p.borrowed_kv_indices = i32_view(table);
    PlanOptions o;
    o.cpu_reference = reference;
    const Plan pl = plan(p, o);
    table[table.size() - 1] = static_cast<std::int32_t>(c.num_pages);
    test::HostOutput out(c);
    expect_error([&] { run(pl, c.host_args(out)); },
                 {"borrowed_kv_indices[", "outside the pool", std::to_string(c.num_pages).c_str()});
    for (std::uint16_t v : out.out()) ASSERT_EQ(v, test::kPoisonBf16) << "out was written";
    table[0] = -1;
    expect_error([&] { run(pl, c.host_args(out)); }, {"borrowed_kv_indices[0]", "-1"});
  }
}

TEST(BorrowedPagesPlan, ViewChecks) {
  test::RandomCase c = test::make_case(
      {.batch = 3, .num_heads = 4, .page_size = 8, .kv_len_min = 20, .kv_len_max = 60, .seed = 13});
  std::vector<std::int32_t> table = c.kv_indices;
  Problem p = c.problem();
  p.borrowed_kv_indices = i32_view(table);
  expect_error([&] { (void)plan(p); }, {"borrowed_kv_indices", "give one page table"});
  p.kv_indices = {};
  std::vector<std::int32_t> short_table(table.begin(), table.end() - 1);
  p.borrowed_kv_indices = i32_view(short_table);
  expect_error([&] { (void)plan(p); }, {"borrowed_kv_indices", "fewer than kv_indptr[3]"});
  p.borrowed_kv_indices = i32_view(table);
  p.borrowed_kv_indices.dtype = DType::u8;
  expect_error([&] { (void)plan(p); }, {"borrowed_kv_indices.dtype", "i32"});
  p.borrowed_kv_indices = i32_view(table);
  p.borrowed_kv_indices.stride[0] = 2;
  p.borrowed_kv_indices.shape[0] = static_cast<std::int64_t>(table.size() / 2);
  expect_error([&] { (void)plan(p); }, {"borrowed_kv_indices"});
}

TEST(BorrowedPagesPlan, ReplanKeepsTheBufferTheGraphReads) {
  test::RandomCase c = test::make_case(
      {.batch = 3, .num_heads = 4, .page_size = 8, .kv_len_min = 20, .kv_len_max = 60, .seed = 14});
  std::vector<std::int32_t> table = c.kv_indices, other = c.kv_indices;
  PlanOptions o;
  o.cuda_graph = true;
  o.max_batch = 4;
  o.max_total_q = 4;
  o.max_kv_indices = 64;
  Problem p = c.problem();
  p.kv_indices = {};
  p.borrowed_kv_indices = i32_view(table);
  Plan pl = plan(p, o);
  replan(pl, p);  // the same buffer: fine
  Problem moved = p;
  moved.borrowed_kv_indices = i32_view(other);
  expect_error([&] { replan(pl, moved); }, {"borrowed_kv_indices", "another buffer"});
  expect_error([&] { replan(pl, c.problem()); }, {"borrowed_kv_indices", "give it again"});
  Plan copying = plan(c.problem(), o);
  expect_error([&] { replan(copying, p); }, {"borrowed_kv_indices", "copies its page table"});
}

// ---- the stream-ordered replan on the CPU ----

TEST(StreamOrderedReplan, CpuPlansReplanAsTheSynchronousForm) {
  test::RandomCase first =
      test::make_case({.batch = 2, .num_heads = 8, .page_size = 16, .kv_len_max = 200, .seed = 21});
  test::RandomCase second =
      test::make_case({.batch = 4, .num_heads = 8, .page_size = 16, .kv_len_max = 200, .seed = 22});
  PlanOptions o;
  o.cuda_graph = true;
  o.max_batch = 4;
  o.max_total_q = 4;
  o.max_kv_indices = 256;
  o.sm_count = 2;
  Plan a = plan(first.problem(), o), b = plan(first.problem(), o);
  const Problem p2 = second.problem();
  replan(a, p2);
  replan(b, p2, nullptr);
  test::HostOutput oa(second), ob(second);
  run(a, second.host_args(oa));
  run(b, second.host_args(ob));
  EXPECT_EQ(0, std::memcmp(oa.out().data(), ob.out().data(), oa.out().size_bytes()));
  test::HostOutput ref(second);
  PlanOptions r;
  r.cpu_reference = true;
  run(plan(second.problem(), r), second.host_args(ref));
  const auto cmp = test::compare_bf16(ob.out(), ref.out());
  EXPECT_TRUE(cmp.nan_ok()) << test::describe(cmp);
  EXPECT_LE(cmp.rel_l2, 4e-3) << test::describe(cmp);
}

}  // namespace
}  // namespace fp8mla
