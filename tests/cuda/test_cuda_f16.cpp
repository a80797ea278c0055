// f16 queries and outputs on the GPU: every family's epilogue and the split-KV merge store fp16
// from their fp32 rows; every family takes fp16 queries, rounding them to bf16 as it loads them
// (ops::q_as_bf16), but for portable_f16_exact, which the table chooses for fp16 queries over a
// bf16 cache and whose products are fp16-exact (FlashInfer's fp16 tolerance holds there).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/format.h"
#include "src/core/backend.h"
#include "src/core/f16.h"
#include "tests/common/test_util.h"
#include "tests/cuda/decode_cases.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using namespace gputest;  // NOLINT: the GPU test helpers

struct F16OutRow {
  KvFormat format;
  int heads, page_size;
  KernelFamily family;  // automatic: as the table chooses (the comment names it on Hopper)
};

// Each family once, on requests long enough that the plan splits them (the merge writes those
// rows) beside short ones (the families write those).
const F16OutRow kRows[] = {
    {F8, 8, 64, KernelFamily::automatic},    // fp8_tma
    {F8, 8, 1, KernelFamily::automatic},     // fp8_gather
    {F8, 16, 64, KernelFamily::fp8_exact},   // fp8_exact
    {F8, 64, 16, KernelFamily::automatic},   // wide_rows
    {BF, 8, 64, KernelFamily::bf16_tma},  // named: fp16 queries would choose portable_f16_exact
    {BF, 16, 1, KernelFamily::bf16_gather},
    {BF, 128, 64, KernelFamily::bf16_wide_rows},
    {BL, 8, 64, KernelFamily::automatic},    // fp8_gather, block format
    {BL, 64, 1, KernelFamily::automatic},    // wide_rows, block format
    {BL, 16, 64, KernelFamily::shared_tile},
    {F8, 8, 64, KernelFamily::portable},
    {BF, 64, 16, KernelFamily::portable},
};

// q of the case as fp16 values that bf16 cannot hold: each value times (1 + 3 * 2^-10), rounded
// to fp16 (values below fp16's normal range are set to 0 in the case and in the copy).
std::vector<std::uint16_t> f16_q_finer_than_bf16(test::RandomCase& c) {
  std::vector<std::uint16_t> q(c.q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    const float v = bf16_to_float(c.q[i]);
    q[i] = std::fabs(v) < 0x1p-14f ? 0 : detail::float_to_f16_bits(v * (1.0f + 3.0f * 0x1p-10f));
  }
  return q;
}

// The float64 reference of case c into ref, with the fp16 queries q16 when given and fp16
// outputs when out_f16.
void reference_f16(test::RandomCase& c, test::HostOutput& ref,
                   const std::vector<std::uint16_t>* q16, bool out_f16) {
  PlanOptions ro;
  ro.cpu_reference = true;
  Problem rp = c.problem();
  RunArgs ra = c.host_args(ref);
  if (q16 != nullptr) {
    rp.q_dtype = DType::f16;
    ra.q_nope = c.q_nope_view(const_cast<std::uint16_t*>(q16->data()));
    ra.q_pe = c.q_pe_view(const_cast<std::uint16_t*>(q16->data()));
    ra.q_nope.dtype = ra.q_pe.dtype = DType::f16;
  }
  if (out_f16) rp.out_dtype = ra.out.dtype = DType::f16;
  run(plan(rp, ro), ra);
}

