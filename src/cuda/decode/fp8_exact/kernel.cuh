// fp8_exact: fp8_e4m3 tiles of <= 16 rows that the fp8 tensor-core families do not serve (sparse
// index lists, PlanOptions::exact_scores, kpe_scale / ckv_scale ratios other than a power of two)
// and block-format (fp8_e4m3_block, 656-byte) tiles of <= 16 rows (src/core/dispatch.cpp). One
// CTA (8 warps) per WorkTile, two CTAs per SM.
//
// One idea: never dequantize into a tile. Each block's raw 576-byte tokens land by one bulk copy
// each in rows of kPitch bytes (bank-conflict free for the reads below), and every thread converts
// the codes it multiplies straight into mma.sync B fragments (one cvt.rn.f16x2.e4m3x2 a pair:
// exact fp16 products, fp32 sums). S: warp w owns nope dims [64w, 64w + 64) of all 64 tokens (8
// independent mma chains; Q's fp16 fragments, scaled per row by a power of two, stay in
// registers) and the rope dims of its 8 tokens; the 8 partial sums meet in shared memory. O:
// V's fragments pair two tokens' codes of a column by byte permutes (ops::pv_step), each thread
// owning 16 contiguous columns of its two rows. The row max is exchanged once a block, the row
// sums only at the end.
//
// The block format (512 codes, 4 float32 scales of 128 dims, 64 bf16 rope dims a token): warps 2b
// and 2b + 1 share scale group b. S: the pair's two partial sums of a token meet first (each warp
// keeps four n-tiles and hands the other four over), the owner multiplies the sum by the token's
// scale, and the four groups' sums meet as above (16 KB of partial sums, not 32: two stages of
// 656-byte tokens leave no more). The rope is bf16 products. P V: each warp multiplies P's
// fragments by its group's token scales over the block's largest (fp16 range), and O carries that
// largest as a factor (o_norm), folded into the rescale and the epilogue.
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

