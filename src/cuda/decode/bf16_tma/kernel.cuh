// bf16_tma and bf16_gather: bf16 tiles of <= 16 rows on dense page tables (src/core/dispatch.h):
// bf16_tma on pages of >= 8 tokens while tiles are short, bf16_gather on smaller pages and for
// long tiles. One body, decode_tile<kGather>; one CTA an SM (bf16_gather: 8 math warps and four
// producer warps).
//
// One idea: fp8_tma's structure on bf16 bytes. bf16_tma's stage is a block's page runs copied as
// nine 128-byte-swizzled slabs of 64 dims by tensor maps (ckv: slabs 0-7, kpe: slab 8);
// bf16_gather's is 64 rows of kPitch bytes, one bulk copy a token by the producer warps
// (ops::TokenProducer), tokens past the tile zero-filled. S^T = K Q^T on bf16 wgmma (m64n16k16;
// K from the slabs, or loaded into registers by ldmatrix from the rows): warpgroup w multiplies
// ckv dims 256w .. 256w + 255 and kpe k-steps 2w, 2w + 1, and the sums meet through a 4 KB
// exchange; fp8_tma's online softmax with P as bf16; O += P V on mma.sync, warp w owning
// columns [64w, 64w + 64), V's fragments by ldmatrix.trans. Tokens past the tile's end inside a
// copied page run are zeroed before P V reads them (P is 0 there, but 0 * NaN would not be).
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

