// The bf16 decode kernel for tiles of <= 16 rows on pages of >= 8 tokens (dense page tables): the
// structure of the fp8 TMA kernel (decode_fp8_tma_kernel.cuh) on bf16 bytes, tiles loaded the way
// FlashMLA's bf16 kernel loads them. The shared-tile kernel (decode_kernel.cuh), which keeps bf16
// pages of < 8 tokens and sparse lists, copies tokens one by one into padded rows; its copies
// alone took FlashMLA's whole time at 128/16/8192 (bench/NOTES.md v36, v38). Per block:
//   * the TMA engine copies each page run of the block (min(page_size, 64) tokens) as nine
//     128-byte-swizzled slabs of 64 dims (ckv: slabs 0-7, kpe: slab 8): a 72 KB stage, two
//     stages, one CTA per SM;
//   * S^T = K Q^T on bf16 wgmma (m64n16k16; K the stage's slabs, Q^T the q rows in the same
//     layout): warpgroup w multiplies ckv slabs 4w .. 4w + 3 and kpe k-steps 2w, 2w + 1, and the
//     sums meet through a 4 KB exchange; each thread finishes 2 tokens x 2 rows as in the fp8 TMA
//     kernel;
//   * the fp8 TMA kernel's online softmax, with P as bf16 in shared memory;
//   * O += P V on mma.sync (m16n8k16, bf16): warp w owns output columns [64 w, 64 w + 64), which
//     are ckv slab w; V's B fragments come by ldmatrix.trans from the swizzled slab.
// Tokens past the tile's end inside a copied page run are zeroed before P V reads them (P is 0
// there, but 0 * NaN would not be).
#pragma once

#include <cstdint>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_fp8_kernel.cuh"
#include "src/cuda/decode_fp8_tma_kernel.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace bf16tma {

using fp8frag::kBlockN;
using fp8frag::kRows;
using fp8frag::kThreads;
using fp8frag::kWarps;
inline constexpr int kStages = 2;
inline constexpr int kSlab = kBlockN * 128;    // 64 dims (128 bytes) of a block's tokens
inline constexpr int kStageBytes = 9 * kSlab;  // ckv slabs 0-7, kpe slab 8
inline constexpr int kQSlab = kRows * 128;     // 64 dims of the q rows
inline constexpr int kPElems = kBlockN + 8;    // bf16 P row pitch: ldmatrix conflict-free
// Offsets from the 1024-byte-aligned base (swizzle atoms).
inline constexpr int kKv = 0;
inline constexpr int kQ = kKv + kStages * kStageBytes;
inline constexpr int kP = kQ + 9 * kQSlab;
inline constexpr int kXch = kP + kRows * kPElems * 2;  // [warpgroup][thread] float4
inline constexpr int kRed = kXch + 2 * 128 * 16;       // [row][warp of its warpgroup] float
inline constexpr int kBar = kRed + kRows * 4 * 4;
inline constexpr int kEmpty = kBar + kStages * 8;  // [stage] "released": every warp is done
inline constexpr int kSmemBytes = kEmpty + kStages * 8 + 1024;  // + the alignment of the base
static_assert(kSmemBytes <= 227 * 1024, "one CTA fits an SM");
static_assert(kQ % 1024 == 0 && kStageBytes % 1024 == 0 && kQSlab % 1024 == 0,
              "swizzle atoms stay aligned");

// This warpgroup's 18 k-steps of S^T = K Q^T into d (m64n16 accumulators): ckv slabs 4w ..
// 4w + 3 (16 steps of 32 bytes) and kpe steps 2w, 2w + 1, on descriptors offset per warpgroup
// (one code path: a branch per warpgroup would serialize the wgmma). bf16 products are exact in
// fp32, so one chain loses nothing that the fp8 kernel's three chains guard against.
__device__ __forceinline__ void s_product(float (&d)[8], std::uint64_t a_ckv, std::uint64_t a_pe,
                                          std::uint64_t b_ckv, std::uint64_t b_pe) {
#pragma unroll
  for (int i = 0; i < 16; ++i)
    wgmma_64x16x16_bf16(d, desc_add(a_ckv, i / 4 * kSlab + i % 4 * 32),
                        desc_add(b_ckv, i / 4 * kQSlab + i % 4 * 32), i > 0);
#pragma unroll
  for (int i = 0; i < 2; ++i)
    wgmma_64x16x16_bf16(d, desc_add(a_pe, 32 * i), desc_add(b_pe, 32 * i), 1);
}

