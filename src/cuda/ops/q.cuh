// Q into shared memory or registers, in the forms the families multiply: 16-byte chunks of a
// row (load_q_chunks); a row's hi and lo e4m3 terms as an fp8 wgmma B operand (store_q_terms);
// nine 128-byte-swizzled panels of 64 rows, fp16 scaled per row or bf16 (load_q_panels).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/sync.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::ops {

// Tile row q_r's q as 72 chunks of 8 bf16 dims (nope 0..63, rope 64..71; fp16 queries rounded to
// bf16, q_as_bf16), read by 16 threads a row: thread q_part holds chunks q_part + 16 i (zeros
// past 72 and past the tile's rows).
__device__ __forceinline__ void load_q_chunks(const DecodeParams& p, const WorkTile& t, int q_first,
                                              int rows, int q_r, int q_part, uint4 (&q_v)[5]) {
  const std::int64_t tok = q_first + q_r / t.head_count, h = t.head_begin + q_r % t.head_count;
  const __nv_bfloat16* nope = p.q_nope + tok * p.q_nope_stride[0] + h * p.q_nope_stride[1];
  const __nv_bfloat16* pe = p.q_pe + tok * p.q_pe_stride[0] + h * p.q_pe_stride[1];
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const int c = q_part + 16 * i;
    q_v[i] = make_uint4(0, 0, 0, 0);
    if (c < 72 && q_r < rows)
      q_v[i] = *reinterpret_cast<const uint4*>(c < 64 ? nope + 8 * c : pe + 8 * (c - 64));
  }
  // fp16 queries: rounded after the loads, behind a uniform branch, so bf16 plans run none of it
  // (in the 64-row Q loaders a select on every chunk cost up to 10% of a 128-head call).
  if (p.q_f16) {
#pragma unroll
    for (int i = 0; i < 5; ++i) q_v[i] = q_as_bf16(q_v[i], true);
  }
}

// ---- fp8 Q terms: the <= 16-row fp8 tensor-core families' B operand ----
inline constexpr int kQTermRows = 2 * rows16::kRows;  // wgmma N: the hi and lo terms of each q row
inline constexpr int kQSlab = kQTermRows * 128;
inline constexpr int kQBytes = 4 * kQSlab + kQTermRows * 64;

// 8 bf16 values times `scale` times `scale2` -> their hi and lo e4m3 codes (8 bytes each,
// lowest dim first).
__device__ __forceinline__ void split_e4m3(uint4 v, float scale, float scale2, uint2& hi,
                                           uint2& lo) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
  std::uint32_t h[2] = {0, 0}, l[2] = {0, 0};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = bf16x2_to_float2(w[k]);
    const float2 x = make_float2(f.x * scale * scale2, f.y * scale * scale2);
    const __nv_fp8x2_storage_t hc = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
    const float2 back = fp8x2_to_float2(hc);
    const __nv_fp8x2_storage_t lc = __nv_cvt_float2_to_fp8x2(
        make_float2((x.x - back.x) * 16.0f, (x.y - back.y) * 16.0f), __NV_SATFINITE, __NV_E4M3);
    h[k / 2] |= static_cast<std::uint32_t>(hc) << (16 * (k % 2));
    l[k / 2] |= static_cast<std::uint32_t>(lc) << (16 * (k % 2));
  }
  hi = make_uint2(h[0], h[1]);
  lo = make_uint2(l[0], l[1]);
}