namespace fp8mla::detail::bf16_tma {

// The shared tile operations (src/cuda/ops).
using namespace ops;

using rows16::kBlockN;
using rows16::kPElems;  // P's row pitch (here bf16): ldmatrix conflict-free
using rows16::kRows;
using rows16::kThreads;
using rows16::kWarps;
inline constexpr int kStages = 2;
using rows16::kSlab;                        // 64 dims (128 bytes) of a block's tokens
inline constexpr int kQSlab = kRows * 128;  // 64 dims of the q rows
inline constexpr int kPitch =
    (576 + 8) * 2;  // kGather's token rows: 1168 bytes, ldmatrix conflict-free
// Offsets from the 1024-byte-aligned base (swizzle atoms). A stage holds a block's tokens: for
// the tensor-map copies ckv slabs 0-7 and kpe slab 8, for the per-token copies (kGather) 64 rows
// of kPitch bytes.
template <bool kGather>
struct Layout {
  static constexpr int kStageBytes = kGather ? kBlockN * kPitch : 9 * kSlab;
  static constexpr int kKv = 0;
  static constexpr int kQ = kKv + kStages * kStageBytes;
  static constexpr int kP = kQ + 9 * kQSlab;
  static constexpr int kXch = kP + kRows * kPElems * 2;  // [warpgroup][thread] float4
  static constexpr int kRed = kXch + 2 * 128 * 16;       // [row][warp of its warpgroup] float
  static constexpr int kBar = kRed + kRows * 4 * 4;
  static constexpr int kEmpty = kBar + kStages * 8;  // [stage] "released": every warp is done
  static constexpr int kSmemBytes = kEmpty + kStages * 8 + 1024;  // + the alignment of the base
  static_assert(kSmemBytes <= 227 * 1024, "one CTA fits an SM");
  static_assert(kQ % 1024 == 0 && kStageBytes % 1024 == 0 && kQSlab % 1024 == 0,
                "swizzle atoms stay aligned");
};

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

// s_product with the cache operand from registers (kGather: kPitch-byte rows, which no wgmma
// descriptor can address). `row`: this lane's ldmatrix row, token 16 (warp % 4) + lane % 16 (the
// warp's 16 rows of the warpgroup's 64) at byte 16 (lane / 16); one ldmatrix.x4 a k-step is the
// m64nNk16 A fragment. All 18 steps are loaded before the first wgmma (72 registers: one CTA per
// SM leaves them).
__device__ __forceinline__ void s_product_rows(float (&d)[8], const std::uint8_t* row, int wg,
                                               std::uint64_t b_ckv, std::uint64_t b_pe) {
  std::uint32_t a[18][4];
#pragma unroll
  for (int i = 0; i < 18; ++i)
    ldmatrix_x4(a[i], i < 16 ? row + 512 * wg + 32 * i : row + 1024 + 64 * wg + 32 * (i - 16));
  wgmma_fence();  // the A registers written above
#pragma unroll
  for (int i = 0; i < 18; ++i)
    wgmma_64x16x16_bf16_rs(
        d, a[i],
        i < 16 ? desc_add(b_ckv, i / 4 * kQSlab + i % 4 * 32) : desc_add(b_pe, 32 * (i - 16)),
        i > 0);
}

// kGather's copies: ops::TokenProducer's four producer warps, one bulk copy a token into a
// kPitch-byte row.
using ops::kCtaThreads;
using TokenProducer = ops::TokenProducer<kStages, Layout<true>::kStageBytes, kPitch, 1024, 128>;

// Byte offset of q row n (0..15), 8-dim chunk c (0..71) in the Q operand at kQ.
template <int kQ>
__device__ __forceinline__ int q_offset(int n, int c) {
  return kQ + c / 8 * kQSlab + n / 8 * 1024 + sw128(n % 8, c % 8 * 16);
}

// kGather = false: pages of >= 8 tokens, copied by tensor maps; true: pages of < 8 tokens, one
// bulk copy a token into kPitch-byte rows, S's cache operand from registers (s_product_rows).
// (bf16_tma_kernel, bf16_gather_kernel: instantiations/*.cu of their folders; p is the kernel's
// __grid_constant__ parameter, whose tensor maps the TMA engine reads.)
template <bool kGather>
__device__ __forceinline__ void decode_tile(const DecodeParams& p) {
  using L = Layout<kGather>;
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  std::uint8_t* smem = dynamic_smem_1k();
  const WorkTile t = tile.tile;
  const auto [warp, lane, g, tq, wg, wr] = ops::thread_roles();
  const int rows = t.q_count * t.head_count;
  const int q_first = tile.q_first;
  const int qo_len = tile.qo_len;
  const int kv_len = tile.kv_len;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  // ---- copies: page runs as eight ckv slabs and a kpe slab by the math warps
  // (ops::PageRunCopier), or tokens by the producer warps (kGather: TokenProducer), beside
  // which the math warps' barriers are a named barrier of their own ----
  if constexpr (kGather) {
    if (warp >= kWarps) {
      TokenProducer::run(p, tile, warp - kWarps, lane, n_blocks, smem + L::kKv, smem + L::kBar,
                         smem + L::kEmpty);
      return;
    }
  }
  ops::PageRunCopier<8, 128> runs(p, tile, warp, lane);
  const bool copier = !kGather && runs.copier;
  std::int32_t entry0 = 0, next_entry = 0;
  static_assert(kStages == 2, "PageRunCopier::start sets up two stages");
  if constexpr (kGather)
    ops::begin_after_previous_kernel();
  else
    runs.start(p, smem + L::kBar, smem + L::kEmpty, entry0, next_entry);

  // ---- Q: 16 threads a row read it (4.5 16-byte chunks each) into the B operand ----
  {
    const int q_r = threadIdx.x / 16, q_part = threadIdx.x % 16;
    uint4 q_v[5];
    ops::load_q_chunks(p, t, q_first, rows, q_r, q_part, q_v);
#pragma unroll
    for (int i = 0; i < 5; ++i) {
      const int c = q_part + 16 * i;
      if (c < 72) *reinterpret_cast<uint4*>(smem + q_offset<L::kQ>(q_r, c)) = q_v[i];
    }
    fence_proxy_async();  // the generic stores above, read by wgmma (async proxy)
  }
  if constexpr (kGather) {
    TokenProducer::cta_sync();
  } else {
    __syncthreads();
    if (copier && n_blocks > 0) runs.issue(p, 0, entry0, smem + L::kKv, smem + L::kBar);
  }

  // This thread's S entries: tokens tok0, tok0 + 8 of the block, rows pr, pr + 1 (its P rows).
  const int tok0 = 16 * wr + g;
  const int pr = 8 * wg + 2 * tq;
  const int limit_p[2] = {ops::row_limit(p, t, pr, kv_len, qo_len),
                          ops::row_limit(p, t, pr + 1, kv_len, qo_len)};
  const float sc[2] = {p.scale_nope, p.scale_nope};  // bf16: one scale for every product
  ops::RowState st;                                  // maxima, P rows' sums, O

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + L::kP);
  float* red_max = reinterpret_cast<float*>(smem + L::kRed);
  float4* xch = reinterpret_cast<float4*>(smem + L::kXch);
  [[maybe_unused]] const std::uint64_t a_ckv =
      wgmma_desc<128>(smem + L::kKv + 4 * wg * kSlab, 16, 1024);
  [[maybe_unused]] const std::uint64_t a_pe =
      wgmma_desc<128>(smem + L::kKv + 8 * kSlab + 64 * wg, 16, 1024);
  const std::uint64_t b_ckv = wgmma_desc<128>(smem + L::kQ + 4 * wg * kQSlab, 16, 1024);
  const std::uint64_t b_pe = wgmma_desc<128>(smem + L::kQ + 8 * kQSlab + 64 * wg, 16, 1024);
  // V reads (ldmatrix.trans): lane l gives token row v_tok of ckv slab `warp`, 16-byte unit
  // 2 np + l / 16 (dims 16 np + 8 (l / 16) ..), stored at unit ^ (v_tok % 8).
  // kGather: row v_tok at byte 128 warp + 16 (2 np + l / 16).
  const int v_row = lane % 8 + (lane / 8) % 2 * 8, v_unit = lane / 16;
  // kGather: this lane's ldmatrix row in S (s_product_rows).
  [[maybe_unused]] const int a_row = (16 * wr + lane % 16) * kPitch + 16 * (lane / 16);

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % kStages;
    if constexpr (kGather)
      mbar_wait(smem + L::kBar + 8 * stage, (blk / kStages) % 2);  // block blk landed
    else
      ops::next_block<L::kStageBytes>(runs, p, blk, n_blocks, next_entry, smem + L::kKv,
                                      smem + L::kBar, smem + L::kEmpty);
    std::uint8_t* kv = smem + L::kKv + stage * L::kStageBytes;