namespace fp8mla::detail::fp8_exact {

// The shared tile operations (src/cuda/ops).
using namespace ops;

using rows16::kBlockN;
using rows16::kPElems;
using rows16::kRows;
using rows16::kStages;
using rows16::kThreads;
using rows16::kWarps;

// A format's staging and shared-memory map.
template <KvFormat F>
struct Layout {
  static constexpr bool kBlock = F == KvFormat::fp8_e4m3_block;
  static constexpr int kCkv = kBlock ? 656 : 512;  // a token's bytes in one bulk copy, and kpe's
  static constexpr int kKpe = kBlock ? 0 : 64;
  // fp8_e4m3: rows16::kPitch. Block: 656 = 16 (mod 128), so a K read's tokens t and t + 4 are 64
  // bytes apart and a V read's tokens t, t + 2, t + 4, t + 6 hit four 32-byte windows (mod 128).
  static constexpr int kPitch = kBlock ? 656 : rows16::kPitch;
  static constexpr int kStageBytes = kBlockN * kPitch;
  static constexpr int kRaw = 0;
  static constexpr int kP = kRaw + kStages * kStageBytes;
  // Partial S, [slot][n-tile][lane] float4: a slot a warp (fp8_e4m3), a scale group (block).
  static constexpr int kPart = kP + kRows * kPElems * 2;
  static constexpr int kSlots = kBlock ? 4 : kWarps;
  static constexpr int kRed = kPart + kSlots * 8 * 32 * 16;
  static constexpr int kFlags = kRed + kWarps * kRows * 4;
  static constexpr int kBar = (kFlags + kStages * kBlockN + 7) / 8 * 8;  // a stage's mbarrier
  // Block: the rope's bf16 A fragments, [row][k-step][16 dims in fragment order], rows of 144
  // bytes (ldmatrix conflict-free), read each block rather than held in 16 registers.
  static constexpr int kQRope = (kBar + kStages * 8 + 15) / 16 * 16;
  static constexpr int kQRopePitch = 144;
  static constexpr int kSmemBytes = kBlock ? kQRope + kRows * kQRopePitch : kBar + kStages * 8;
  // Q's bf16 rows before the first block: in the partial-sum buffer, or (block) in stage 1, whose
  // first copy is issued after the fragments are read.
  static constexpr int kQStash = kBlock ? kRaw + kStageBytes : kPart;
};
// Q's bf16 rows in the stash: a 16-byte pad per 1152-byte row keeps the fragment reads of 8 rows
// at once off a single bank group.
inline constexpr int kQPitch = 576 * 2 + 16;
// Two CTAs per SM (16 warps): one CTA an SM (255 registers, Q fragments of all 576 dims per
// thread) is latency bound.
inline constexpr int kMinBlocks = 2;
template <KvFormat F>
constexpr bool fits() {
  using L = Layout<F>;
  return kRows * kQPitch <= (L::kBlock ? L::kStageBytes : L::kRed - L::kPart) &&
         kRows * 4 <= L::kFlags - L::kRed &&
         kMinBlocks * (L::kSmemBytes + 1024) + ops::kMergeCtaSmem <= 228 * 1024;
}
static_assert(fits<KvFormat::fp8_e4m3>() && fits<KvFormat::fp8_e4m3_block>(),
              "the Q stash fits, and two CTAs and a merge CTA fit an SM");

// Block `blk`'s copies into `stage` by the TMA engine, one token per bulk copier
// (ops::bulk_token; page-table `entry` from token_entry_of): cp.async copies of 16 bytes a
// thread queue in the L1, and the warps wait on them.
template <KvFormat F>
__device__ __forceinline__ void load_block(const DecodeParams& p, const WorkTile& t, int blk,
                                           std::int32_t entry, std::uint8_t* smem, int stage) {
  using L = Layout<F>;
  const int tok = ops::bulk_token();
  ops::bulk_copy_token<L::kCkv, L::kKpe>(
      p, ops::entry_slot_of<kBlockN>(p, t, blk, entry, tok),
      smem + L::kRaw + stage * L::kStageBytes + tok * L::kPitch,
      smem + L::kFlags + stage * kBlockN + tok, smem + L::kBar + 8 * stage);
}

template <KvFormat F>
__global__ void __maxnreg__(ops::kMaxRegsTwoCtas) fp8_exact_kernel(const DecodeParams p) {
  using L = Layout<F>;
  constexpr bool kBlock = L::kBlock;
  constexpr int kPitch = L::kPitch, kRaw = L::kRaw, kStageBytes = L::kStageBytes;
  constexpr int kP = L::kP, kPart = L::kPart, kRed = L::kRed, kFlags = L::kFlags, kBar = L::kBar;
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  ops::begin_after_previous_kernel();
  extern __shared__ __align__(128) std::uint8_t smem[];
  const WorkTile t = tile.tile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;  // mma fragment row group and thread in group
  const int rows = t.q_count * t.head_count;
  const int q_first = tile.q_first;
  const int qo_len = tile.qo_len;
  const int kv_len = tile.kv_len;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  static_assert(kStages == 2, "the entry prefetch below assumes one block in flight");
  const std::int32_t kv_base = tile.kv_base;
  // Every global load of the prologue is issued before anything waits on one: the page-table
  // entries of blocks 0 and 1 (next_entry: used only by iteration 0, see token_entry) and Q.
  const bool copier = ops::bulk_copier();
  std::int32_t entry0 = 0, next_entry = 0;
  if (copier) {
    entry0 = ops::token_entry_of<kBlockN>(p, t, q_first, kv_base, 0, ops::bulk_token());
    next_entry = ops::token_entry_of<kBlockN>(p, t, q_first, kv_base, 1, ops::bulk_token());
  }
  // ---- Q: the CTA reads each row once (16 threads a row, 4.5 16-byte chunks each) into a
  // bf16 stash in the partial-sum buffer (free until the first block's S), and the row's
  // exponent (ops::q_row_exponent) into the reduction buffer, rather than every quad reading its
  // two rows whole for the maximum and again for its fragments (thousands of instructions a
  // warp before the first block, which short requests feel).
  const int q_r = threadIdx.x / 16, q_part = threadIdx.x % 16;  // row, thread within the row
  uint4 q_v[5];
  ops::load_q_chunks(p, t, q_first, rows, q_r, q_part, q_v);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(smem + kBar + 8 * s, kBlockN);
    fence_mbar_init();
  }
  __syncthreads();
  if (copier) load_block<F>(p, t, 0, entry0, smem, 0);

