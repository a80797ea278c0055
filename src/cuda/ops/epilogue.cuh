// A finished row: o / l in bf16 with its lse (natural log) into the output, or the fp32 partial
// row of a split tile for the merge; for the fragment mappings of the <= 16-row families
// (write_row, write_row_trans) and of the 17-64-row families' wgmma accumulators (store_rows).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::ops {

// Two adjacent output elements at dst from fp32: bf16, or fp16 when f16 (the plan's out dtype;
// both round to nearest even, fp16 to +-inf past its range as a cast does). Both conversions
// are made and their bits selected: a branch here (or one around an epilogue's loop) cost
// fp8_tma's epilogue a spilled register; the select leaves every kernel's registers as they are.
__device__ __forceinline__ void store_out2(__nv_bfloat16* dst, bool f16, float a, float b) {
  const __nv_bfloat162 x = __floats2bfloat162_rn(a, b);
  const __half2 y = __floats2half2_rn(a, b);
  *reinterpret_cast<std::uint32_t*>(dst) =
      f16 ? reinterpret_cast<const std::uint32_t&>(y) : reinterpret_cast<const std::uint32_t&>(x);
}

// store_out2 with the out dtype known at compile time: one conversion (store_rows, whose kernels
// are instantiated per dtype: the select's second conversion and moves cost wide_rows 1-10% at
// 128 heads: docs/design/wide_rows.md, tried and rejected).
template <bool kF16>
__device__ __forceinline__ void store_out2(__nv_bfloat16* dst, float a, float b) {
  if constexpr (kF16) {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  }
}

// Output scale (out_scale / l) and lse (natural log) of a finished row with log2-domain max m and
// sum l. l == 0: the row saw nothing (o = 0, lse = -inf); l NaN: a NaN in the cache reached the
// row (fmaxf skipped it in the max), so o and lse are NaN as in the reference.
struct RowEnd {
  float inv, lse;
};
__device__ __forceinline__ RowEnd finish_row(float m, float l, float out_scale) {
  if (l > 0.0f) return {out_scale / l, (m + log2f(l)) * kLn2};
  if (l == 0.0f) return {0.0f, -INFINITY};
  return {NAN, NAN};
}

// Writes row r (= g + 8 h) of a finished tile from the P V fragments o (n-tile n, fragment
// column g is column 64 warp + 8 g + n, so the thread holds columns 64 warp + 16 tq + n and
// + 8 + n): bf16 out and lse, or the split's fp32 partial row and its lse (fp8_exact, fp8_tma,
// fp8_gather, and portable over codes; write_row_trans below for bf16 V by ldmatrix.trans).
__device__ __forceinline__ void write_row(const DecodeParams& p, const WorkTile& t,
                                          const DeviceTile& tile, int warp, int tq, int h, int r,
                                          const float (&o)[8][4], RowEnd end) {
  const float inv = end.inv, lse = end.lse;
  const int tr = r / t.head_count;
  const std::int64_t head = t.head_begin + r % t.head_count;
  const std::int64_t token = tile.q_first + tr;
  const int col0 = 64 * warp + 16 * tq;  // columns col0 + n (c0, c2) and col0 + 8 + n (c1, c3)
  if (t.split < 0) {
    __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col0;
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      store_out2(dst + n, p.out_f16, o[n][2 * h] * inv, o[n + 1][2 * h] * inv);
      store_out2(dst + 8 + n, p.out_f16, o[n][2 * h + 1] * inv, o[n + 1][2 * h + 1] * inv);
    }
    if (p.lse != nullptr && warp == 0 && tq == 0)
      p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = lse;
  } else {
    const std::int64_t prow = partial_row(p, t, tile.qo_len, tr, head);
    float* dst = p.partial_o + prow * 512 + col0;
#pragma unroll
    for (int n = 0; n < 8; n += 4) {
      *reinterpret_cast<float4*>(dst + n) = make_float4(
          o[n][2 * h] * inv, o[n + 1][2 * h] * inv, o[n + 2][2 * h] * inv, o[n + 3][2 * h] * inv);
      *reinterpret_cast<float4*>(dst + 8 + n) =
          make_float4(o[n][2 * h + 1] * inv, o[n + 1][2 * h + 1] * inv, o[n + 2][2 * h + 1] * inv,
                      o[n + 3][2 * h + 1] * inv);
    }
    if (warp == 0 && tq == 0) p.partial_lse[prow] = lse;
  }
}