// Byte offset of q row n (0..15), 8-dim chunk c (0..71) in the Q operand.
__device__ __forceinline__ int q_offset(int n, int c) {
  return kQ + c / 8 * kQSlab + n / 8 * 1024 + sw128(n % 8, c % 8 * 16);
}

}  // namespace bf16tma

__global__ void __launch_bounds__(bf16tma::kThreads, 1)
    mla_decode_bf16_tma_kernel(const __grid_constant__ DecodeParams p) {
  using namespace bf16tma;
  using fp8tma::block_max;
  DeviceTile tile;
  if (!decode::load_tile(p, tile)) return;
  std::uint8_t* smem = dynamic_smem_1k();
  const WorkTile t = tile.tile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  // The warpgroup from lane 0's shuffle: warp-uniform to ptxas, so the descriptors stay uniform.
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0), wr = warp % 4;
  const int rows = t.q_count * t.head_count;
  const int q_first = tile.q_first;
  const int qo_len = tile.qo_len;
  const int kv_len = tile.kv_len;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  // ---- copies: lane i of warp 0 copies the block's page run i (np runs of `run` tokens) ----
  const int run = min(1 << p.page_shift, kBlockN);
  const int np = kBlockN / run;
  const bool copier = warp == 0 && lane < np;
  const std::int32_t kv_base = tile.kv_base;
  auto run_first = [&](int blk) { return t.kv_begin + blk * kBlockN + lane * run; };
  auto entry_of = [&](int blk) {  // loaded a block before its copies are issued
    const int j = run_first(blk);
    return j < t.kv_end ? p.kv_indices[kv_base + (j >> p.page_shift)] : 0;
  };
  auto issue = [&](int blk, std::int32_t page, int stage) {
    const int j = run_first(blk);
    void* bar = smem + kBar + 8 * stage;
    if (j < t.kv_end) {
      mbar_arrive_expect_tx(bar, run * 1152);
      const int y = j & ((1 << p.page_shift) - 1);
      std::uint8_t* dst = smem + kKv + stage * kStageBytes + lane * run * 128;
#pragma unroll
      for (int c = 0; c < 8; ++c) tma_load_3d(dst + c * kSlab, &p.ckv_map, 128 * c, y, page, bar);
      tma_load_3d(dst + 8 * kSlab, &p.kpe_map, 0, y, page, bar);
    } else {
      mbar_arrive(bar);
    }
  };
  std::int32_t entry0 = 0, next_entry = 0;
  if (copier) {
    entry0 = entry_of(0);
    next_entry = entry_of(1);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(smem + kBar + 8 * s, np);
    for (int s = 0; s < kStages; ++s) mbar_init(smem + kEmpty + 8 * s, kWarps);
    fence_mbar_init();
  }
  // The tile and page-table entries above are the plan's; q and the cache may come from the
  // kernel before.
  decode::begin_after_previous_kernel();

  // ---- Q: 16 threads a row read it (4.5 16-byte chunks each) into the B operand ----
  {
    const int q_r = threadIdx.x / 16, q_part = threadIdx.x % 16;
    uint4 q_v[5];
    fp8frag::load_q_chunks(p, t, q_first, rows, q_r, q_part, q_v);
#pragma unroll
    for (int i = 0; i < 5; ++i) {
      const int c = q_part + 16 * i;
      if (c < 72) *reinterpret_cast<uint4*>(smem + q_offset(q_r, c)) = q_v[i];
    }
    fence_proxy_async();  // the generic stores above, read by wgmma (async proxy)
  }
  __syncthreads();
  if (copier && n_blocks > 0) issue(0, entry0, 0);

  // This thread's S entries: tokens tok0, tok1 of the block, rows pr, pr + 1 (its P rows).
  const int tok0 = 16 * wr + g, tok1 = tok0 + 8;
  const int pr = 8 * wg + 2 * tq;
  const int limit_p[2] = {decode::row_limit(p, t, pr, kv_len, qo_len),
                          decode::row_limit(p, t, pr + 1, kv_len, qo_len)};
  // Running maxima: of the P rows pr, pr + 1 and of the O rows g, g + 8 (the same values).
  float max_p[2] = {-INFINITY, -INFINITY}, max_o[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // rows pr, pr + 1, this thread's tokens only
  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + kP);
  float* red_max = reinterpret_cast<float*>(smem + kRed);
  float4* xch = reinterpret_cast<float4*>(smem + kXch);
  const std::uint64_t a_ckv = wgmma_desc<128>(smem + kKv + 4 * wg * kSlab, 16, 1024);
  const std::uint64_t a_pe = wgmma_desc<128>(smem + kKv + 8 * kSlab + 64 * wg, 16, 1024);
  const std::uint64_t b_ckv = wgmma_desc<128>(smem + kQ + 4 * wg * kQSlab, 16, 1024);
  const std::uint64_t b_pe = wgmma_desc<128>(smem + kQ + 8 * kQSlab + 64 * wg, 16, 1024);
  // V reads (ldmatrix.trans): lane l gives token row v_tok of ckv slab `warp`, 16-byte unit
  // 2 np + l / 16 (dims 16 np + 8 (l / 16) ..), stored at unit ^ (v_tok % 8).
  const int v_row = lane % 8 + (lane / 8) % 2 * 8, v_unit = lane / 16;

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % kStages;
    // Block blk + 1 goes into block blk - 1's stage once every warp has released it.
    if (copier && blk + 1 < n_blocks && blk >= 1)
      mbar_wait(smem + kEmpty + 8 * ((blk + 1) % kStages), ((blk - 1) / kStages) % 2);
    if (copier && blk + 1 < n_blocks) {
      issue(blk + 1, next_entry, (blk + 1) % kStages);
      next_entry = entry_of(blk + 2);
    }
    mbar_wait(smem + kBar + 8 * stage, (blk / kStages) % 2);  // block blk landed
    std::uint8_t* kv = smem + kKv + stage * kStageBytes;

    // ---- S^T = K Q^T: this warpgroup's 18 k-steps ----
    float d[8];
    wgmma_fence();
    const std::uint32_t so = stage * kStageBytes;
    s_product(d, desc_add(a_ckv, so), desc_add(a_pe, so), b_ckv, b_pe);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(d);
    // d[4 i + e]: rows 8 i + 2 tq (+ 1), entries (tok0, r), (tok0, r + 1), (tok1, r), (tok1, r +
    // 1). Selects, not an index by wg: a register array indexed at run time would live in local
    // memory.
    float mine[4], theirs[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      mine[e] = wg == 0 ? d[e] : d[4 + e];
      theirs[e] = wg == 0 ? d[4 + e] : d[e];
    }
    xch[(1 - wg) * 128 + threadIdx.x % 128] =
        make_float4(theirs[0], theirs[1], theirs[2], theirs[3]);
    __syncthreads();
    const float4 recv = xch[wg * 128 + threadIdx.x % 128];
    const float full[4] = {mine[0] + recv.x, mine[1] + recv.y, mine[2] + recv.z, mine[3] + recv.w};

    // Rows past the tile's end: zeros in the ckv slabs, so that P V (P = 0 there) reads finite
    // values. S is done with the stage (both warpgroups waited on their products above).
    const int j0 = t.kv_begin + blk * kBlockN;
    const int n_valid = min(kBlockN, t.kv_end - j0);
    if (n_valid < kBlockN) {
      for (int i = threadIdx.x; i < (kBlockN - n_valid) * 64; i += kThreads) {
        const int row = n_valid + i / 64;
        *reinterpret_cast<uint4*>(kv + (i / 8 % 8) * kSlab + row * 128 + i % 8 * 16) =
            make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async();  // before a later block's TMA copies into these bytes
    }

    // ---- scores, masks, row max over the block ----
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = e % 2, tok = e < 2 ? tok0 : tok1;
      const bool ok = j0 + tok < t.kv_end && j0 + tok <= limit_p[k];
      s[e] = ok ? full[e] * p.scale_nope : -INFINITY;
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float mx = fmaxf(s[k], s[2 + k]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      if (g == 0) red_max[(pr + k) * 4 + wr] = mx;
    }
    __syncthreads();

    // ---- online softmax: P rows pr, pr + 1 into shared memory; O rows g, g + 8 rescaled ----
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = pr + k;
      const float mx = block_max(red_max + r * 4, max_p[k]);
      const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
      const float alpha = fast_exp2(max_p[k] - base);
      max_p[k] = mx;
      const __nv_bfloat16 pa = __float2bfloat16_rn(fast_exp2(s[k] - base));
      const __nv_bfloat16 pb = __float2bfloat16_rn(fast_exp2(s[2 + k] - base));
      p_s[r * kPElems + tok0] = __bfloat16_as_ushort(pa);
      p_s[r * kPElems + tok1] = __bfloat16_as_ushort(pb);
      // Sum what the tensor cores multiply (the rounded p), so o / l stays exact.
      row_sum[k] = row_sum[k] * alpha + (__bfloat162float(pa) + __bfloat162float(pb));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float mx = block_max(red_max + (g + 8 * h) * 4, max_o[h]);
      const float base = mx == -INFINITY ? 0.0f : mx;
      const float alpha = fast_exp2(max_o[h] - base);
      max_o[h] = mx;
      fp8frag::rescale_rows(o, h, alpha);
    }
    __syncthreads();

    // ---- O += P V: the warp's columns 64 warp + [0, 64), n-tile n = columns 8 n .. 8 n + 7 ----
    const std::uint8_t* v_slab = kv + warp * kSlab;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      const int v_tok = 16 * kk + v_row;