// Every row of kRows with f16 outputs; f16_q: fp16 queries too (the reference multiplies the
// fp16 values in float64; the kernels round them to bf16, 2^-9 relative at most, which the
// output tolerance covers).
void every_family_writes_f16(bool f16_q) {
  for (const F16OutRow& row : kRows) {
    test::ProblemSpec s = decode_spec(row.format, row.heads, row.page_size, 1, 3000,
                                      700 + static_cast<std::uint64_t>(row.heads + row.page_size));
    test::RandomCase c = test::make_case(s);
    const std::vector<std::uint16_t> q16 = f16_q_finer_than_bf16(c);
    PlanOptions o = options_for(c, {});
    o.kernel_family = row.family;
    Problem pr = c.problem(DeviceKind::cuda);
    pr.out_dtype = DType::f16;
    if (f16_q) pr.q_dtype = DType::f16;
    const Plan p = plan(pr, o);
    const std::string what = std::string(format_name(row.format)) + ", " +
                             std::to_string(row.heads) + " heads, page " +
                             std::to_string(row.page_size) + ", " + p.kernel_name() +
                             (f16_q ? ", f16 q" : ", bf16 q");
    bool split = false;
    for (const WorkTile& t : p.tiles()) split = split || t.split >= 0;
    EXPECT_TRUE(split) << what << ": no request is split, so the merge is not covered";

    test::HostOutput ref(c);
    reference_f16(c, ref, f16_q ? &q16 : nullptr, false);
    DeviceBuffer cache(c.cache), q(f16_q ? q16 : c.q);
    DeviceOutput d(c, 256);
    RunArgs args = device_args(c, cache, q, d);
    args.out.dtype = DType::f16;
    if (f16_q) args.q_nope.dtype = args.q_pe.dtype = DType::f16;
    run(p, args);
    detail::cuda_synchronize(0);

    // The f16 answer widened to float, then rounded to bf16 bits for the comparison with the
    // bf16 reference; f16 keeps 3 more mantissa bits than bf16, so most nonzero elements carry
    // bits bf16 has not (an output that is really bf16 fails the count).
    const auto out = d.out.to_host<std::uint16_t>();
    std::vector<std::uint16_t> widened(static_cast<std::size_t>(d.n_out));
    std::int64_t finer = 0, nonzero = 0;
    for (std::int64_t i = 0; i < d.n_out; ++i) {
      const float v = detail::f16_bits_to_float(out[static_cast<std::size_t>(d.guard + i)]);
      widened[static_cast<std::size_t>(i)] = float_to_bf16(v);
      nonzero += v != 0.0f;
      finer += v != bf16_to_float(float_to_bf16(v));
    }
    const test::Comparison co = test::compare_bf16(widened, ref.out());
    EXPECT_TRUE(co.nan_ok()) << what << ": " << test::describe(co);
    EXPECT_LE(co.rel_l2, kOutTol) << what << ": " << test::describe(co);
    EXPECT_GT(finer, nonzero / 2) << what << ": of " << nonzero << " nonzero outputs";
    const auto lse = d.lse.to_host<float>();
    const test::LseComparison cl = test::compare_lse(
        std::span<const float>(lse.data() + d.guard, static_cast<std::size_t>(d.n_lse)),
        ref.lse());
    EXPECT_TRUE(cl.positions_ok()) << what << ": " << test::describe(cl);
    EXPECT_LE(cl.max_err, kLseTol) << what << ": " << test::describe(cl);
    expect_guards(d, what);
  }
}

TEST(CudaDecodeF16, EveryFamilyAndTheMergeWriteF16) {
  SKIP_WITHOUT_GPU();
  every_family_writes_f16(false);
}

// fp16 queries finer than bf16, against the float64 reference of those fp16 values: a family
// that read the fp16 bits as bf16 would be off by orders of magnitude.
TEST(CudaDecodeF16, EveryFamilyTakesF16Queries) {
  SKIP_WITHOUT_GPU();
  every_family_writes_f16(true);
}

// Elements of `out` outside FlashInfer's fp16 tolerance (torch.testing.assert_close with
// rtol = atol = 1e-3) of `ref`, both fp16 bits; NaN matches NaN only.
std::int64_t f16_misses(std::span<const std::uint16_t> out, std::span<const std::uint16_t> ref) {
  std::int64_t misses = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double a = detail::f16_bits_to_float(out[i]), b = detail::f16_bits_to_float(ref[i]);
    const bool ok = std::isnan(b) ? std::isnan(a) : std::fabs(a - b) <= 1e-3 + 1e-3 * std::fabs(b);
    misses += !ok;
  }
  return misses;
}

