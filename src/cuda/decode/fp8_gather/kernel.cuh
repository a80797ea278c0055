// fp8_gather: fp8_e4m3 tiles of <= 16 rows with fast scores and a power-of-two kpe_scale /
// ckv_scale, on dense page tables with pages of < 8 tokens and on sparse index lists, and
// block-format (656-byte) tiles of <= 16 rows (src/core/dispatch.cpp). One CTA an SM: 8 math
// warps and four producer warps.
//
// One idea: two block chains in one CTA. A one-token tensor-map box into the swizzled layout
// faults, so the producer warps (ops::TokenProducer) issue one bulk copy a token into rows of
// rows16::kPitch bytes, kStages stages ahead, and the registers they need leave one CTA an SM;
// each warpgroup then takes alternate blocks whole, so two chains of S -> softmax -> P V overlap
// inside the CTA as two CTAs' would. S^T = K Q^T over all 18 k-steps (m64n32k32 e4m3, A loaded by
// ldmatrix from the rows, B = Q's e4m3 terms) in chains of three; the online softmax over the
// warpgroup's four warps; O += P V over all 512 columns (each warp 128 columns as two of
// fp8_exact's 64-column mappings). The two warpgroups' states meet once, in the epilogue.
//
// The block format: rows of 656 bytes (a flag array beside them: the rows have no padding), three
// stages. S: the 16 code k-steps in one chain per 128-dim scale group, each chain times its
// tokens' group scale (the rows of S^T are tokens) before the fp32 sum, then the bf16 rope on
// bf16 wgmma (Q's rope stored as bf16 times the row's power of two: store_q_terms). P V: a
// warp's 128 columns are one scale group, so its P fragments are multiplied by the tokens'
// scales over the block's largest (fp16 range) and O carries that largest (o_norm).
//
// Tiles of <= 8 rows (8 heads a GPU: GLM-5 and DeepSeek at TP8) run their own instantiation
// (kRows8), in both formats: S over N = 16 (the rows' hi and lo terms, no padded rows; the block
// format's rope over N = 8), and the softmax and O's rescale over those 8 rows only; P V keeps
// m16n8k16 with P's rows 8-15 zero.
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

