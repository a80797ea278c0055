// The online softmax in the log2 domain: the <= 16-row families' (a thread's S entries and O
// rows, the rows' block maxima over a warpgroup's four warps, P through shared memory, running
// sums of the rounded P) and the 17-64-row families' on wgmma accumulator fragments (a row's
// base moves only when a block's max passes it by kMaxSlack; P as A fragments).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail {

// 2^x in one MUFU instruction (subnormal results flush to zero: softmax weights below 2^-126).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

namespace ops {

using rows16::kPElems;

// The max over the 4 warps' values of a row and the row's running max: the thread that writes
// a row's P and the thread that rescales its O compute it alike, so they agree exactly.
__device__ __forceinline__ float block_max(const float* red_row, float running) {
  const float4 m = *reinterpret_cast<const float4*>(red_row);
  return fmaxf(fmaxf(fmaxf(m.x, m.y), fmaxf(m.z, m.w)), running);
}

// O rows g + 8 h times the online softmax's alpha. The max rarely moves after the first blocks:
// the 16 multiplies are skipped when no row of the warp needs them.
__device__ __forceinline__ void rescale_rows(float (&o)[8][4], int h, float alpha) {
  if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      o[n][2 * h] *= alpha;
      o[n][2 * h + 1] *= alpha;
    }
  }
}

// A thread's S entries: tokens tok0 = 16 (warp % 4) + g and tok0 + 8 of the block, P rows
// pr = 8 wg + 2 tq and pr + 1, as (tok0, pr), (tok0, pr + 1), (tok0 + 8, pr), (tok0 + 8, pr + 1).

// The two warpgroups' partial products summed: rows0 / rows1 are this thread's entries of rows
// 2 tq (+ 1) and 8 + 2 tq (+ 1); warpgroup wg keeps rows 8 wg .. 8 wg + 7 and sends the others
// through xch ([warpgroup][thread] float4). One math_sync.
template <bool kProducer = false>
__device__ __forceinline__ void exchange_rows(const float (&rows0)[4], const float (&rows1)[4],
                                              int wg, float4* xch, float (&full)[4]) {
  // Selects, not an index by wg: a register array indexed at run time would live in local memory.
  float mine[4], theirs[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    mine[e] = wg == 0 ? rows0[e] : rows1[e];
    theirs[e] = wg == 0 ? rows1[e] : rows0[e];
  }
  xch[(1 - wg) * 128 + threadIdx.x % 128] = make_float4(theirs[0], theirs[1], theirs[2], theirs[3]);
  math_sync<kProducer>();
  const float4 recv = xch[wg * 128 + threadIdx.x % 128];
  full[0] = mine[0] + recv.x;
  full[1] = mine[1] + recv.y;
  full[2] = mine[2] + recv.z;
  full[3] = mine[3] + recv.w;
}