// Row scales for the e4m3 terms. The rope's products are scaled by scale_pe and the nope's by
// scale_nope, so q_pe carries r = scale_pe / scale_nope (a power of two: q_pe * r is exact, and
// pe_a, pe_b are powers of two) and the row takes one exponent e, with
// max(|q_nope|, |q_pe| r) * 2^e in [2^7, 2^8) (e4m3 holds up to 448); 2^-e is undone on the
// scores. Exponents are added as integers, so no product overflows: q_nope * nope and
// (q_pe * pe_a) * pe_b are the scaled values. Rows of zeros keep e = 0.
struct RowScales {
  float nope, pe_a, pe_b;
  int e;
};
__device__ __forceinline__ RowScales e4m3_row_scales(float amax_nope, float amax_pe,
                                                     float scale_nope, float scale_pe) {
  int en = 0, ep = 0, ek = 0, es = 0, eq = 0;
  frexpf(amax_nope, &en);  // amax in [2^(en-1), 2^en)
  const float mp = frexpf(amax_pe, &ep);
  const float r = frexpf(scale_pe, &es) / frexpf(scale_nope, &ek);  // in (1/2, 2)
  frexpf(mp * r, &eq);
  const int e_pe = ep + eq + es - ek;  // |q_pe| r in [2^(e_pe-1), 2^e_pe)
  const int top =
      amax_nope > 0.0f ? (amax_pe > 0.0f ? max(en, e_pe) : en) : (amax_pe > 0.0f ? e_pe : 8);
  const int e = min(max(8 - top, -125), 125);
  const int a = min(max(-ep, -126), 126);  // q_pe * 2^a ~ 1, then * r 2^(e - a + es - ek)
  return {exp2i(e), exp2i(a), ldexpf(r, e - a + es - ek), e};
}

// Byte offset of q column n (0..31), 8-dim chunk c (0..71) in a Q operand at byte kQAt.
template <int kQAt>
__device__ __forceinline__ int q_offset(int n, int c) {
  return c < 64 ? kQAt + c / 16 * kQSlab + n / 8 * 1024 + sw128(n % 8, c % 16 * 8)
                : kQAt + 4 * kQSlab + n / 8 * 512 + sw64(n % 8, (c - 64) * 8);
}

// Byte offset of bf16 q rope chunk c (0..7: dims 8 c + [0, 8)) of row n (0..15) in a bf16 B
// operand at byte kAt: rows of 128 bytes, 128-byte swizzled, 8-row atoms of 1024 bytes.
template <int kAt>
__device__ __forceinline__ int q_rope_offset(int n, int c) {
  return kAt + n / 8 * 1024 + sw128(n % 8, 16 * c);
}

// Q row q_r (q_v: its 16-byte chunks q_part + 16 i, load_q_chunks, 16 threads a row)
// as the B operand at byte kQAt of smem: the row's exponent (e4m3_row_scales) from the |q|
// maxima of its 16 threads, its hi and lo e4m3 terms (split_e4m3; a row holding inf or NaN gets
// NaN codes, so its outputs are NaN, never a finite guess), and scale[q_r] = scale_nope * 2^-e
// for the scores. kRopeBf16At >= 0 (caches with a bf16 rope: the block format): the rope is
// written there instead, as bf16 times the same powers of two (exact), the B operand of a bf16
// wgmma (16 rows of 128 bytes, 128-byte swizzled: q_rope_offset). Row q_r's lo term is operand
// row q_r + kLoRow: 16 (N = 32: hi rows 0-15, then lo), or 8 for tiles of <= 8 rows (N = 16).
template <int kQAt, int kRopeBf16At = -1, int kLoRow = rows16::kRows>
__device__ __forceinline__ void store_q_terms(const DecodeParams& p, const uint4 (&q_v)[5], int q_r,
                                              int q_part, std::uint8_t* smem, float* scale) {
  std::uint32_t mn = 0, mp = 0;  // |q| maxima as float bits (NaN above inf)
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const int c = q_part + 16 * i;
    if (c < 64) mn = max(mn, abs_max_bits(q_v[i]));
    if (c >= 64 && c < 72) mp = max(mp, abs_max_bits(q_v[i]));
  }
