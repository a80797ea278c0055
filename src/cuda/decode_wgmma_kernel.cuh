// The pieces the 17-64-row wgmma decode kernel (decode_wgmma_ws_kernel.cuh) is built from: Q's
// load into swizzled panels, the online softmax on wgmma accumulator fragments (masks, row
// maxima, P as A fragments, row sums, O's rescale) and the epilogue. A tile is 64 query rows
// (heads x query tokens; 128-head models run two tiles per request) in two consumer warpgroups
// of a CTA (a third fetches the cache); warpgroup g owns output dims [256 g, 256 g + 256) (128
// fp32 accumulators per thread). mma.sync reached 19% of the matmul ceiling on these tiles with
// 8 warps per SM (bench/NOTES.md v7); wgmma reads its operands from shared memory without
// per-thread fragment loads.
#pragma once

#include <cstdint>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace wg {

inline constexpr int kThreads = 256;
inline constexpr int kRows = 64;
inline constexpr int kQPanel = kRows * 128;  // 64 q rows x 64 16-bit dims, swizzled
inline constexpr int kConsumerBarrier = 1;   // threads 0-255, named barrier 1

// Q rows into the nine swizzled panels at L::kQ (zero rows past the tile). fp8 caches: fp16,
// each row scaled by 2^e (decode::q_row_exponent over its nope values and its ratio-scaled rope
// values), L::kQInv = 2^-e; bf16 caches (L::kBf16): bf16 as given, kQInv = 1. L::kQAmax: 64
// words of scratch; L::kQGroup: chunks a thread loads at once. Run by the two consumer warpgroups
// (threads 0-255) alone: their barriers are named barrier 1 (kConsumerBarrier), and it ends with
// one.
template <class L>
__device__ __forceinline__ void load_q(const DecodeParams& p, const WorkTile& t, int q_first,
                                       float ratio, std::uint8_t* smem) {
  const int rows = t.q_count * t.head_count;
  auto q_chunk = [&](int r, int c) {  // 8 bf16 values of row r, chunk c of 72
    if (r >= rows) return make_uint4(0, 0, 0, 0);
    const std::int64_t tok = q_first + r / t.head_count, h = t.head_begin + r % t.head_count;
    const __nv_bfloat16* src =
        c < 64 ? p.q_nope + tok * p.q_nope_stride[0] + h * p.q_nope_stride[1] + 8 * c
               : p.q_pe + tok * p.q_pe_stride[0] + h * p.q_pe_stride[1] + 8 * (c - 64);
    return *reinterpret_cast<const uint4*>(src);
  };
  std::uint32_t* amax = reinterpret_cast<std::uint32_t*>(smem + L::kQAmax);
  float* inv = reinterpret_cast<float*>(smem + L::kQInv);
  auto chunk_at = [&](int r, int c) {
    return reinterpret_cast<uint4*>(smem + L::kQ + (c / 8) * kQPanel + sw128(r, 16 * (c % 8)));
  };
  // A thread's 18 chunks in groups of L::kQGroup, each group's loads issued before its stores: a
  // store between two loads (generic pointers, which may alias for all the compiler knows) kept
  // every load behind the previous store, one memory round trip a chunk (bench/NOTES.md v54).
  // The warp-specialized kernel loads 6 at a time: all 18 in flight delay its producer's first
  // block (fp8: all 18 up to 5% slower than one at a time, 6 up to 17% faster; v58-v61).
  constexpr int kPer = kRows * 72 / kThreads;
  constexpr int kGroup = L::kQGroup;
  static_assert(kPer * kThreads == kRows * 72 && kPer % kGroup == 0, "whole chunks a thread");
  if constexpr (!L::kBf16) {
    if (threadIdx.x < kRows) amax[threadIdx.x] = 0;
    named_barrier_sync(kConsumerBarrier, kThreads);
  }
#pragma unroll 1
  for (int k0 = 0; k0 < kPer; k0 += kGroup) {
    uint4 v[kGroup];
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int i = static_cast<int>(threadIdx.x) + (k0 + k) * kThreads;
      v[k] = q_chunk(i / 72, i % 72);
    }
#pragma unroll
    for (int k = 0; k < kGroup; ++k) {
      const int i = static_cast<int>(threadIdx.x) + (k0 + k) * kThreads, r = i / 72, c = i % 72;
      if constexpr (L::kBf16) {
        if (c == 0) inv[r] = 1.0f;
      } else if (r < rows) {
        float m = __uint_as_float(decode::abs_max_bits(v[k]));
        if (c >= 64) m *= ratio;
        atomicMax(&amax[r], __float_as_uint(m));  // non-negative floats order as their bits
      }
      *chunk_at(r, c) = v[k];  // fp8: bf16 as given, scaled in place below
    }
  }
  if constexpr (!L::kBf16) {
    named_barrier_sync(kConsumerBarrier, kThreads);  // every row's max
#pragma unroll 6
    for (int k = 0; k < kPer; ++k) {  // the chunks this thread stored itself
      const int i = static_cast<int>(threadIdx.x) + k * kThreads, r = i / 72, c = i % 72;
      const int e = decode::q_row_exponent(__uint_as_float(amax[r]));
      const float scale = c < 64 ? ldexpf(1.0f, e) : ldexpf(ratio, e);
      if (c == 0) inv[r] = ldexpf(1.0f, -e);
      const uint4 v = *chunk_at(r, c);
      *chunk_at(r, c) =
          make_uint4(decode::scale_to_half2(v.x, scale), decode::scale_to_half2(v.y, scale),
                     decode::scale_to_half2(v.z, scale), decode::scale_to_half2(v.w, scale));
    }
  }
  fence_proxy_async();
  named_barrier_sync(kConsumerBarrier, kThreads);
}