#pragma unroll
      for (int np2 = 0; np2 < 4; ++np2) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, v_slab + v_tok * 128 + (((2 * np2 + v_unit) ^ (v_tok % 8)) << 4));
        mma_16816<true>(o[2 * np2], a, b[0], b[1]);
        mma_16816<true>(o[2 * np2 + 1], a, b[2], b[3]);
      }
    }
    __syncwarp();  // the warp's reads of the stage are done: release it
    if (lane == 0) mbar_arrive(smem + kEmpty + 8 * stage);
  }

  // ---- epilogue: row sums over the warpgroup, then o / l and lse ----
  float* red_sum = reinterpret_cast<float*>(smem + kRed);
  __syncthreads();  // red_max (same memory) is no longer read
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float sum = row_sum[k];
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    if (g == 0) red_sum[(pr + k) * 4 + wr] = sum;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= rows) continue;
    const float4 l4 = *reinterpret_cast<const float4*>(red_sum + r * 4);
    const decode::RowEnd end =
        decode::finish_row(max_o[h], (l4.x + l4.y) + (l4.z + l4.w), p.out_scale);
    const int tr = r / t.head_count;
    const std::int64_t head = t.head_begin + r % t.head_count;
    const std::int64_t token = q_first + tr;
    const int col0 = 64 * warp + 2 * tq;  // n-tile n: columns col0 + 8 n, + 1
    if (t.split < 0) {
      __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col0;
#pragma unroll
      for (int n = 0; n < 8; ++n)
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) =
            __floats2bfloat162_rn(o[n][2 * h] * end.inv, o[n][2 * h + 1] * end.inv);
      if (p.lse != nullptr && warp == 0 && tq == 0)
        p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = end.lse;
    } else {
      const std::int64_t prow = decode::partial_row(p, t, qo_len, tr, head);
      float* dst = p.partial_o + prow * 512 + col0;
#pragma unroll
      for (int n = 0; n < 8; ++n)
        *reinterpret_cast<float2*>(dst + 8 * n) =
            make_float2(o[n][2 * h] * end.inv, o[n][2 * h + 1] * end.inv);
      if (warp == 0 && tq == 0) p.partial_lse[prow] = end.lse;
    }
  }
}

}  // namespace fp8mla::detail