struct ExactRow {
  int heads, page_size, qo_len, topk;
};

// fp16 queries and outputs over a bf16 cache, as FlashInfer's fp16 MLA tests run them: the table
// chooses portable_f16_exact, whose every output element meets FlashInfer's fp16 tolerance
// against the float64 reference of the fp16 values (rounded to fp16 as the output is). The same
// case on a family that rounds q to bf16 misses it (the check tells the two apart).
TEST(CudaDecodeF16, F16QueriesOverBf16MeetAnF16Tolerance) {
  SKIP_WITHOUT_GPU();
  // The table's choice (portable_f16_exact) is what meets the tolerance; a forced family rounds
  // q to bf16 and misses it by design (the test's own other family shows by how much).
  if (family_forced())
    GTEST_SKIP() << "FP8MLA_KERNEL_FAMILY=" << std::getenv("FP8MLA_KERNEL_FAMILY");
  const ExactRow rows[] = {
      {8, 64, 1, 0},     // 16-row tiles, split requests
      {16, 1, 2, 0},     // causal two-token decode: 32-row tiles
      {128, 16, 1, 0},   // 64-row tiles
      {16, 1, 1, 256},   // sparse top-k lists
  };
  for (const ExactRow& row : rows) {
    test::ProblemSpec s = decode_spec(BF, row.heads, row.page_size, 1, 3000,
                                      900 + static_cast<std::uint64_t>(row.heads + row.qo_len));
    s.qo_len_min = s.qo_len_max = row.qo_len;
    s.causal = row.qo_len > 1;
    s.topk = row.topk;
    test::RandomCase c = test::make_case(s);
    const std::vector<std::uint16_t> q16 = f16_q_finer_than_bf16(c);
    const std::string what = std::to_string(row.heads) + " heads, page " +
                             std::to_string(row.page_size) + ", qo " +
                             std::to_string(row.qo_len) + ", top-k " + std::to_string(row.topk);

    test::HostOutput ref(c);
    reference_f16(c, ref, &q16, true);
    auto misses_on = [&](KernelFamily family) {
      PlanOptions o = options_for(c, {});
      o.kernel_family = family;
      Problem pr = c.problem(DeviceKind::cuda);
      pr.q_dtype = pr.out_dtype = DType::f16;
      const Plan p = plan(pr, o);
      if (family == KernelFamily::automatic) {
        EXPECT_EQ(std::string(p.kernel_name()), "portable_f16_exact") << what;
      }
      DeviceBuffer cache(c.cache), q(q16);
      DeviceOutput d(c, 256);
      RunArgs args = device_args(c, cache, q, d);
      args.q_nope.dtype = args.q_pe.dtype = args.out.dtype = DType::f16;
      run(p, args);
      detail::cuda_synchronize(0);
      expect_guards(d, what);
      const auto out = d.out.to_host<std::uint16_t>();
      const auto lse = d.lse.to_host<float>();
      const test::LseComparison cl = test::compare_lse(
          std::span<const float>(lse.data() + d.guard, static_cast<std::size_t>(d.n_lse)),
          ref.lse());
      EXPECT_TRUE(cl.positions_ok()) << what << ": " << test::describe(cl);
      EXPECT_LE(cl.max_err, family == KernelFamily::automatic ? 1e-3 : kLseTol)
          << what << ": " << test::describe(cl);
      return f16_misses(std::span<const std::uint16_t>(out.data() + d.guard,
                                                       static_cast<std::size_t>(d.n_out)),
                        ref.out());
    };
    EXPECT_EQ(misses_on(KernelFamily::automatic), 0) << what << ": of " << ref.out().size();
    if (row.heads == 8) {
      EXPECT_GT(misses_on(KernelFamily::bf16_gather), 0)
          << what << ": q rounded to bf16 should miss the fp16 tolerance somewhere";
    }
  }
}

}  // namespace
}  // namespace fp8mla