// A thread's online-softmax state in fp8_tma, bf16_tma and bf16_gather: the running maxima of its P
// rows pr, pr + 1 and of its O rows g, g + 8 (the same values: each side computes them alike, so no
// exchange), the P rows' running sums over its tokens only (summed over the warpgroup at the end,
// reduce_row_sums), and its O fragments (write_row's mapping).
struct RowState {
  float max_p[2] = {-INFINITY, -INFINITY}, max_o[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float o[8][4];
  __device__ RowState() {
#pragma unroll
    for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  }
};

// p rounded to P's type (fp16 for the fp8 kernel's P V, bf16 for the bf16 kernel's): its bits,
// and the value the tensor cores will multiply.
template <class PT>
__device__ __forceinline__ std::uint16_t p_bits(float p, float& rounded) {
  if constexpr (std::is_same_v<PT, __half>) {
    const __half h = __float2half_rn(p);
    rounded = __half2float(h);
    return __half_as_ushort(h);
  } else {
    const __nv_bfloat16 b = __float2bfloat16_rn(p);
    rounded = __bfloat162float(b);
    return __bfloat16_as_ushort(b);
  }
}

// One block's online softmax for a thread's S entries `full`: scores full * sc (sc: the rows'
// scales) masked past the tile's end (kv_end, tokens j0 + ..) and the causal limits, the rows'
// block maxima over the warpgroup's four warps (red_max[row][4]), P rows pr, pr + 1 into p_s,
// and st updated: maxima, running sums of P (a bf16 P: of the fp32 p), O's rows g, g + 8
// rescaled. Two math_syncs.
template <class PT, bool kProducer = false>
__device__ __forceinline__ void softmax_block(const float (&full)[4], const float (&sc)[2], int j0,
                                              int kv_end, const int (&limit_p)[2], int tok0, int pr,
                                              int g, int wr, float* red_max, std::uint16_t* p_s,
                                              RowState& st) {
  const int tok1 = tok0 + 8;
  float s[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int k = e % 2, tok = e < 2 ? tok0 : tok1;
    const bool ok = j0 + tok < kv_end && j0 + tok <= limit_p[k];
    s[e] = ok ? full[e] * sc[k] : -INFINITY;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float mx = fmaxf(s[k], s[2 + k]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    if (g == 0) red_max[(pr + k) * 4 + wr] = mx;
  }
  math_sync<kProducer>();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = pr + k;
    const float mx = block_max(red_max + r * 4, st.max_p[k]);
    const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
    const float alpha = fast_exp2(st.max_p[k] - base);
    st.max_p[k] = mx;
    const float p0 = fast_exp2(s[k] - base), p1 = fast_exp2(s[2 + k] - base);
    float pa, pb;
    p_s[r * kPElems + tok0] = p_bits<PT>(p0, pa);
    p_s[r * kPElems + tok1] = p_bits<PT>(p1, pb);
    // bf16 P: the fp32 p's sum (add_sums says why); fp16 P: the rounded p, as multiplied.
    st.row_sum[k] = st.row_sum[k] * alpha + (std::is_same_v<PT, __half> ? pa + pb : p0 + p1);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mx = block_max(red_max + (g + 8 * h) * 4, st.max_o[h]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    const float alpha = fast_exp2(st.max_o[h] - base);
    st.max_o[h] = mx;
    rescale_rows(st.o, h, alpha);
  }
  math_sync<kProducer>();
}

// The P rows' sums over the warpgroup into red_sum[row][4] (red_max's memory: a barrier first),
// then a barrier; row_total adds a row's four.
template <bool kProducer = false>
__device__ __forceinline__ void reduce_row_sums(const float (&row_sum)[2], int pr, int g, int wr,
                                                float* red_sum) {
  math_sync<kProducer>();  // red_max (same memory) is no longer read
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float sum = row_sum[k];
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    if (g == 0) red_sum[(pr + k) * 4 + wr] = sum;
  }
  math_sync<kProducer>();
}
__device__ __forceinline__ float row_total(const float* red_sum, int r) {
  const float4 l4 = *reinterpret_cast<const float4*>(red_sum + r * 4);
  return (l4.x + l4.y) + (l4.z + l4.w);
}

// ---- the 17-64-row families ----

// The running row max moves only when a block's max exceeds it by more than 2^8 (log2 units):
// p = 2^(s - m) then stays below 256 (16-bit P keeps its relative precision, fp32 sums have
// room), and the 128 rescaling multiplies per thread run only in the first blocks instead of in
// about half of them.
inline constexpr float kMaxSlack = 8.0f;

// ---- softmax pieces of wide_rows and bf16_wide_rows. Fragments: an m64nNk16
// accumulator's s[r] is row 16 warp + g + 8 ((r / 2) % 2), column 8 (r / 4) + 2 tq + r % 2 ----

// A row's base moves to a block's max m only when m exceeds it by more than kMaxSlack; p is
// then at most 2^8. factor: from the old base to the new (0 when a row first sees a token);
// rows with nothing visible yet keep base -inf and take p's offset 0.
__device__ __forceinline__ float new_base(float old, float m) {
  return m > old + kMaxSlack ? m : old;
}
__device__ __forceinline__ float factor(float from, float to) {
  return from == to ? 1.0f : fast_exp2(from - to);
}

// S's columns (tokens j0 + column) masked to -inf where flagged absent (fl[column] == 0) or past
// a row's limit, unless `visible` holds for the whole warp; mx: the rows' maxima (over the quad).
template <int kS>
__device__ __forceinline__ void mask_and_max(float (&s)[kS], float (&mx)[2], bool visible,
                                             const std::uint8_t* fl, int j0,
                                             const int (&limit)[2]) {
  const int tq = threadIdx.x % 4;
  if (!__all_sync(0xffffffffu, visible)) {
#pragma unroll
    for (int r = 0; r < kS; ++r) {
      const int h = (r / 2) % 2, col = 8 * (r / 4) + 2 * tq + r % 2;
      if (fl[col] == 0 || j0 + col > limit[h]) s[r] = -INFINITY;
    }
  }
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int r = 0; r < kS; ++r) mx[(r / 2) % 2] = fmaxf(mx[(r / 2) % 2], s[r]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
}

// P (fp16 or bf16, the tile's type) = 2^(s sc - pbase) as wgmma A fragments, which are the S
// accumulator's layout: k-step kk holds columns 16 kk + [0, 16), pa[j] rows g + 8 (j % 2),
// columns + 2 tq + 8 (j / 2). A rounded product, never fused with the subtraction: the row max
// is the rounded product of the max score, so the max gives 2^0 exactly (an FMA would expose
// the product's rounding error, 2^52 in absolute terms for a row scaled by 2^60).
// psum[h] += the fp32 p of row h's columns, before their rounding (see add_sums).
template <bool kBf16, int kS>
__device__ __forceinline__ void p_frags(std::uint32_t (&pa)[4], const float (&s)[kS], int kk,
                                        const float (&sc)[2], const float (&pbase)[2],
                                        float (&psum)[2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 8 * kk + 2 * j, h = j % 2;
    const float p0 = fast_exp2(__fmul_rn(s[r], sc[h]) - pbase[h]);
    const float p1 = fast_exp2(__fmul_rn(s[r + 1], sc[h]) - pbase[h]);
    psum[h] += p0 + p1;
    pa[j] = kBf16 ? float2_to_bf16x2(p0, p1) : float2_to_half2(p0, p1);
  }
}

// Row sums of p (the S accumulator's layout: s[r] is row (r / 2) % 2) in fp32, before P's
// rounding for the tensor cores, as FlashAttention sums them: the LSE keeps fp32's accuracy. Sums
// of the rounded P made o / l the exact normalization of what was multiplied, but a bf16 P's
// rounding (2^-9) moved the LSE of a row of few tokens by ~2e-3 (FlashInfer's tests bound it at
// 1e-3); o / l now differs from that normalization by the rounding averaged over the row's
// tokens, below the bf16 output's own rounding.
template <int kS>
__device__ __forceinline__ void add_sums(float (&row_sum)[2], const float (&p)[kS]) {
#pragma unroll
  for (int r = 0; r < kS; ++r) row_sum[(r / 2) % 2] += p[r];
}

// A thread's partial row sum (its columns of a row) summed over its quad: the whole row's.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// O (4 panels of 64 dims) times f per row; only when a row of the warp has f != 1.
__device__ __forceinline__ void rescale_o(float (&o)[4][32], const float (&f)[2]) {
  if (__any_sync(0xffffffffu, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int r = 0; r < 32; ++r) o[c][r] *= f[(r / 2) % 2];
  }
}

}  // namespace ops

}  // namespace fp8mla::detail