    // ---- S^T = K Q^T: this warpgroup's 18 k-steps ----
    float d[8];
    if constexpr (kGather) {
      s_product_rows(d, kv + a_row, wg, b_ckv, b_pe);
    } else {
      wgmma_fence();
      const std::uint32_t so = stage * L::kStageBytes;
      s_product(d, desc_add(a_ckv, so), desc_add(a_pe, so), b_ckv, b_pe);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(d);
    // d[4 i + e]: rows 8 i + 2 tq (+ 1) of tokens tok0, tok0 + 8 (ops::exchange_rows's order)
    const float rows0[4] = {d[0], d[1], d[2], d[3]}, rows1[4] = {d[4], d[5], d[6], d[7]};
    float full[4];
    ops::exchange_rows<kGather>(rows0, rows1, wg, xch, full);
    const int j0 = t.kv_begin + blk * kBlockN;
    const int n_valid = min(kBlockN, t.kv_end - j0);
    if (!kGather && n_valid < kBlockN) ops::zero_rows_past<8>(kv, n_valid);  // kGather: copier

    // ---- scores, masks, block row max, online softmax: P rows pr, pr + 1; O rows g, g + 8 ----
    ops::softmax_block<__nv_bfloat16, kGather>(full, sc, j0, t.kv_end, limit_p, tok0, pr, g, wr,
                                               red_max, p_s, st);

    // ---- O += P V: the warp's columns 64 warp + [0, 64), n-tile n = columns 8 n .. 8 n + 7 ----
    [[maybe_unused]] const std::uint8_t* v_slab = kv + warp * kSlab;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      const int v_tok = 16 * kk + v_row;
#pragma unroll
      for (int np2 = 0; np2 < 4; ++np2) {
        std::uint32_t b[4];
        if constexpr (kGather)
          ldmatrix_x4_trans(b, kv + v_tok * kPitch + 128 * warp + 16 * (2 * np2 + v_unit));
        else
          ldmatrix_x4_trans(b, v_slab + v_tok * 128 + (((2 * np2 + v_unit) ^ (v_tok % 8)) << 4));
        mma_16816<true>(st.o[2 * np2], a, b[0], b[1]);
        mma_16816<true>(st.o[2 * np2 + 1], a, b[2], b[3]);
      }
    }
    // The warp's reads of the stage are done (kGather: the thread's, TokenProducer's count).
    if constexpr (kGather)
      mbar_arrive(smem + L::kEmpty + 8 * stage);
    else
      runs.release(smem + L::kEmpty + 8 * stage);
  }

  // ---- epilogue: row sums over the warpgroup, then o / l and lse ----
  float* red_sum = reinterpret_cast<float*>(smem + L::kRed);
  ops::reduce_row_sums<kGather>(st.row_sum, pr, g, wr, red_sum);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= rows) continue;
    const ops::RowEnd end = ops::finish_row(st.max_o[h], ops::row_total(red_sum, r), p.out_scale);
    ops::write_row_trans(p, t, tile, warp, tq, h, r, st.o, end);
  }
}

}  // namespace fp8mla::detail::bf16_tma
