// GPU tests, the device cache append and merge_states against their host versions. They
// GTEST_SKIP when no CUDA device is visible.
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

}  // namespace
}  // namespace fp8mla
