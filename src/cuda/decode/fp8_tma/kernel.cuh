// fp8_tma: fp8_e4m3 tiles of <= 16 rows on dense page tables with pages of >= 8 tokens, fast
// scores and a power-of-two kpe_scale / ckv_scale (src/core/dispatch.h). One CTA (8 warps) per
// WorkTile, two CTAs per SM.
//
// One idea: S on fp8 tensor cores with the cache bytes as they are. wgmma multiplies e4m3 by e4m3
// when both operands are K-major, and S^T = K Q^T has both K-major as stored: A = the block's 64
// tokens (tensor-map boxes of each page run, 128-byte swizzled ckv slabs and a 64-byte swizzled
// kpe slab: wgmma's operand layout), B = Q^T as two e4m3 terms a row (ops::store_q_terms: exact
// for every element above 2^-6 of the row's max; q_pe carries the power-of-two ratio exactly).
// Warpgroup w multiplies 9 of the 18 k-steps in kChains chains (Hopper's fp8 accumulator keeps
// 13 mantissa bits, truncating, so short chains summed in fp32 bound the error); the sums meet
// through a 4 KB exchange. Softmax and O += P V as fp8_exact's (P fp16, V's codes converted into
// mma.sync fragments), V read from the swizzled slabs. Tokens past the tile's end inside a copied
// page run are zeroed before P V reads them: P is 0 there, but 0 * NaN would not be.
#pragma once

#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/epilogue.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/q.cuh"
#include "src/cuda/ops/softmax.cuh"
#include "src/cuda/ops/stage_copy.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::fp8_tma {

// The shared tile operations (src/cuda/ops).
using namespace ops;

// The <= 16-row CTA (8 warps, 64-token blocks, 16 rows, two stages) and P pitch.
using rows16::kBlockN;
using rows16::kPElems;
using rows16::kRows;
using rows16::kSlab;  // 128 ckv dims of a block (128-byte swizzle)
using rows16::kStages;
using rows16::kThreads;
using rows16::kWarps;
inline constexpr int kRopeSlab = kBlockN * 64;  // its 64 rope dims (64-byte swizzle)
inline constexpr int kStageBytes = 4 * kSlab + kRopeSlab;
// Offsets from the 1024-byte-aligned base (swizzle atoms).
inline constexpr int kKv = 0;
inline constexpr int kQ = kKv + kStages * kStageBytes;
inline constexpr int kP = kQ + kQBytes;
inline constexpr int kXch = kP + kRows * kPElems * 2;  // [warpgroup][thread] float4
inline constexpr int kRed = kXch + 2 * 128 * 16;       // [row][warp of its warpgroup] float
inline constexpr int kScale = kRed + kRows * 4 * 4;    // [row] scale_nope * 2^-e
inline constexpr int kBar = kScale + kRows * 4;
inline constexpr int kEmpty = kBar + kStages * 8;  // [stage] "released": every warp is done
inline constexpr int kSmemBytes = kEmpty + kStages * 8 + 1024;  // + the alignment of the base
inline constexpr int kMinBlocks = 2;
static_assert(kMinBlocks * (kSmemBytes + 1024) + ops::kMergeCtaSmem <= 228 * 1024,
              "two CTAs and a merge CTA must fit an SM");
