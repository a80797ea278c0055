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
using fp8frag::kPElems;  // P's row pitch (here bf16): ldmatrix conflict-free
using fp8frag::kRows;
using fp8frag::kThreads;
using fp8frag::kWarps;
inline constexpr int kStages = 2;
using fp8tma::kSlab;                           // 64 dims (128 bytes) of a block's tokens
inline constexpr int kStageBytes = 9 * kSlab;  // ckv slabs 0-7, kpe slab 8
inline constexpr int kQSlab = kRows * 128;     // 64 dims of the q rows
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

  // ---- copies (fp8tma::PageRunCopier): page runs as eight ckv slabs and a kpe slab ----
  const fp8tma::PageRunCopier<8, 128> runs(p, tile, warp, lane);
  const bool copier = runs.copier;
  std::int32_t entry0 = 0, next_entry = 0;
  static_assert(kStages == 2, "PageRunCopier::start sets up two stages");
  runs.start(p, smem + kBar, smem + kEmpty, entry0, next_entry);

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
  if (copier && n_blocks > 0) runs.issue(p, 0, entry0, smem + kKv, smem + kBar);

  // This thread's S entries: tokens tok0, tok0 + 8 of the block, rows pr, pr + 1 (its P rows).
  const int tok0 = 16 * wr + g;
  const int pr = 8 * wg + 2 * tq;
  const int limit_p[2] = {decode::row_limit(p, t, pr, kv_len, qo_len),
                          decode::row_limit(p, t, pr + 1, kv_len, qo_len)};
  const float sc[2] = {p.scale_nope, p.scale_nope};  // bf16: one scale for every product
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
      const int next = (blk + 1) % kStages;
      runs.issue(p, blk + 1, next_entry, smem + kKv + next * kStageBytes, smem + kBar + 8 * next);
      next_entry = runs.entry(p, blk + 2);
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
    // d[4 i + e]: rows 8 i + 2 tq (+ 1) of tokens tok0, tok0 + 8 (fp8tma::exchange_rows's order)
    const float rows0[4] = {d[0], d[1], d[2], d[3]}, rows1[4] = {d[4], d[5], d[6], d[7]};
    float full[4];
    fp8tma::exchange_rows(rows0, rows1, wg, xch, full);
    const int j0 = t.kv_begin + blk * kBlockN;
    const int n_valid = min(kBlockN, t.kv_end - j0);
    if (n_valid < kBlockN) fp8tma::zero_rows_past<8>(kv, n_valid);

    // ---- scores, masks, block row max, online softmax: P rows pr, pr + 1; O rows g, g + 8 ----
    fp8tma::softmax_block<__nv_bfloat16>(full, sc, j0, t.kv_end, limit_p, tok0, pr, g, wr, red_max,
                                         p_s, max_p, max_o, row_sum, o);

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
  fp8tma::reduce_row_sums(row_sum, pr, g, wr, red_sum);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= rows) continue;
    const decode::RowEnd end =
        decode::finish_row(max_o[h], fp8tma::row_total(red_sum, r), p.out_scale);
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
