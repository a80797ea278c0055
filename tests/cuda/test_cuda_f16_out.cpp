// f16 outputs on the GPU (Problem::out_dtype = f16; CUDA queries stay bf16): every family's
// epilogue and the split-KV merge store fp16 from their fp32 rows.
#include <gtest/gtest.h>

#include <cstdint>
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
    {BF, 8, 64, KernelFamily::automatic},    // bf16_tma
    {BF, 16, 1, KernelFamily::automatic},    // bf16_gather
    {BF, 128, 64, KernelFamily::automatic},  // bf16_wide_rows
    {BL, 8, 64, KernelFamily::automatic},    // fp8_gather, block format
    {BL, 64, 1, KernelFamily::automatic},    // wide_rows, block format
    {BL, 16, 64, KernelFamily::shared_tile},
    {F8, 8, 64, KernelFamily::portable},
    {BF, 64, 16, KernelFamily::portable},
};

TEST(CudaDecodeF16Out, EveryFamilyAndTheMergeWriteF16) {
  SKIP_WITHOUT_GPU();
  for (const F16OutRow& row : kRows) {
    test::ProblemSpec s = decode_spec(row.format, row.heads, row.page_size, 1, 3000,
                                      700 + static_cast<std::uint64_t>(row.heads + row.page_size));
    test::RandomCase c = test::make_case(s);
    PlanOptions o = options_for(c, {});
    o.kernel_family = row.family;
    Problem pr = c.problem(DeviceKind::cuda);
    pr.out_dtype = DType::f16;
    const Plan p = plan(pr, o);
    const std::string what = std::string(format_name(row.format)) + ", " +
                             std::to_string(row.heads) + " heads, page " +
                             std::to_string(row.page_size) + ", " + p.kernel_name();
    bool split = false;
    for (const WorkTile& t : p.tiles()) split = split || t.split >= 0;
    EXPECT_TRUE(split) << what << ": no request is split, so the merge is not covered";

    test::HostOutput ref = reference(c);
    DeviceBuffer cache(c.cache), q(c.q);
    DeviceOutput d(c, 256);
    RunArgs args = device_args(c, cache, q, d);
    args.out.dtype = DType::f16;
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
    for (std::int64_t i = 0; i < d.guard; ++i) {
      ASSERT_EQ(out[static_cast<std::size_t>(i)], test::kPoisonBf16) << what << ": before out";
      ASSERT_EQ(out[static_cast<std::size_t>(d.guard + d.n_out + i)], test::kPoisonBf16)
          << what << ": after out";
    }
  }
}

}  // namespace
}  // namespace fp8mla