#pragma unroll
  for (int x = 8; x >= 1; x /= 2) {
    mn = max(mn, __shfl_xor_sync(0xffffffffu, mn, x));
    mp = max(mp, __shfl_xor_sync(0xffffffffu, mp, x));
  }
  const bool bad = mn >= 0x7f800000u || mp >= 0x7f800000u;
  const RowScales rs = e4m3_row_scales(bad ? 0.0f : __uint_as_float(mn),
                                       bad ? 0.0f : __uint_as_float(mp), p.scale_nope, p.scale_pe);
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const int c = q_part + 16 * i;
    if (c >= 72) continue;
    if (kRopeBf16At >= 0 && c >= 64) {
      const std::uint32_t w[4] = {q_v[i].x, q_v[i].y, q_v[i].z, q_v[i].w};
      std::uint32_t o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = bf16x2_to_float2(w[k]);
        o[k] =
            bad ? 0x7fc07fc0u : float2_to_bf16x2(f.x * rs.pe_a * rs.pe_b, f.y * rs.pe_a * rs.pe_b);
      }
      *reinterpret_cast<uint4*>(smem + q_rope_offset<kRopeBf16At>(q_r, c - 64)) =
          make_uint4(o[0], o[1], o[2], o[3]);
      continue;
    }
    uint2 hi, lo;
    split_e4m3(q_v[i], c < 64 ? rs.nope : rs.pe_a, c < 64 ? 1.0f : rs.pe_b, hi, lo);
    if (bad) hi = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
    *reinterpret_cast<uint2*>(smem + q_offset<kQAt>(q_r, c)) = hi;
    *reinterpret_cast<uint2*>(smem + q_offset<kQAt>(q_r + kLoRow, c)) = lo;
  }
  if (q_part == 0) scale[q_r] = p.scale_nope * exp2i(-rs.e);
  fence_proxy_async();  // the generic stores above, read by wgmma (async proxy)
}

// ---- Q panels: the 17-64-row families' A operand ----
// Q rows into the nine swizzled panels at L::kQ (zero rows past the tile) and L::kQInv, the rows'
// 1 / q scale, by the two consumer warpgroups (threads 0-255) alone: their barriers are named
// barrier 1 (rows64::kConsumerBarrier), and load_q_panels ends with one. kHalfIo: the kernel's
// instantiation for plans with fp16 queries or outputs, which reads DecodeParams::q_f16; the
// other instantiation takes bf16 queries only and holds no fp16 code.

// Tile row r's 16-byte chunk c of 72 in global memory (nope chunks 0..63, rope 64..71).
__device__ __forceinline__ const __nv_bfloat16* q_chunk_src(const DecodeParams& p,
                                                            const WorkTile& t, int q_first, int r,
                                                            int c) {
  const std::int64_t tok = q_first + r / t.head_count, h = t.head_begin + r % t.head_count;
  return c < 64 ? p.q_nope + tok * p.q_nope_stride[0] + h * p.q_nope_stride[1] + 8 * c
                : p.q_pe + tok * p.q_pe_stride[0] + h * p.q_pe_stride[1] + 8 * (c - 64);
}

// Row r's chunk c in the nine panels at L::kQ.
template <class L>
__device__ __forceinline__ uint4* q_panel_chunk(std::uint8_t* smem, int r, int c) {
  return reinterpret_cast<uint4*>(smem + L::kQ + (c / 8) * rows64::kQPanel +
                                  sw128(r, 16 * (c % 8)));
}