  std::uint8_t* q_stash = smem + L::kQStash;
  int* q_exp = reinterpret_cast<int*>(smem + kRed);
  {
    std::uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 5; ++i) {
      const int c = q_part + 16 * i;
      if (c < 72) {
        m = max(m, ops::abs_max_bits(q_v[i]));
        *reinterpret_cast<uint4*>(q_stash + q_r * kQPitch + 16 * c) = q_v[i];
      }
    }
#pragma unroll
    for (int x = 8; x >= 1; x /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, x));
    if (q_part == 0) q_exp[q_r] = ops::q_row_exponent(__uint_as_float(m));
  }
  __syncthreads();

  // Fragments: rows g and g + 8 of the warp's nope dims 64 warp + 16 tq + [0, 16) (k-steps 0..3
  // of its slice) and of rope dims 16 tq + [0, 16). k-step j pairs logical k (2 tq, 2 tq + 1)
  // with dims +4 j, +4 j + 1 and (2 tq + 8, 2 tq + 9) with +4 j + 2, +4 j + 3: the layout of a
  // 16-byte K read (below). Block: the rope is bf16 as given, dims 8 tq + [0, 8) and
  // 32 + 8 tq + [0, 8) (two 16-byte reads of bf16 K, 64 bytes apart).
  float q_inv[2];
  std::uint32_t qn[4][4], qr[4][4];  // nope slice, rope (fp8_e4m3)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    // Row scale 2^e; 2^-e is undone on the scores.
    const int e = q_exp[r];
    const float scale = ops::exp2i(e);
    q_inv[h] = ops::exp2i(-e);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const bool bf16_rope = kBlock && part == 1;
      const std::uint8_t* src =
          q_stash + r * kQPitch +
          2 * (part == 0 ? 64 * warp + 16 * tq : bf16_rope ? 512 + 8 * tq : 512 + 16 * tq);
      const uint4 lo = *reinterpret_cast<const uint4*>(src);
      const uint4 hi = *reinterpret_cast<const uint4*>(src + (bf16_rope ? 64 : 16));
      const std::uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      if (bf16_rope) {
        // k-step j's logical columns 2 tq, 2 tq + 1 and 2 tq + 8, 2 tq + 9 of row r.
        std::uint8_t* row = smem + L::kQRope + r * L::kQRopePitch + 4 * tq;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          *reinterpret_cast<std::uint32_t*>(row + 32 * j) = w[2 * j];
          *reinterpret_cast<std::uint32_t*>(row + 32 * j + 16) = w[2 * j + 1];
        }
        continue;
      }
      std::uint32_t(&q)[4][4] = part == 0 ? qn : qr;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        q[j][h] = ops::scale_to_half2(w[2 * j], scale);
        q[j][h + 2] = ops::scale_to_half2(w[2 * j + 1], scale);
      }
    }
  }

  // Last visible token (inclusive) of the thread's rows g, g + 8.
  const int limit[2] = {ops::row_limit(p, t, g, kv_len, qo_len),
                        ops::row_limit(p, t, g + 8, kv_len, qo_len)};
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's tokens only; summed over the CTA at the end
  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // Block: O is this warp's output over o_norm, the largest scale of its group in the last block.
  float o_norm = 1.0f;

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + kP);
  float* red_max = reinterpret_cast<float*>(smem + kRed);
  // The S-phase tokens of this thread (columns 2 tq, 2 tq + 1 of the warp's n-tile).
  const int tok_a = 8 * warp + tq, tok_b = tok_a + 4;
  // Its K-read token within an n-tile: fragment column g holds token g / 2 + 4 (g % 2).
  const int k_tok = g / 2 + 4 * (g % 2);
  // Partial S, [slot][n-tile][lane] float4: this warp stores its n-tiles at part_st + 128 n and
  // reads every slot's n-tile `warp` at part_ld + 1024 w (constant offsets, no per-read math).
  // Block: the slot is the warp's scale group; even warps keep n-tiles 0-3 (computed last) and
  // store 4-7 for their odd partner, odd warps the reverse.
  const int group = warp / 2;
  float* part_st =
      reinterpret_cast<float*>(smem + kPart) + (kBlock ? group : warp) * 1024 + lane * 4;
  const float* part_ld = reinterpret_cast<const float*>(smem + kPart) + warp * 128 + lane * 4;
  const int n_first = kBlock && warp % 2 == 0 ? 4 : 0;

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % kStages;
    __syncthreads();  // block blk - 1 is done with: its stage takes block blk + 1
    if (copier && blk + 1 < n_blocks) {
      load_block<F>(p, t, blk + 1, next_entry, smem, (blk + 1) % kStages);
      next_entry = ops::token_entry_of<kBlockN>(p, t, q_first, kv_base, blk + 2, ops::bulk_token());
    }
    mbar_wait(smem + kBar + 8 * stage, (blk / kStages) % 2);  // block blk landed
    const std::uint8_t* raw = smem + kRaw + stage * kStageBytes;
    const std::uint8_t* flags = smem + kFlags + stage * kBlockN;
    // Block: token `tok`'s scale of this warp's group, and the block's largest (absent tokens
    // are zero-filled; a block with none positive keeps o_norm).
    auto scale_of = [&](int tok) {
      return *reinterpret_cast<const float*>(raw + tok * kPitch + 512 + 4 * group);
    };
    float blk_norm = 1.0f;
    if constexpr (kBlock) {
      float m = fmaxf(scale_of(lane), scale_of(lane + 32));
#pragma unroll
      for (int x = 16; x >= 1; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
      blk_norm = m > 0.0f ? m : o_norm;
    }

    // ---- S = Q K^T: the warp's 64 nope dims for all 64 tokens (8 independent chains of 4
    // mma), rope for its own 8 tokens; partial sums meet in shared memory ----
    // n-tile n, fragment column g: token 8 n + g / 2 + 4 (g % 2) (bank-conflict free reads).
    // The codes of the next two n-tiles (then the rope's) are read before this pair's products
    // so their latency hides behind the mma chains: the compiler keeps the reads after the
    // partial-sum stores otherwise (it cannot tell the two regions apart), and every read waits.
    const std::uint8_t* k_col = raw + k_tok * kPitch + 64 * warp + 16 * tq;
    auto k_read = [&](int n) { return *reinterpret_cast<const uint4*>(k_col + 8 * n * kPitch); };
    // The rope's K: fp8 16 bytes, block bf16 twice 16 bytes, 64 apart.
    const std::uint8_t* rope_k = raw + (8 * warp + k_tok) * kPitch + (kBlock ? 528 : 512) + 16 * tq;
    uint4 kv0 = k_read(n_first), kv1 = k_read(n_first + 1);
    float acc_pe[4] = {};
    float keep[4][4];  // block: the partial sums of the n-tiles this warp owns
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
      const int n = (n_first + i) % 8;
      uint4 nx0, nx1 = make_uint4(0, 0, 0, 0);
      if (i + 2 < 8) {
        nx0 = k_read((n + 2) % 8), nx1 = k_read((n + 3) % 8);
      } else {
        nx0 = *reinterpret_cast<const uint4*>(rope_k);
        if constexpr (kBlock) nx1 = *reinterpret_cast<const uint4*>(rope_k + 64);
      }
      const std::uint32_t w0[4] = {kv0.x, kv0.y, kv0.z, kv0.w};
      const std::uint32_t w1[4] = {kv1.x, kv1.y, kv1.z, kv1.w};
      float acc0[4] = {}, acc1[4] = {};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint32_t b0, b1, c0, c1;
        fp8x4_to_half2x2(w0[j], b0, b1);
        fp8x4_to_half2x2(w1[j], c0, c1);
        mma_16816<false>(acc0, qn[j], b0, b1);
        mma_16816<false>(acc1, qn[j], c0, c1);
      }
      if (!kBlock || i < 4) {
        *reinterpret_cast<float4*>(part_st + n * 128) =
            make_float4(acc0[0], acc0[1], acc0[2], acc0[3]);
        *reinterpret_cast<float4*>(part_st + (n + 1) * 128) =
            make_float4(acc1[0], acc1[1], acc1[2], acc1[3]);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) keep[i - 4][c] = acc0[c], keep[i - 3][c] = acc1[c];
      }
      kv0 = nx0, kv1 = nx1;
    }
    if constexpr (kBlock) {
      const std::uint32_t w[8] = {kv0.x, kv0.y, kv0.z, kv0.w, kv1.x, kv1.y, kv1.z, kv1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint32_t a[4];
        ldmatrix_x4(a, smem + L::kQRope + (lane % 16) * L::kQRopePitch + 32 * j + (lane / 16) * 16);
        mma_16816<true>(acc_pe, a, w[2 * j], w[2 * j + 1]);
      }
    } else {
      const std::uint32_t w[4] = {kv0.x, kv0.y, kv0.z, kv0.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint32_t b0, b1;
        fp8x4_to_half2x2(w[j], b0, b1);
        mma_16816<false>(acc_pe, qr[j], b0, b1);
      }
    }
    __syncthreads();
    if constexpr (kBlock) {
      // The owner adds its partner's half and scales by the tokens' group scales (columns
      // 2 tq, 2 tq + 1: tokens 8 n + tq, 8 n + tq + 4).
      const int own = warp % 2 == 0 ? 0 : 4;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int n = own + k;
        float4* slot = reinterpret_cast<float4*>(part_st + n * 128);
        const float4 v = *slot;
        const float sa = scale_of(8 * n + tq), sb = scale_of(8 * n + tq + 4);
        *slot = make_float4((v.x + keep[k][0]) * sa, (v.y + keep[k][1]) * sb,
                            (v.z + keep[k][2]) * sa, (v.w + keep[k][3]) * sb);
      }
      __syncthreads();
    }
    float nope[4] = {};
