// merge_states on the CPU (include/fp8mla/attention.h): partial states of the same rows combined
// as a direct float64 merge does, for every dtype pair, with empty states and rows, and through
// strided views.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/format.h"
#include "tests/common/test_util.h"

namespace fp8mla {
namespace {

// Direct float64 merge of row r: states with lse -inf are skipped.
void merge_direct(const std::vector<double>& v, const std::vector<double>& s, int n, int dim, int r,
                  std::vector<double>& out, double& lse) {
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) m = std::max(m, s[r * n + i]);
  out.assign(dim, 0.0);
  if (std::isinf(m)) {
    lse = m;
    return;
  }
  double sum = 0.0;
  for (int i = 0; i < n; ++i) {
    if (std::isinf(s[r * n + i])) continue;
    const double w = std::exp(s[r * n + i] - m);
    sum += w;
    for (int d = 0; d < dim; ++d) out[d] += w * v[(r * n + i) * dim + d];
  }
  for (double& x : out) x /= sum;
  lse = m + std::log(sum);
}

// Every dtype pair; empty states hold NaN values (never read); rows 3, 10, ... are all empty
// (v_out = 0, s_out = -inf, no NaN).
TEST(CpuBackendMerge, MatchesDirectComputationWithEmptyStatesAndRows) {
  constexpr int kRows = 37, kStates = 5, kDim = 100;
  std::mt19937_64 rng(21);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(kRows * kStates * kDim), s(kRows * kStates);
  for (double& x : v) x = bf16_to_float(float_to_bf16(static_cast<float>(normal(rng))));
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kStates; ++i) {
      const bool empty = r % 7 == 3 || (r * kStates + i) % 4 == 1;
      s[r * kStates + i] =
          empty ? -std::numeric_limits<double>::infinity() : static_cast<float>(3.0 * normal(rng));
      if (empty) {
        for (int d = 0; d < kDim; ++d) v[(r * kStates + i) * kDim + d] = std::nan("");
      }
    }
  }
  std::vector<float> s32(s.begin(), s.end()), v32(v.begin(), v.end());
  std::vector<std::uint16_t> v16(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) v16[i] = float_to_bf16(v32[i]);

  for (DType in : {DType::f32, DType::bf16}) {
    for (DType out_dtype : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(std::string(dtype_name(in)) + " -> " + dtype_name(out_dtype));
      std::vector<float> out32(kRows * kDim);
      std::vector<std::uint16_t> out16(kRows * kDim);
      std::vector<float> lse(kRows);
      test::poison(out32);
      test::poison(out16);
      test::poison(lse);
      void* in_data = in == DType::f32 ? static_cast<void*>(v32.data()) : v16.data();
      void* out_data = out_dtype == DType::f32 ? static_cast<void*>(out32.data()) : out16.data();
      merge_states(make_view(in_data, in, {kRows, kStates, kDim}),
                   make_view(s32.data(), DType::f32, {kRows, kStates}),
                   make_view(out_data, out_dtype, {kRows, kDim}),
                   make_view(lse.data(), DType::f32, {kRows}));
      const double tol = out_dtype == DType::bf16 ? 1.0 / 128 : 1e-5;
      std::vector<double> want;
      double want_lse = 0.0;
      for (int r = 0; r < kRows; ++r) {
        merge_direct(v, s, kStates, kDim, r, want, want_lse);
        if (std::isinf(want_lse)) {
          EXPECT_EQ(lse[r], -std::numeric_limits<float>::infinity()) << "row " << r;
        } else {
          EXPECT_NEAR(lse[r], want_lse, 1e-5 * std::max(1.0, std::fabs(want_lse))) << "row " << r;
        }
        for (int d = 0; d < kDim; ++d) {
          const double got =
              out_dtype == DType::f32 ? out32[r * kDim + d] : bf16_to_float(out16[r * kDim + d]);
          if (std::isinf(want_lse)) {
            ASSERT_EQ(got, 0.0) << "empty row " << r << " d " << d;
          } else {
            ASSERT_NEAR(got, want[d], tol * std::max(1.0, std::fabs(want[d])))
                << "row " << r << " d " << d;
          }
        }
      }
    }
  }
}

// A states-major buffer [num_states, rows, D] passed as a permuted view, with a padded output:
// the same numbers as the contiguous layout, bit for bit.
TEST(CpuBackendMerge, StatesMajorStridedViewMatchesContiguous) {
  constexpr int kRows = 19, kStates = 3, kDim = 512, kOutPad = 16;
  std::mt19937_64 rng(22);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(kRows * kStates * kDim), s(kRows * kStates);
  for (float& x : v) x = normal(rng);
  for (float& x : s) x = rng() % 5 == 0 ? -std::numeric_limits<float>::infinity() : normal(rng);
  std::vector<float> v_major(v.size()), s_major(s.size());  // [states, rows, ...]
  for (int r = 0; r < kRows; ++r) {
    for (int i = 0; i < kStates; ++i) {
      s_major[i * kRows + r] = s[r * kStates + i];
      for (int d = 0; d < kDim; ++d) {
        v_major[(i * kRows + r) * kDim + d] = v[(r * kStates + i) * kDim + d];
      }
    }
  }
  std::vector<float> want(kRows * kDim), want_lse(kRows);
  merge_states(make_view(v.data(), DType::f32, {kRows, kStates, kDim}),
               make_view(s.data(), DType::f32, {kRows, kStates}),
               make_view(want.data(), DType::f32, {kRows, kDim}),
               make_view(want_lse.data(), DType::f32, {kRows}));
  std::vector<float> got(kRows * (kDim + kOutPad)), got_lse(kRows);
  test::poison(got);
  merge_states(make_strided_view(v_major.data(), DType::f32, {kRows, kStates, kDim},
                                 {kDim, kRows * kDim, 1}),
               make_strided_view(s_major.data(), DType::f32, {kRows, kStates}, {1, kRows}),
               make_strided_view(got.data(), DType::f32, {kRows, kDim}, {kDim + kOutPad, 1}),
               make_view(got_lse.data(), DType::f32, {kRows}));
  for (int r = 0; r < kRows; ++r) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got_lse[r]), std::bit_cast<std::uint32_t>(want_lse[r]));
    for (int d = 0; d < kDim + kOutPad; ++d) {
      const std::uint32_t bits = std::bit_cast<std::uint32_t>(got[r * (kDim + kOutPad) + d]);
      if (d < kDim) {
        ASSERT_EQ(bits, std::bit_cast<std::uint32_t>(want[r * kDim + d])) << r << "," << d;
      } else {
        ASSERT_EQ(bits, test::kPoisonF32) << "pad written at row " << r;
      }
    }
  }
}

}  // namespace
}  // namespace fp8mla