// Writes row r (= g + 8 h of its m-tile) of a finished tile whose P V fragments came through
// ldmatrix.trans of bf16 V (n-tile n holds columns 64 warp + 8 n + 2 tq, + 1): bf16 out and lse,
// or the split's fp32 partial row and lse (bf16_tma, bf16_gather, portable over bf16, shared_tile
// for each of its m-tiles).
__device__ __forceinline__ void write_row_trans(const DecodeParams& p, const WorkTile& t,
                                                const DeviceTile& tile, int warp, int tq, int h,
                                                int r, const float (&o)[8][4], RowEnd end) {
  const int tr = r / t.head_count;
  const std::int64_t head = t.head_begin + r % t.head_count;
  const std::int64_t token = tile.q_first + tr;
  const int col0 = 64 * warp + 2 * tq;  // n-tile n: columns col0 + 8 n, + 1
  if (t.split < 0) {
    __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col0;
#pragma unroll
    for (int n = 0; n < 8; ++n)
      store_out2(dst + 8 * n, p.out_f16, o[n][2 * h] * end.inv, o[n][2 * h + 1] * end.inv);
    if (p.lse != nullptr && warp == 0 && tq == 0)
      p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = end.lse;
  } else {
    const std::int64_t prow = partial_row(p, t, tile.qo_len, tr, head);
    float* dst = p.partial_o + prow * 512 + col0;
#pragma unroll
    for (int n = 0; n < 8; ++n)
      *reinterpret_cast<float2*>(dst + 8 * n) =
          make_float2(o[n][2 * h] * end.inv, o[n][2 * h + 1] * end.inv);
    if (warp == 0 && tq == 0) p.partial_lse[prow] = end.lse;
  }
}

// Epilogue: this thread's rows 16 warp + g + 8 h of O (output dims 256 group + 64 c + 8 n +
// 2 tq, + 1) divided by the row sums l (whole rows), with max m: bf16 out (fp16 when kHalfIo and
// DecodeParams::out_f16; kHalfIo as load_q_panels takes it) (+ lse), or the fp32 partial row of a
// split.
template <bool kHalfIo>
__device__ __forceinline__ void store_rows(const DecodeParams& p, const DeviceTile& tile, int group,
                                           int warp, int lane, const float (&o)[4][32],
                                           const float (&m)[2], const float (&l)[2]) {
  const WorkTile& t = tile.tile;
  const int g = lane / 4, tq = lane % 4;
  const int rows = t.q_count * t.head_count;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    if (r >= rows) continue;
    const RowEnd end = finish_row(m[h], l[h], p.out_scale);
    const int tr = r / t.head_count;
    const std::int64_t head = t.head_begin + r % t.head_count;
    const std::int64_t token = tile.q_first + tr;
    const int col0 = 256 * group + 2 * tq;  // + 64 c + 8 n
    if (t.split < 0) {
      __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col0;
      auto store = [&]<bool kF16>() {
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int n = 0; n < 8; ++n)
            store_out2<kF16>(dst + 64 * c + 8 * n, o[c][4 * n + 2 * h] * end.inv,
                             o[c][4 * n + 2 * h + 1] * end.inv);
      };
      if (kHalfIo && p.out_f16) {
        store.template operator()<kHalfIo>();
      } else {
        store.template operator()<false>();
      }
      if (p.lse != nullptr && group == 0 && tq == 0)
        p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = end.lse;
    } else {
      const std::int64_t prow = partial_row(p, t, tile.qo_len, tr, head);
      float* dst = p.partial_o + prow * 512 + col0;
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int n = 0; n < 8; ++n)
          *reinterpret_cast<float2*>(dst + 64 * c + 8 * n) =
              make_float2(o[c][4 * n + 2 * h] * end.inv, o[c][4 * n + 2 * h + 1] * end.inv);
      if (group == 0 && tq == 0) p.partial_lse[prow] = end.lse;
    }
  }
}

}  // namespace fp8mla::detail::ops