namespace fp8mla::detail::fp8_gather {

// The shared tile operations (src/cuda/ops).
using namespace ops;

using rows16::kBlockN;
using rows16::kPElems;
using rows16::kRows;
inline constexpr int kChains = 3;
inline constexpr int kMathThreads = rows16::kThreads;
inline constexpr int kCtaThreads = ops::kCtaThreads<true>;
inline constexpr int kMaxRegs = 65536 / kCtaThreads / 8 * 8;

// A format's staging and shared-memory map (offsets from the 1024-byte-aligned base). fp8_e4m3:
// four 37 KB stages fit beside Q. The block format: three 41 KB stages of 656-byte rows (16 mod
// 128: ldmatrix's 8 rows on 8 bank groups), flags beside them, and Q's bf16 rope.
template <KvFormat F>
struct Layout {
  static constexpr bool kBlock = F == KvFormat::fp8_e4m3_block;
  static constexpr int kCkv = kBlock ? 656 : 512, kKpe = kBlock ? 0 : 64;
  static constexpr int kPitch = kBlock ? 656 : rows16::kPitch;
  static constexpr int kStages = kBlock ? 3 : 4;
  static constexpr int kStageBytes = kBlockN * kPitch;
  static constexpr int kKv = 0;
  static constexpr int kQ = (kKv + kStages * kStageBytes + 1023) / 1024 * 1024;
  static constexpr int kQRope = kQ + kQBytes;  // block: 16 rows x 128 bytes, bf16, swizzled
  static constexpr int kP = kQRope + (kBlock ? 2048 : 0);    // [warpgroup][row][kPElems] fp16
  static constexpr int kRed = kP + 2 * kRows * kPElems * 2;  // [warpgroup][row][warp] float
  static constexpr int kSum = kRed + 2 * kRows * 4 * 4;      // [warpgroup][row][warp] float
  static constexpr int kMax1 = kSum + 2 * kRows * 4 * 4;     // [row] warpgroup 1's max (epilogue)
  static constexpr int kScale = kMax1 + kRows * 4;           // [row] scale_nope * 2^-e
  static constexpr int kFlags = kScale + kRows * 4;          // block: [stage][token]
  static constexpr int kBar = (kFlags + (kBlock ? kStages * kBlockN : 0) + 7) / 8 * 8;
  static constexpr int kEmpty = kBar + kStages * 8;
  // [16 float4 a thread][128 threads]: warpgroup 1's O for the epilogue, in a region of its own:
  // warpgroup 1 stores it without waiting for warpgroup 0's last block, and no stage is reused
  // (racecheck misses the barrier that orders such reuse here: racecheck_barrier_repro.cu).
  static constexpr int kXo = (kEmpty + kStages * 8 + 15) / 16 * 16;
  static constexpr int kSmemBytes = kXo + 16 * 128 * 16 + 1024;
  static_assert(kSmemBytes + 1024 + ops::kMergeCtaSmem <= 228 * 1024, "one CTA and a merge CTA");
  static_assert(kQRope % 1024 == 0, "the rope operand's swizzle atoms stay aligned");
};

// The warpgroup's barrier (128 threads; ids 3 and 4: 0 is the CTA's, 1 the math warps', 2 the
// producers'), from one instruction per warpgroup so ptxas keeps its operands immediate.
__device__ __forceinline__ void wg_sync(int wg) {
  if (wg == 0)
    bar_sync_aligned<3, 128>();
  else
    bar_sync_aligned<4, 128>();
}

// S^T = K Q^T for the warp's 16 tokens of the block over all 18 k-steps: `row` is this lane's
// ldmatrix row (token 16 wr + lane % 16 at byte 16 (lane / 16)); step i < 16 reads ckv bytes
// 32 i, steps 16 and 17 the rope bytes 512 + 32 (i - 16); one ldmatrix.x4 is the m64nNk32 e4m3 A
// fragment (matrices: rows 0-7 / 8-15 x bytes 0-15 / 16-31). A alternates between two buffers:
// step i's loads wait for step i - 2, which read its buffer.
// fp8 wgmma keeps its sums to ~13 mantissa bits, truncating, so its error grows with a chain's
// length: chains of 3 steps, as fp8_tma's, summed in fp32. Three accumulators hold chains of 3
// steps: steps 0-2, 3-5, 6-8 into d[0], d[1], d[2], which then meet in fp32 in d[0]; 9-11 and 12-14
// into fresh d[1], d[2], and d[1] joins d[0]; 15-17 into a fresh d[1]. The caller commits the last
// step and adds the three.
// kN = 8: tiles of <= 8 rows, m64n16k32 (their hi and lo terms).
template <int kN>
__device__ __forceinline__ void s_product(float (&d)[kChains][kN], const std::uint8_t* row,
                                          std::uint64_t b_ckv, std::uint64_t b_pe) {
  static_assert(kChains == 3, "the chain schedule below");
  std::uint32_t a[2][4];
#pragma unroll
  for (int i = 0; i < 18; ++i) {
    if (i == 9 || i == 15) {  // fold: every earlier step done, then fp32 sums
      wgmma_wait<0>();
#pragma unroll
      for (int c = 0; c < kChains; ++c) wgmma_fence_operand(d[c]);
#pragma unroll
      for (int e = 0; e < kN; ++e) d[0][e] += d[1][e];
      if (i == 9) {
#pragma unroll
        for (int e = 0; e < kN; ++e) d[0][e] += d[2][e];
      }
    } else if (i >= 2) {
      wgmma_wait<1>();
    }
    ldmatrix_x4(a[i % 2], i < 16 ? row + 32 * i : row + 512 + 32 * (i - 16));
    wgmma_fence();  // the A registers (and the accumulators) written above
    const int chain = i < 9 ? i / 3 : (i < 12 || i >= 15 ? 1 : 2);
    const std::uint64_t b =
        i < 16 ? desc_add(b_ckv, i / 4 * kQSlab + i % 4 * 32) : desc_add(b_pe, 32 * (i - 16));
    if constexpr (kN == 8) {
      wgmma_64x16x32_e4m3_rs(d[chain], a[i % 2], b, i % 3 != 0);
    } else {
      wgmma_64x32x32_e4m3_rs(d[chain], a[i % 2], b, i % 3 != 0);
    }
    if (i < 17) wgmma_commit();
  }
}

// The block format's S^T = K Q^T into `total` (zeros on entry): first the rope's 4 bf16 k-steps
// (bytes 528 + 32 i of the row; B: Q's bf16 rope) straight into the first half of total (its
// columns are the hi rows: 16 of them, or 8 for kN = 8), then the 16 code k-steps in one chain per
// scale group (group b: steps 4 + 4 b .. 7 + 4 b into d). Once group b's chain is done (the wait
// before group b + 1's first step) it is added to `total` times its tokens' group-b scales (read
// from their rows, `scales`: token tok0's four, token tok0 + 8's 8 rows on; d[4 j + 2 m + k] is
// token tok0 + 8 m). One chain buffer: two spill at this kernel's register cap. Returns with
// every product complete. kN = 8: tiles of <= 8 rows (codes m64n16k32, rope m64n8k16).
template <int kPitch, int kN>
__device__ __forceinline__ void s_product_block(float (&total)[kN], const std::uint8_t* row,
                                                const std::uint8_t* scales, std::uint64_t b_ckv,
                                                std::uint64_t b_rope) {
  float d[kN];
  std::uint32_t a[2][4];
  float(&rope)[kN / 2] = *reinterpret_cast<float(*)[kN / 2]>(&total[0]);
  auto fold = [&](int b) {
    wgmma_fence_operand(d);
    wgmma_fence_operand(total);
    const float s0 = reinterpret_cast<const float*>(scales)[b];
    const float s1 = reinterpret_cast<const float*>(scales + 8 * kPitch)[b];
#pragma unroll
    for (int e = 0; e < kN; ++e) total[e] += d[e] * (e % 4 < 2 ? s0 : s1);
  };
#pragma unroll
  for (int i = 0; i < 20; ++i) {
    const int c = i - 4;  // code step c
    if (i >= 8 && c % 4 == 0) {
      wgmma_wait<0>();  // group c / 4 - 1 is done
      fold(c / 4 - 1);
    } else if (i >= 2) {
      wgmma_wait<1>();  // step i - 2 is done: its A buffer is free
    }
    ldmatrix_x4(a[i % 2], i < 4 ? row + 528 + 32 * i : row + 32 * c);
    wgmma_fence();  // the A registers (and the accumulators) written above
    const std::uint64_t b_code = desc_add(b_ckv, c / 4 * kQSlab + c % 4 * 32);
    if constexpr (kN == 8) {
      if (i < 4)
        wgmma_64x8x16_bf16_rs(rope, a[i % 2], desc_add(b_rope, 32 * i), i > 0);
      else
        wgmma_64x16x32_e4m3_rs(d, a[i % 2], b_code, c % 4 != 0);
    } else {
      if (i < 4)
        wgmma_64x16x16_bf16_rs(rope, a[i % 2], desc_add(b_rope, 32 * i), i > 0);
      else
        wgmma_64x32x32_e4m3_rs(d, a[i % 2], b_code, c % 4 != 0);
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  fold(3);
}

// kRows8: the instantiation for tiles of <= 8 rows.
template <KvFormat F, bool kRows8 = false>
__global__ void __maxnreg__(kMaxRegs) fp8_gather_kernel(const __grid_constant__ DecodeParams p) {
  using L = Layout<F>;
  constexpr bool kBlock = L::kBlock;
  // The P rows a thread scores (2 tq + k, 8 + 2 tq + k) and O row halves (rows g, g + 8) that
  // this instantiation computes.
  constexpr int kThreadRows = kRows8 ? 2 : 4, kOHalves = kRows8 ? 1 : 2, kN = kRows8 ? 8 : 16;
  constexpr int kPitch = L::kPitch, kStages = L::kStages, kStageBytes = L::kStageBytes;
  constexpr int kKv = L::kKv, kQ = L::kQ, kP = L::kP, kRed = L::kRed, kSum = L::kSum;
  constexpr int kMax1 = L::kMax1, kScale = L::kScale, kBar = L::kBar, kEmpty = L::kEmpty;
  constexpr int kXo = L::kXo;
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  std::uint8_t* smem = dynamic_smem_1k();
  const WorkTile t = tile.tile;
  const auto [warp, lane, g, tq, wg, wr] = ops::thread_roles();
  const int rows = t.q_count * t.head_count;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  // ---- copies: the producer warps (a stage is released by its warpgroup's 128 threads) ----
  using Producer = ops::TokenProducer<kStages, kStageBytes, kPitch, L::kCkv, L::kKpe, 128>;
  if (warp >= kMathThreads / 32) {
    Producer::run(p, tile, warp - 8, lane, n_blocks, smem + kKv, smem + kBar, smem + kEmpty,
                  smem + L::kFlags);
    return;
  }
  ops::begin_after_previous_kernel();

  // ---- Q: hi and lo e4m3 terms as the B operand, the rows' score scales ----
  {
    const int q_r = threadIdx.x / 16, q_part = threadIdx.x % 16;
    if (!kRows8 || q_r < 8) {  // kRows8: warps 0-3, rows 0-7 (operand rows 8-15 hold lo terms)
      uint4 q_v[5];
      ops::load_q_chunks(p, t, tile.q_first, rows, q_r, q_part, q_v);
      ops::store_q_terms<kQ, kBlock ? L::kQRope : -1, kRows8 ? 8 : rows16::kRows>(
          p, q_v, q_r, q_part, smem, reinterpret_cast<float*>(smem + kScale));
    }
  }
  Producer::cta_sync();

  // This thread's scores: tokens tok0, tok0 + 8 x P rows 8 i + 2 tq + k (index ri = 2 i + k).
  const int tok0 = 16 * wr + g;
  int limit[4];
  float sc[4];
#pragma unroll
  for (int ri = 0; ri < kThreadRows; ++ri) {
    const int r = 8 * (ri / 2) + 2 * tq + ri % 2;
    limit[ri] = ops::row_limit(p, t, r, tile.kv_len, tile.qo_len);
    sc[ri] = reinterpret_cast<const float*>(smem + kScale)[r];
  }
  float max_p[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
  float row_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float max_o[2] = {-INFINITY, -INFINITY};  // O rows g, g + 8
  float o[2][8][4];                         // half h: columns 64 (2 wr + h) + ..
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int n = 0; n < 8; ++n) o[h][n][0] = o[h][n][1] = o[h][n][2] = o[h][n][3] = 0.0f;

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + kP) + wg * kRows * kPElems;
  if constexpr (kRows8) {
    // P's rows 8-15 are P V's padded A rows: zeros once (the first wg_sync publishes them).
    for (int x = threadIdx.x % 128; x < 8 * kPElems / 2; x += 128)
      reinterpret_cast<std::uint32_t*>(p_s + 8 * kPElems)[x] = 0;
  }
  float* red = reinterpret_cast<float*>(smem + kRed) + wg * kRows * 4;
  const std::uint64_t b_ckv = wgmma_desc<128>(smem + kQ, 16, 1024);
  const std::uint64_t b_pe = wgmma_desc<64>(smem + kQ + 4 * kQSlab, 16, 512);
  [[maybe_unused]] const std::uint64_t b_rope = wgmma_desc<128>(smem + L::kQRope, 16, 1024);
  // The block format: O is the output over o_norm (the last block's largest scale of the warp's
  // group: a warp's 128 columns are group wr).
  float o_norm = 1.0f;
  const int a_row = (16 * wr + lane % 16) * kPitch + 16 * (lane / 16);
  const int v_off = 2 * tq * kPitch + 8 * g;  // token 16 kk + 2 tq, dims 64 (2 wr + h) + 8 g

  for (int blk = wg; blk < n_blocks; blk += 2) {
    const int stage = blk % kStages;
    // An odd stage count (the block format's three) gives a stage's blocks to both warpgroups in
    // turn: block blk - kStages, the stage's previous one, is the other warpgroup's and may not
    // have landed yet, and a parity wait two phases ahead returns at once (it reads as the phase
    // before). Its release first, then block blk's parity is the stage's next one.
    if (kStages % 2 != 0 && blk >= kStages)
      mbar_wait(smem + kEmpty + 8 * stage, (blk / kStages - 1) % 2);
    mbar_wait(smem + kBar + 8 * stage, (blk / kStages) % 2);  // block blk landed
    const std::uint8_t* kv = smem + kKv + stage * kStageBytes;
    // The block format: token tok's scale of group wr, the scale group of the warp's 128 columns.
    [[maybe_unused]] auto group_scale = [&](int tok) {
      return *reinterpret_cast<const float*>(kv + tok * kPitch + 512 + 4 * wr);
    };

    // ---- S^T = K Q^T: all 18 k-steps (the block format: 16 and the rope's 4) ----
    // d[4 j + e]: n-tile j (j = 0, 1: hi of rows 8 j + 2 tq (+ 1); 2, 3: their lo), e = 2 m + k:
    // token tok0 + 8 m, row + k. s[4 i + e]: row 8 i + 2 tq + k, token tok0 + 8 m.
    float d[kN];
    if constexpr (kBlock) {
#pragma unroll
      for (int e = 0; e < kN; ++e) d[e] = 0.0f;
      s_product_block<kPitch, kN>(d, kv + a_row, kv + tok0 * kPitch + 512, b_ckv, b_rope);
    } else {
      float dc[kChains][kN];
      s_product(dc, kv + a_row, b_ckv, b_pe);
      sum_chains(dc, d);
    }
    const int j0 = t.kv_begin + blk * kBlockN;
    // A token's flag: 0 for a skipped slot (a -1 index, or an entry outside the pool), whose
    // zero-filled row must not score 0 (TokenProducer: the byte after its 576, or the flags).
    auto present = [&](int tok) {
      return (kBlock ? smem[L::kFlags + stage * kBlockN + tok] : kv[tok * kPitch + 576]) != 0;
    };
    float s[2 * kThreadRows];
#pragma unroll
    for (int i = 0; i < kThreadRows / 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float hi = d[4 * i + e], lo = d[4 * i + kN / 2 + e];
        const int ri = 2 * i + e % 2, tok = tok0 + 8 * (e / 2);
        const bool ok = j0 + tok < t.kv_end && j0 + tok <= limit[ri] && present(tok);
        s[4 * i + e] = ok ? (hi + lo * 0.0625f) * sc[ri] : -INFINITY;
      }
    // The block format: the largest scale of the warp's group among the block's tokens.
    float blk_norm = 1.0f;
    if constexpr (kBlock) {
      float m = fmaxf(group_scale(lane), group_scale(lane + 32));
#pragma unroll
      for (int x = 16; x >= 1; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
      blk_norm = m > 0.0f ? m : o_norm;
    }
    const float to_block = kBlock ? o_norm / blk_norm : 1.0f;
    o_norm = blk_norm;

      // ---- the block's row maxima over the warpgroup, P, the running sums, O rescaled ----
#pragma unroll
    for (int ri = 0; ri < kThreadRows; ++ri) {
      const int i = ri / 2, k = ri % 2;
      float mx = fmaxf(s[4 * i + k], s[4 * i + 2 + k]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      if (g == 0) red[(8 * i + 2 * tq + k) * 4 + wr] = mx;
    }
    wg_sync(wg);
#pragma unroll
    for (int ri = 0; ri < kThreadRows; ++ri) {
      const int i = ri / 2, k = ri % 2, r = 8 * i + 2 * tq + k;
      const float mx = ops::block_max(red + r * 4, max_p[ri]);
      const float base = mx == -INFINITY ? 0.0f : mx;
      const float alpha = fast_exp2(max_p[ri] - base);
      max_p[ri] = mx;
      float pa, pb;
      p_s[r * kPElems + tok0] = ops::p_bits<__half>(fast_exp2(s[4 * i + k] - base), pa);
      p_s[r * kPElems + tok0 + 8] = ops::p_bits<__half>(fast_exp2(s[4 * i + 2 + k] - base), pb);
      row_sum[ri] = row_sum[ri] * alpha + (pa + pb);
    }
#pragma unroll
    for (int h = 0; h < kOHalves; ++h) {
      const float mx = ops::block_max(red + (g + 8 * h) * 4, max_o[h]);
      const float base = mx == -INFINITY ? 0.0f : mx;
      const float alpha = fast_exp2(max_o[h] - base);
      max_o[h] = mx;
      ops::rescale_rows(o[0], h, alpha * to_block);
      ops::rescale_rows(o[1], h, alpha * to_block);
    }
    wg_sync(wg);

    // ---- O += P V over the warp's 128 columns ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      if constexpr (kBlock) {
        // P's columns tk, tk + 1 (a[0], a[1]) and tk + 8, tk + 9 (a[2], a[3]) times the tokens'
        // group-wr scales over blk_norm (<= 1: fp16's range).
        const int tk = 16 * kk + 2 * tq;
        const float inv = 1.0f / blk_norm;
        auto scale = [&](int tok) { return group_scale(tok) * inv; };
        const std::uint32_t f01 = float2_to_half2(scale(tk), scale(tk + 1));
        const std::uint32_t f89 = float2_to_half2(scale(tk + 8), scale(tk + 9));
        a[0] = ops::hmul2(a[0], f01), a[1] = ops::hmul2(a[1], f01);
        a[2] = ops::hmul2(a[2], f89), a[3] = ops::hmul2(a[3], f89);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::uint8_t* v = kv + v_off + 16 * kk * kPitch + 64 * (2 * wr + h);
        ops::pv_step(o[h], a, *reinterpret_cast<const uint2*>(v),
                     *reinterpret_cast<const uint2*>(v + kPitch),
                     *reinterpret_cast<const uint2*>(v + 8 * kPitch),
                     *reinterpret_cast<const uint2*>(v + 9 * kPitch));
      }
    }
    mbar_arrive(smem + kEmpty + 8 * stage);  // this thread's reads of the stage are done
  }

  // ---- epilogue: each warpgroup's row sums; warpgroup 1's O and maxima to warpgroup 0, which
  // merges the two states and writes the rows (the block format: O in output units first) ----
  if constexpr (kBlock) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[h][n][c] *= o_norm;
  }
  float* sums = reinterpret_cast<float*>(smem + kSum);
#pragma unroll
  for (int ri = 0; ri < kThreadRows; ++ri) {
    float sum = row_sum[ri];
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    if (g == 0) sums[(wg * kRows + 8 * (ri / 2) + 2 * tq + ri % 2) * 4 + wr] = sum;
  }
  float* max1 = reinterpret_cast<float*>(smem + kMax1);
  float4* xo = reinterpret_cast<float4*>(smem + kXo);
  const int tid = threadIdx.x % 128;
  if (wg == 1) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int n = 0; n < 8; ++n)
        xo[(8 * h + n) * 128 + tid] = make_float4(o[h][n][0], o[h][n][1], o[h][n][2], o[h][n][3]);
    if (wr == 0 && tq == 0) {
      max1[g] = max_o[0];
      max1[g + 8] = max_o[1];
    }
  }
  bar_sync_aligned<1, kMathThreads>();
  if (wg == 1) return;
#pragma unroll
  for (int hr = 0; hr < kOHalves; ++hr) {
    const int r = g + 8 * hr;
    if (r >= rows) continue;
    const float m0 = max_o[hr], m1 = max1[r];
    const float mx = fmaxf(m0, m1);
    const float base = mx == -INFINITY ? 0.0f : mx;
    const float a0 = fast_exp2(m0 - base), a1 = fast_exp2(m1 - base);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float4 x = xo[(8 * h + n) * 128 + tid];
        o[h][n][2 * hr] = o[h][n][2 * hr] * a0 + (hr == 0 ? x.x : x.z) * a1;
        o[h][n][2 * hr + 1] = o[h][n][2 * hr + 1] * a0 + (hr == 0 ? x.y : x.w) * a1;
      }
    const float l = ops::row_total(sums, r) * a0 + ops::row_total(sums + kRows * 4, r) * a1;
    const ops::RowEnd end = ops::finish_row(mx, l, p.out_scale);
#pragma unroll
    for (int h = 0; h < 2; ++h) ops::write_row(p, t, tile, 2 * wr + h, tq, hr, r, o[h], end);
  }
}

}  // namespace fp8mla::detail::fp8_gather