// The running row max moves only when a block's max exceeds it by more than 2^8 (log2 units):
// p = 2^(s - m) then stays below 256 (16-bit P keeps its relative precision, fp32 sums have
// room), and the 128 rescaling multiplies per thread run only in the first blocks instead of in
// about half of them.
inline constexpr float kMaxSlack = 8.0f;

// ---- softmax and output pieces shared by the wgmma kernels. Fragments: an m64nNk16
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
template <bool kBf16, int kS>
__device__ __forceinline__ void p_frags(std::uint32_t (&pa)[4], const float (&s)[kS], int kk,
                                        const float (&sc)[2], const float (&pbase)[2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 8 * kk + 2 * j, h = j % 2;
    const float p0 = fast_exp2(__fmul_rn(s[r], sc[h]) - pbase[h]);
    const float p1 = fast_exp2(__fmul_rn(s[r + 1], sc[h]) - pbase[h]);
    pa[j] = kBf16 ? float2_to_bf16x2(p0, p1) : float2_to_half2(p0, p1);
  }
}

// Row sums of what the tensor cores multiply (the rounded p), so o / l is exact.
template <bool kBf16>
__device__ __forceinline__ void add_sums(float (&row_sum)[2], const std::uint32_t (&pa)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f =
        kBf16 ? bf16x2_to_float2(pa[j]) : __half22float2(*reinterpret_cast<const __half2*>(&pa[j]));
    row_sum[j % 2] += f.x + f.y;
  }
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

// The warpgroup index broadcast from lane 0, so ptxas knows it is uniform and keeps the wgmma
// descriptors in uniform registers (v8's first build moved each one with R2UR: 10% of all
// instructions).
__device__ __forceinline__ int uniform_warpgroup() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
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
    limit[h] = r < rows ? decode::row_limit(p, tile.tile, r, tile.kv_len, tile.qo_len) : INT32_MAX;
    sc[h] = p.scale_nope * qinv[r];
  }
}

// Epilogue: this thread's rows 16 warp + g + 8 h of O (output dims 256 group + 64 c + 8 n +
// 2 tq, + 1) divided by the row sums l (whole rows), with max m: bf16 out (+ lse), or the fp32
// partial row of a split.
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
    const decode::RowEnd end = decode::finish_row(m[h], l[h], p.out_scale);
    const int tr = r / t.head_count;
    const std::int64_t head = t.head_begin + r % t.head_count;
    const std::int64_t token = tile.q_first + tr;
    const int col0 = 256 * group + 2 * tq;  // + 64 c + 8 n
    if (t.split < 0) {
      __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col0;
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int n = 0; n < 8; ++n)
          *reinterpret_cast<__nv_bfloat162*>(dst + 64 * c + 8 * n) = __floats2bfloat162_rn(
              o[c][4 * n + 2 * h] * end.inv, o[c][4 * n + 2 * h + 1] * end.inv);
      if (p.lse != nullptr && group == 0 && tq == 0)
        p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = end.lse;
    } else {
      const std::int64_t prow = decode::partial_row(p, t, tile.qo_len, tr, head);
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

}  // namespace wg

}  // namespace fp8mla::detail