// load_q_panels: fp8 caches take fp16, each row scaled by 2^e (q_row_exponent over its nope
// values and its ratio-scaled rope values), kQInv = 2^-e; bf16 caches (L::kBf16) bf16 as given,
// kQInv = 1. Every chunk comes by cp.async, all 18 of a thread in flight with no register holding
// them; then, for fp8 caches or fp16 queries, one pass by row owners: thread (warp w, lane l)
// owns row 8 w + l % 8 and chunks l / 8 + 4 m (m = 0..17), so the 8 lanes of a part read 8 rows
// of one panel column (conflict-free) and a row's four owners meet by two shuffles, with no
// shared scratch or atomics.
template <class L, bool kHalfIo>
__device__ __forceinline__ void load_q_panels(const DecodeParams& p, const WorkTile& t, int q_first,
                                              float ratio, std::uint8_t* smem) {
  const int rows = t.q_count * t.head_count;
  float* inv = reinterpret_cast<float*>(smem + L::kQInv);
  constexpr int kPer = rows64::kRows * 72 / rows64::kThreads;
#pragma unroll 1
  for (int k = 0; k < kPer; ++k) {
    const int i = static_cast<int>(threadIdx.x) + k * rows64::kThreads, r = i / 72, c = i % 72;
    const bool live = r < rows;  // rows past the tile: zeros, from a mapped address
    cp_async_16(q_panel_chunk<L>(smem, r, c), q_chunk_src(p, t, q_first, live ? r : 0, c), live);
  }
  cp_async_commit();
  cp_async_wait<0>();
  const bool f16 = kHalfIo && p.q_f16;
  if (L::kBf16 && !f16) {
    if (threadIdx.x < rows64::kRows) inv[threadIdx.x] = 1.0f;
    fence_proxy_async();  // cp.async writes are generic-proxy; wgmma reads async
    named_barrier_sync(rows64::kConsumerBarrier, rows64::kThreads);
    return;
  }
  named_barrier_sync(rows64::kConsumerBarrier, rows64::kThreads);  // every chunk in
  const int r = 8 * (static_cast<int>(threadIdx.x) / 32) + threadIdx.x % 8;
  const int part = threadIdx.x % 32 / 8;
  uint4 v[kPer];
  std::uint32_t mn = 0, mp = 0;  // |q| maxima as float bits (NaN above inf)
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int c = part + 4 * m;
    v[m] = *q_panel_chunk<L>(smem, r, c);
    if (f16) v[m] = q_as_bf16(v[m], true);
    if (c < 64) {
      mn = max(mn, abs_max_bits(v[m]));
    } else {
      mp = max(mp, abs_max_bits(v[m]));
    }
  }
  if constexpr (L::kBf16) {
#pragma unroll
    for (int m = 0; m < kPer; ++m) *q_panel_chunk<L>(smem, r, part + 4 * m) = v[m];
    if (part == 0) inv[r] = 1.0f;
  } else {
#pragma unroll
    for (int x = 8; x <= 16; x *= 2) {
      mn = max(mn, __shfl_xor_sync(0xffffffffu, mn, x));
      mp = max(mp, __shfl_xor_sync(0xffffffffu, mp, x));
    }
    const int e =
        q_row_exponent(__uint_as_float(max(mn, __float_as_uint(__uint_as_float(mp) * ratio))));
    const float s_nope = exp2i(e), s_pe = ratio * exp2i(e);  // one rounding, as ldexpf
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int c = part + 4 * m;
      const float s = c < 64 ? s_nope : s_pe;
      *q_panel_chunk<L>(smem, r, c) =
          make_uint4(scale_to_half2(v[m].x, s), scale_to_half2(v[m].y, s),
                     scale_to_half2(v[m].z, s), scale_to_half2(v[m].w, s));
    }
    if (part == 0) inv[r] = exp2i(-e);
  }
  fence_proxy_async();
  named_barrier_sync(rows64::kConsumerBarrier, rows64::kThreads);
}

// The address lane `lane` of warp `warp` gives ldmatrix / stmatrix for k-step kk of a 64 x 64
// 16-bit panel (128-byte swizzle): row 16 warp + 8 (lane / 8 % 2) + lane % 8, columns 16 kk +
// 8 (lane / 16), so the four 8x8 matrices are the wgmma A fragment a[0..3] (rows + 8 (j % 2),
// columns + 8 (j / 2)) of the warp's 16 rows.
__device__ __forceinline__ std::uint8_t* frag_addr(std::uint8_t* panel, int warp, int lane,
                                                   int kk) {
  const int row = 16 * warp + 8 * (lane / 8 % 2) + lane % 8, col = 16 * kk + 8 * (lane / 16);
  return panel + sw128(row, 2 * col);
}

// This thread's rows 16 warp + g (+ 8): their causal limits and score scales (scale_nope times
// the row's 1 / q scale, qinv). Rows past the tile (zero q, never written) take no bound, so they
// do not force the masked path.
__device__ __forceinline__ void row_bounds(const DecodeParams& p, const DeviceTile& tile, int warp,
                                           int g, const float* qinv, int (&limit)[2],
                                           float (&sc)[2]) {
  const int rows = tile.tile.q_count * tile.tile.head_count;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    limit[h] = r < rows ? row_limit(p, tile.tile, r, tile.kv_len, tile.qo_len) : INT32_MAX;
    sc[h] = p.scale_nope * qinv[r];
  }
}

}  // namespace fp8mla::detail::ops