#pragma unroll
    for (int w = 0; w < L::kSlots; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(part_ld + w * 1024);
      nope[0] += v.x, nope[1] += v.y, nope[2] += v.z, nope[3] += v.w;
    }

    // ---- scores, masks, row max over the block ----
    const int j0 = t.kv_begin + blk * kBlockN;
    const bool ok_a = flags[tok_a] != 0, ok_b = flags[tok_b] != 0;
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = i / 2;
      const bool b = i % 2 == 1;
      const bool ok = (b ? ok_b : ok_a) && j0 + (b ? tok_b : tok_a) <= limit[h];
      // Block: the nope sums carry the token scales, the bf16 rope products no q scale.
      const float sc = kBlock ? nope[i] * p.scale_nope * q_inv[h] + acc_pe[i] * p.scale_pe
                              : (nope[i] * p.scale_nope + acc_pe[i] * p.scale_pe) * q_inv[h];
      s[i] = ok ? sc : -INFINITY;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[2 * h], s[2 * h + 1]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (tq == 0) red_max[(g + 8 * h) * kWarps + warp] = mx;  // [row][warp]: 2 reads a row
    }
    __syncthreads();

    // ---- online softmax: P = exp2(s - m_new) into shared memory, rescale O and the sums ----
    // Block: O moves from units of o_norm to units of this block's blk_norm.
    const float to_block = kBlock ? o_norm / blk_norm : 1.0f;
    o_norm = blk_norm;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;
      static_assert(kWarps == 8, "two float4 reads per row");
      const float4 m0 = *reinterpret_cast<const float4*>(red_max + r * kWarps);
      const float4 m1 = *reinterpret_cast<const float4*>(red_max + r * kWarps + 4);
      const float mx = fmaxf(fmaxf(fmaxf(fmaxf(m0.x, m0.y), fmaxf(m0.z, m0.w)),
                                   fmaxf(fmaxf(m1.x, m1.y), fmaxf(m1.z, m1.w))),
                             row_max[h]);
      const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
      const float alpha = fast_exp2(row_max[h] - base);
      row_max[h] = mx;
      const __half pa = __float2half_rn(fast_exp2(s[2 * h] - base));
      const __half pb = __float2half_rn(fast_exp2(s[2 * h + 1] - base));
      p_s[r * kPElems + tok_a] = __half_as_ushort(pa);
      p_s[r * kPElems + tok_b] = __half_as_ushort(pb);
      // Sum what the tensor cores multiply (the rounded p), so o / l stays exact.
      row_sum[h] = row_sum[h] * alpha + (__half2float(pa) + __half2float(pb));
      ops::rescale_rows(o, h, kBlock ? alpha * to_block : alpha);
    }
    __syncthreads();

    // ---- O += P V: the warp's columns 64 warp + [0, 64); n-tile n, fragment column g is
    // column 64 warp + 8 g + n, so one 8-byte read per token covers the thread's 8 n-tiles ----
    const float inv_norm = kBlock ? 1.0f / blk_norm : 1.0f;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      const std::uint8_t* v_col = raw + 64 * warp + 8 * g;
      const int tk = 16 * kk + 2 * tq;  // tokens tk, tk + 1 (b0) and tk + 8, tk + 9 (b1)
      if constexpr (kBlock) {
        // P's columns tk, tk + 1 (a[0], a[1]) and tk + 8, tk + 9 (a[2], a[3]) times the tokens'
        // scales over blk_norm (<= 1: no fp16 overflow).
        const std::uint32_t f01 =
            float2_to_half2(scale_of(tk) * inv_norm, scale_of(tk + 1) * inv_norm);
        const std::uint32_t f89 =
            float2_to_half2(scale_of(tk + 8) * inv_norm, scale_of(tk + 9) * inv_norm);
        a[0] = ops::hmul2(a[0], f01), a[1] = ops::hmul2(a[1], f01);
        a[2] = ops::hmul2(a[2], f89), a[3] = ops::hmul2(a[3], f89);
      }
      const uint2 x0 = *reinterpret_cast<const uint2*>(v_col + tk * kPitch);
      const uint2 x1 = *reinterpret_cast<const uint2*>(v_col + (tk + 1) * kPitch);
      const uint2 x8 = *reinterpret_cast<const uint2*>(v_col + (tk + 8) * kPitch);
      const uint2 x9 = *reinterpret_cast<const uint2*>(v_col + (tk + 9) * kPitch);
      ops::pv_step(o, a, x0, x1, x8, x9);
    }
  }

  // ---- epilogue: row sums over the quad and the warps, then o / l and lse ----
  float* red_sum = reinterpret_cast<float*>(smem + kRed);
  __syncthreads();  // red_max (same memory) is no longer read
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (tq == 0) red_sum[warp * kRows + g + 8 * h] = sum;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    if (r >= rows) continue;
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) l += red_sum[w * kRows + r];
    ops::write_row(p, t, tile, warp, tq, h, r, o,
                   ops::finish_row(row_max[h], l, kBlock ? p.out_scale * o_norm : p.out_scale));
  }
}

}  // namespace fp8mla::detail::fp8_exact