static_assert(kQ % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms stay aligned");

// This warpgroup's 9 k-steps of S^T = K Q^T into d[c] (m64n32 accumulators): warpgroup w takes
// ckv slabs 2 w and 2 w + 1 (8 steps) and rope step w, so both run the same code on offset
// descriptors (a branch per warpgroup made ptxas serialize the wgmma). a_* / b_*: the
// descriptors of the stage's and Q's slab 2 w and rope step w.
// Hopper's fp8 MMA keeps its accumulator to 13 mantissa bits, truncating (SageAttention2,
// DeepSeek-V3 report), so one chain of 9 steps loses ~2e-4 of a score's magnitude: steps go to
// kChains chains of 3 (step i to chain i / 3), summed in fp32 (docs/design/fp8_tma.md has the
// error figures); 4 chains need more than the 112 registers this kernel may use
// (ops::kMaxRegsTwoCtas), and 9 make ptxas serialize the wgmma.
inline constexpr int kChains = 3;
__device__ __forceinline__ void s_product(float (&d)[kChains][16], std::uint64_t a_ckv,
                                          std::uint64_t a_pe, std::uint64_t b_ckv,
                                          std::uint64_t b_pe) {
  static_assert(9 % kChains == 0, "equal chains");
#pragma unroll
  for (int i = 0; i < 8; ++i)
    wgmma_64x32x32_e4m3(d[i / (9 / kChains)], desc_add(a_ckv, i / 4 * kSlab + i % 4 * 32),
                        desc_add(b_ckv, i / 4 * kQSlab + i % 4 * 32), i % (9 / kChains) > 0);
  wgmma_64x32x32_e4m3(d[kChains - 1], a_pe, b_pe, 8 % (9 / kChains) > 0);
}

__global__ void __maxnreg__(ops::kMaxRegsTwoCtas)
    fp8_tma_kernel(const __grid_constant__ DecodeParams p) {
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  // Swizzle atoms need a 1024-byte aligned base; offsetting smem_raw (not rounding a cast
  // integer) keeps the pointer visibly in shared memory, so accesses stay LDS / STS. Written
  // here rather than as dynamic_smem_1k(): with that helper ptxas spills 4 bytes in this kernel
  // (nvcc 13.0, at its 112-register cap).
  std::uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  const WorkTile t = tile.tile;
  const auto [warp, lane, g, tq, wg, wr] = ops::thread_roles();
  const int rows = t.q_count * t.head_count;
  const int q_first = tile.q_first;
  const int qo_len = tile.qo_len;
  const int kv_len = tile.kv_len;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  // ---- copies (PageRunCopier): page runs as four ckv slabs and a 64-byte kpe slab ----
  const PageRunCopier<4, 64> runs(p, tile, warp, lane);
  const bool copier = runs.copier;
  std::int32_t entry0 = 0, next_entry = 0;
  static_assert(kStages == 2, "PageRunCopier::start sets up two stages");
  runs.start(p, smem + kBar, smem + kEmpty, entry0, next_entry);

  // ---- Q: 16 threads a row read it (4.5 16-byte chunks each), find the row's exponent, and
  // write its hi and lo codes into the B operand ----
  const int q_r = threadIdx.x / 16, q_part = threadIdx.x % 16;
  uint4 q_v[5];
  ops::load_q_chunks(p, t, q_first, rows, q_r, q_part, q_v);
  __syncthreads();
  if (copier && n_blocks > 0) runs.issue(p, 0, entry0, smem + kKv, smem + kBar);
  store_q_terms<kQ>(p, q_v, q_r, q_part, smem, reinterpret_cast<float*>(smem + kScale));
  __syncthreads();

  // This thread's S entries: tokens tok0, tok0 + 8 of the block, rows pr, pr + 1 (its P rows).
  const int tok0 = 16 * wr + g;
  const int pr = 8 * wg + 2 * tq;
  const int limit_p[2] = {ops::row_limit(p, t, pr, kv_len, qo_len),
                          ops::row_limit(p, t, pr + 1, kv_len, qo_len)};
  const float sc[2] = {reinterpret_cast<const float*>(smem + kScale)[pr],
                       reinterpret_cast<const float*>(smem + kScale)[pr + 1]};
  RowState st;  // maxima, P rows' sums, O

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + kP);
  float* red_max = reinterpret_cast<float*>(smem + kRed);
  float4* xch = reinterpret_cast<float4*>(smem + kXch);
  // This warpgroup's operands (s_product): ckv slabs 2 wg, 2 wg + 1 and rope step wg.
  const std::uint64_t a_ckv = wgmma_desc<128>(smem + kKv + 2 * wg * kSlab, 16, 1024);
  const std::uint64_t a_pe = wgmma_desc<64>(smem + kKv + 4 * kSlab + 32 * wg, 16, 512);
  const std::uint64_t b_ckv = wgmma_desc<128>(smem + kQ + 2 * wg * kQSlab, 16, 1024);
  const std::uint64_t b_pe = wgmma_desc<64>(smem + kQ + 4 * kQSlab + 32 * wg, 16, 512);
  // V reads: token tk's dims 64 warp + 8 g .. + 7 are bytes b .. b + 7 of row tk of slab
  // warp / 2, at unit (b / 16) ^ (tk % 8). The thread's tokens 16 kk + 2 tq (+ 1, + 8, + 9) have
  // tk % 8 = 2 tq or 2 tq + 1: two column offsets, the rest constants.
  const int vb = 64 * (warp % 2) + 8 * g;
  const int v_even =
      (warp / 2) * kSlab + 2 * tq * 128 + ((((vb >> 4) ^ (2 * tq)) & 7) << 4) + (vb & 15);
  const int v_odd =
      (warp / 2) * kSlab + (2 * tq + 1) * 128 + ((((vb >> 4) ^ (2 * tq + 1)) & 7) << 4) + (vb & 15);

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % kStages;
    next_block<kStageBytes>(runs, p, blk, n_blocks, next_entry, smem + kKv, smem + kBar,
                            smem + kEmpty);
    std::uint8_t* kv = smem + kKv + stage * kStageBytes;

    // ---- S^T = K Q^T: this warpgroup's 9 k-steps ----
    float dc[kChains][16];
    wgmma_fence();
    const std::uint32_t so = stage * kStageBytes;
    s_product(dc, desc_add(a_ckv, so), desc_add(a_pe, so), b_ckv, b_pe);
    float d[16];
    sum_chains(dc, d);
    // hi + lo / 16; half i = 0: rows 2 tq (+ 1), i = 1: rows 8 + 2 tq (+ 1); entries (tok0, r),
    // (tok0, r + 1), (tok0 + 8, r), (tok0 + 8, r + 1).
    float half[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) half[i][e] = d[4 * i + e] + d[4 * i + 8 + e] * 0.0625f;
    float full[4];
    exchange_rows(half[0], half[1], wg, xch, full);

    // Rows past the tile's end: zeros, so that P V (P = 0 there) reads finite values. S is done
    // with the stage (both warpgroups waited on their products before the barrier above).
    const int j0 = t.kv_begin + blk * kBlockN;
    const int n_valid = min(kBlockN, t.kv_end - j0);
    if (n_valid < kBlockN) zero_rows_past<4>(kv, n_valid);

    // ---- scores, masks, block row max, online softmax: P rows pr, pr + 1; O rows g, g + 8 ----
    softmax_block<__half>(full, sc, j0, t.kv_end, limit_p, tok0, pr, g, wr, red_max, p_s, st);

    // ---- O += P V: the warp's columns 64 warp + [0, 64); n-tile n, fragment column g is
    // column 64 warp + 8 g + n (fp8_exact's mapping) ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      // tokens 16 kk + 2 tq (+ 1): rows of atom 2 kk; + 8 (+ 9): atom 2 kk + 1
      const uint2 x0 = *reinterpret_cast<const uint2*>(kv + v_even + 2048 * kk);
      const uint2 x1 = *reinterpret_cast<const uint2*>(kv + v_odd + 2048 * kk);
      const uint2 x8 = *reinterpret_cast<const uint2*>(kv + v_even + 2048 * kk + 1024);
      const uint2 x9 = *reinterpret_cast<const uint2*>(kv + v_odd + 2048 * kk + 1024);
      ops::pv_step(st.o, a, x0, x1, x8, x9);
    }
    runs.release(smem + kEmpty + 8 * stage);  // the warp's reads of the stage are done
  }

  // ---- epilogue: row sums over the warpgroup, then o / l and lse ----
  float* red_sum = reinterpret_cast<float*>(smem + kRed);
  reduce_row_sums(st.row_sum, pr, g, wr, red_sum);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= rows) continue;
    const ops::RowEnd end = ops::finish_row(st.max_o[h], row_total(red_sum, r), p.out_scale);
    ops::write_row(p, t, tile, warp, tq, h, r, st.o, end);
  }
}

}  // namespace fp8mla::detail::fp8_tma
