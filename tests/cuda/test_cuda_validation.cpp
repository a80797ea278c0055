// GPU tests, bad input and plan inputs on CUDA: a misaligned cache, a scale ratio the plan was
// not made for, a forced kernel family. They GTEST_SKIP when no CUDA device is visible.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/context_parallel.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "tests/common/test_util.h"
#include "tests/cuda/decode_cases.h"
#include "tests/cuda/gpu_test_util.h"

namespace fp8mla {
namespace {

using namespace gputest;  // NOLINT: the GPU test helpers

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

// An fp8_e4m3 plan made for a power-of-two kpe_scale / ckv_scale (the default) refuses another
// ratio at run(), naming kv.kpe_scale, and writes nothing; planned with any_scale_ratio, the same
// run takes fp8_exact's path and matches the reference.
TEST(CudaValidation, ScaleRatioIsAPlanInput) {
  SKIP_WITHOUT_GPU();
  test::ProblemSpec s = decode_spec(F8, 8, 16, 100, 700, 96);
  s.ckv_scale = 0.001f;
  s.kpe_scale = 1000.0f;
  test::RandomCase c = test::make_case(s);
  DeviceBuffer cache(c.cache), q(c.q);
  DeviceOutput d(c, 256);
  const auto poisoned = d.out.to_host<std::uint16_t>();
  const Plan p = plan(c.problem(DeviceKind::cuda));
  try {
    run(p, device_args(c, cache, q, d));
    ADD_FAILURE() << "a ratio of 1e6 accepted by a power-of-two plan";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_EQ(e.argument(), "kv.kpe_scale") << e.what();
    EXPECT_NE(std::string(e.what()).find("any_scale_ratio"), std::string::npos) << e.what();
  }
  detail::cuda_synchronize(0);
  EXPECT_EQ(d.out.to_host<std::uint16_t>(), poisoned) << "the refused run wrote out";
  PlanOptions any;
  any.any_scale_ratio = true;
  if (!family_forced()) {
    EXPECT_STREQ(plan(c.problem(DeviceKind::cuda), any).kernel_name(), "fp8_exact");
  }
  check_case(c, "any_scale_ratio", any);
}

// PlanOptions::kernel_family on a CUDA plan: a family that serves the problem runs it (fp8_exact
// where fp8_tma is the table's choice, matching the reference); one that cannot is refused,
// naming options.kernel_family and the family.
TEST(CudaValidation, ForcedFamilyServesOrIsRefused) {
  SKIP_WITHOUT_GPU();
  if (detail::cuda_compute_capability(0) != 90) GTEST_SKIP() << "the Hopper families need sm_90";
  test::RandomCase c = fp8_case(8, 16, 100, 700, 97);
  PlanOptions forced;
  forced.kernel_family = KernelFamily::fp8_exact;
  EXPECT_STREQ(plan(c.problem(DeviceKind::cuda), forced).kernel_name(), "fp8_exact");
  check_case(c, "forced fp8_exact", forced);
  for (const KernelFamily f : {KernelFamily::bf16_tma, KernelFamily::wide_rows,
                               KernelFamily::shared_tile, KernelFamily::cpu_fast}) {
    PlanOptions o;
    o.kernel_family = f;
    try {
      (void)plan(c.problem(DeviceKind::cuda), o);
      ADD_FAILURE() << kernel_family_name(f) << " accepted for an fp8_e4m3 plan of 8 rows";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      EXPECT_EQ(e.argument(), "options.kernel_family");
      EXPECT_NE(std::string(e.what()).find(kernel_family_name(f)), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace fp8mla
