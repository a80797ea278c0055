// The portable decode family: every KvFormat, tiles of 16, 32 or 64 rows (heads x query tokens),
// dense page tables of any page size, sparse index lists, split-KV partials, on every GPU from
// sm_80 to sm_120, written only in instructions they share (cp.async, ldmatrix, mma.sync).
//
// One idea: convert the cache's codes where they are multiplied, never into a tile. Each block of
// 64 / MT tokens is copied raw (cp.async, 16 bytes a thread) into padded rows; S = Q K^T reads the
// codes from those rows straight into mma B fragments (fp16 from e4m3 codes, bf16 as stored, or
// e4m3 as stored for fp8 products on sm_89+), and O += P V does the same for V. Q sits in shared
// memory once per tile (fp16 rows scaled by a power of two, bf16, or two e4m3 terms). fp16
// queries over a bf16 cache (Scores::bf16x2) keep Q and P in fp16 and split each fragment into
// two bf16 terms where it multiplies: twice the tensor work, fp16-exact products.
//
// Invariants: 8 warps. S: warp (h, pair) multiplies its pair's 16 tokens (two n-tiles) over half
// of the 576 dims (nope 256 h .. 256 h + 255 and rope 32 h .. 32 h + 31), so each Q read serves
// two n-tiles; the halves meet through a 4 KB exchange, each warp finishing one n-tile. P V:
// warp w owns output columns 64 w .. 64 w + 63 of every row. Shared memory <= 99 KB with one
// stage (config.h); a thread's S token of n-tile column g is g / 2 + 4 (g % 2), which with the
// row pitches keeps every read bank-conflict free.
#pragma once

#include <cfloat>
#include <cstdint>

#include "src/cuda/decode/portable/config.h"
#include "src/cuda/decode/portable/convert.cuh"
#include "src/cuda/decode/portable/scores.cuh"
#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/epilogue.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/softmax.cuh"
#include "src/cuda/ops/sync.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::portable {

__device__ __forceinline__ std::uint32_t dynamic_smem_bytes() {
  std::uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(n));
  return n;
}

// Block `blk`'s copies by this thread: chunks sub, sub + kPerToken, ... of its token `tok`
// (slot from entry_slot_of; -1 zero-fills the row and flags it 0).
template <KvFormat F, class C>
__device__ __forceinline__ void copy_token(const DecodeParams& p, std::int64_t slot,
                                           std::uint8_t* row, std::uint8_t* flag, int sub) {
  const ops::TokenAddr a = ops::slot_addr(p, slot);
  const bool valid = a.ckv != nullptr;
  constexpr int kCkvChunks = F == KvFormat::fp8_e4m3 ? 32 : F == KvFormat::bf16 ? 64 : 41;
  if (sub == 0) *flag = valid ? 1 : 0;
#pragma unroll
  for (int c = sub; c < C::kChunks; c += C::kPerToken) {
    const std::uint8_t* src = c < kCkvChunks ? a.ckv + 16 * c : a.kpe + 16 * (c - kCkvChunks);
    cp_async_16(row + 16 * c, valid ? src : p.ckv, valid);  // p.ckv: mapped, for the zero fill
  }
}

// V's B fragments for 16 tokens (tk = 16 kk + 2 tq, + 1, + 8, + 9) of this thread's 8 columns
// 64 warp + 8 g + n (one per n-tile): byte permutes pair two tokens' codes of a column.
__device__ __forceinline__ void v_fragments(const std::uint8_t* v_col, int pitch, int tk,
                                            std::uint32_t (&b0)[8], std::uint32_t (&b1)[8]) {
  const uint2 x0 = *reinterpret_cast<const uint2*>(v_col + tk * pitch);
  const uint2 x1 = *reinterpret_cast<const uint2*>(v_col + (tk + 1) * pitch);
  const uint2 x8 = *reinterpret_cast<const uint2*>(v_col + (tk + 8) * pitch);
  const uint2 x9 = *reinterpret_cast<const uint2*>(v_col + (tk + 9) * pitch);
  e4m3x4_to_half2x2(__byte_perm(x0.x, x1.x, 0x5140), b0[0], b0[1]);
  e4m3x4_to_half2x2(__byte_perm(x0.x, x1.x, 0x7362), b0[2], b0[3]);
  e4m3x4_to_half2x2(__byte_perm(x0.y, x1.y, 0x5140), b0[4], b0[5]);
  e4m3x4_to_half2x2(__byte_perm(x0.y, x1.y, 0x7362), b0[6], b0[7]);
  e4m3x4_to_half2x2(__byte_perm(x8.x, x9.x, 0x5140), b1[0], b1[1]);
  e4m3x4_to_half2x2(__byte_perm(x8.x, x9.x, 0x7362), b1[2], b1[3]);
  e4m3x4_to_half2x2(__byte_perm(x8.y, x9.y, 0x5140), b1[4], b1[5]);
  e4m3x4_to_half2x2(__byte_perm(x8.y, x9.y, 0x7362), b1[6], b1[7]);
}

// Whether this compilation's architecture runs fp8 products at `rows` rows: sm_89 and sm_12x in
// hardware; sm_90 and sm_100 (where ptxas emulates mma.sync e4m3 with fp16 products) at 16 rows
// only, which is how the GPU tests exercise the form on Hopper (at 32 and 64 rows the emulation
// spills registers); never below sm_89. The dispatch table asks for no other.
template <int MT>
__device__ constexpr bool fp8_products_compiled() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 890 || __CUDA_ARCH__ >= 1200)
  return true;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return MT == 1;
#else
  return false;
#endif
}

template <KvFormat F, int MT, Scores kScores>
__device__ __forceinline__ void portable_decode(const DecodeParams& p);

template <KvFormat F, int MT, Scores kScores>
__global__ void __launch_bounds__(kThreads, Config<F, MT, kScores>::kMinBlocks)
    portable_decode_kernel(const DecodeParams p) {
  if constexpr (kScores == Scores::e4m3 && !fp8_products_compiled<MT>()) {
    __trap();
  } else {
    portable_decode<F, MT, kScores>(p);
  }
}

template <KvFormat F, int MT, Scores kScores>
__device__ __forceinline__ void portable_decode(const DecodeParams& p) {
  using C = Config<F, MT, kScores>;
  constexpr int kBlockN = C::kBlockN;
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  ops::begin_after_previous_kernel();
  extern __shared__ __align__(16) std::uint8_t smem[];
  const int stages = dynamic_smem_bytes() >= static_cast<std::uint32_t>(C::bytes(2)) ? 2 : 1;
  const WorkTile t = tile.tile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  const int rows = t.q_count * t.head_count;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  // ---- copies: thread c_sub of its token c_tok; page-table entries read a block ahead ----
  const int c_tok = threadIdx.x / C::kPerToken, c_sub = threadIdx.x % C::kPerToken;
  std::int32_t next_entry =
      ops::token_entry_of<kBlockN>(p, t, tile.q_first, tile.kv_base, 0, c_tok);
  auto issue = [&](int blk) {
    const int stage = blk % stages;
    const std::int64_t slot = ops::entry_slot_of<kBlockN>(p, t, blk, next_entry, c_tok);
    next_entry = ops::token_entry_of<kBlockN>(p, t, tile.q_first, tile.kv_base, blk + 1, c_tok);
    copy_token<F, C>(p, slot, smem + C::kStages0 + stage * C::kStageBytes + c_tok * C::kPitch,
                     smem + C::kFlags + stage * kBlockN + c_tok, c_sub);
  };
  if (n_blocks > 0) issue(0);
  cp_async_commit();
  load_q<F, MT, kScores>(p, t, tile.q_first, smem);

  // ---- roles: S warp (h, pair) -> m-tile mi, token group tg; it finishes n-tile 2 tg + h ----
  const int h = warp / 4, pair = warp % 4;
  const int mi = pair / C::kGroups, tg = pair % C::kGroups;
  const int slot_of_warp = h * C::kGroups + tg;  // its index among the m-tile's sharers
  const int rg = 16 * mi + g;                     // its S rows rg, rg + 8
  const int nt = 2 * tg + h;
  const int tok_a = 8 * nt + tq, tok_b = tok_a + 4;  // the tokens of its S columns
  const float* q_inv_s = reinterpret_cast<const float*>(smem + C::kQInv);
  const float q_inv[2] = {q_inv_s[rg], q_inv_s[rg + 8]};
  const int limit[2] = {ops::row_limit(p, t, rg, tile.kv_len, tile.qo_len),
                        ops::row_limit(p, t, rg + 8, tile.kv_len, tile.qo_len)};

  float row_max[MT][2], o[MT][8][4];
  float row_sum[2] = {0.0f, 0.0f};  // the S rows, this thread's tokens only
  float vmax = 0.0f;                // block format: the largest |scale| of this warp's columns
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
#pragma unroll
    for (int n = 0; n < 8; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.0f;
  }
  float* red_max = reinterpret_cast<float*>(smem + C::kRedMax);
  float* red_sum = reinterpret_cast<float*>(smem + C::kRedSum);
  float4* xch = reinterpret_cast<float4*>(smem + C::kPX);
  std::uint8_t* p_s = smem + C::kPX;

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % stages;
    if (stages == 2) {
      if (blk + 1 < n_blocks) issue(blk + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // block blk landed for every thread
    const std::uint8_t* raw = smem + C::kStages0 + stage * C::kStageBytes;
    const std::uint8_t* flags = smem + C::kFlags + stage * kBlockN;

    // ---- S: this warp's half of the dims for its pair's two n-tiles; halves meet ----
    float sp[2][4];
    half_scores<F, MT, kScores>(p, smem, raw, h, tg, rg, tq, q_inv, sp);
    xch[(pair * 2 + 1 - h) * 32 + lane] =
        h == 0 ? make_float4(sp[1][0], sp[1][1], sp[1][2], sp[1][3])
               : make_float4(sp[0][0], sp[0][1], sp[0][2], sp[0][3]);
    __syncthreads();
    const float4 other = xch[(pair * 2 + h) * 32 + lane];
    const int j0 = t.kv_begin + blk * kBlockN;
    const bool ok_tok[2] = {flags[tok_a] != 0, flags[tok_b] != 0};
    const float oth[4] = {other.x, other.y, other.z, other.w};
    float s[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int k = i % 2;
      const bool ok = ok_tok[k] && j0 + (k ? tok_b : tok_a) <= limit[i / 2];
      s[i] = ok ? (h == 0 ? sp[0][i] : sp[1][i]) + oth[i] : -INFINITY;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(s[2 * r], s[2 * r + 1]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (tq == 0) red_max[(rg + 8 * r) * C::kSharers + slot_of_warp] = mx;
    }
    __syncthreads();  // red_max complete; the exchange is read (P reuses its memory)

    // ---- online softmax: new row maxima for every row this thread multiplies ----
    float alpha[MT][2], base_s[2] = {0.0f, 0.0f}, alpha_s[2] = {1.0f, 1.0f};
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float* red = red_max + (16 * m + g + 8 * r) * C::kSharers;
        float mx = row_max[m][r];
#pragma unroll
        for (int sl = 0; sl < C::kSharers; ++sl) mx = fmaxf(mx, red[sl]);
        const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
        alpha[m][r] = fast_exp2(row_max[m][r] - base);
        row_max[m][r] = mx;
        if (m == mi) base_s[r] = base, alpha_s[r] = alpha[m][r];
      }
    // P of the S rows' tokens, and their running sums.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = rg + 8 * r;
      const float pa = fast_exp2(s[2 * r] - base_s[r]), pb = fast_exp2(s[2 * r + 1] - base_s[r]);
      float sum;
      if constexpr (F == KvFormat::bf16 && kScores != Scores::bf16x2) {
        const __nv_bfloat16 ra = __float2bfloat16_rn(pa), rb = __float2bfloat16_rn(pb);
        __nv_bfloat16* pr = reinterpret_cast<__nv_bfloat16*>(p_s + row * C::kPPitch);
        pr[tok_a] = ra, pr[tok_b] = rb;
        sum = pa + pb;  // the fp32 p, before the bf16 rounding (ops::add_sums says why)
      } else {
        const __half ra = __float2half_rn(pa), rb = __float2half_rn(pb);
        __half* pr = reinterpret_cast<__half*>(p_s + row * C::kPPitch);
        pr[tok_a] = ra, pr[tok_b] = rb;
        sum = __half2float(ra) + __half2float(rb);  // fp16 P's rounding moves the LSE < 2.5e-4
      }
      row_sum[r] = row_sum[r] * alpha_s[r] + sum;
    }
    // Block format: this warp's columns lie in 128-column block warp / 2; P is scaled by each
    // token's scale of that block over the largest seen (vmax), and O kept in units of vmax.
    float v_ratio = 1.0f;
    if constexpr (F == KvFormat::fp8_e4m3_block) {
      float vm = 0.0f;
      for (int k = lane; k < kBlockN; k += 32)
        vm = fmaxf(vm, fabsf(*reinterpret_cast<const float*>(raw + k * C::kPitch + 512 +
                                                            4 * (warp / 2))));
#pragma unroll
      for (int x = 16; x >= 1; x /= 2) vm = fmaxf(vm, __shfl_xor_sync(0xffffffffu, vm, x));
      if (vm > vmax) {
        v_ratio = vmax / vm;
        vmax = vm;
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float a = alpha[m][r] * v_ratio;
        if (__any_sync(0xffffffffu, a != 1.0f)) {
#pragma unroll
          for (int n = 0; n < 8; ++n) o[m][n][2 * r] *= a, o[m][n][2 * r + 1] *= a;
        }
      }
    __syncthreads();  // P complete

    // ---- O += P V: columns 64 warp + [0, 64) of every row ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      if constexpr (F == KvFormat::bf16) {
        // bf16x2: P is fp16, each fragment split into its two bf16 terms (a, then a_lo).
        constexpr bool kSplit = kScores == Scores::bf16x2;
        std::uint32_t a[MT][4], a_lo[kSplit ? MT : 1][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          ldmatrix_x4(a[m], p_s + (16 * m + lane % 16) * C::kPPitch + 2 * (16 * kk + (lane / 16) * 8));
          if constexpr (kSplit) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
              ops::half2_to_bf16x2_terms(a[m][i], a[m][i], a_lo[m][i]);
          }
        }
        const int v_tok = 16 * kk + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          std::uint32_t b[4];
          ldmatrix_x4_trans(b, raw + v_tok * C::kPitch + 2 * (64 * warp + 16 * np + (lane / 16) * 8));
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_16816<true>(o[m][2 * np], a[m], b[0], b[1]);
            mma_16816<true>(o[m][2 * np + 1], a[m], b[2], b[3]);
            if constexpr (kSplit) {
              mma_16816<true>(o[m][2 * np], a_lo[m], b[0], b[1]);
              mma_16816<true>(o[m][2 * np + 1], a_lo[m], b[2], b[3]);
            }
          }
        }
      } else {
        const int tk = 16 * kk + 2 * tq;
        std::uint32_t b0[8], b1[8];
        v_fragments(raw + 64 * warp + 8 * g, C::kPitch, tk, b0, b1);
        // Block format: P times each token's scale of this warp's block over vmax (in
        // [-1, 1]): the pairs of tokens tk, tk + 1 and tk + 8, tk + 9.
        std::uint32_t ratio[2] = {};
        if constexpr (F == KvFormat::fp8_e4m3_block) {
          const float inv = vmax > 0.0f ? 1.0f / vmax : 0.0f;
          auto scale_of = [&](int tok) {
            return *reinterpret_cast<const float*>(raw + tok * C::kPitch + 512 + 4 * (warp / 2)) *
                   inv;
          };
          ratio[0] = float2_to_half2(scale_of(tk), scale_of(tk + 1));
          ratio[1] = float2_to_half2(scale_of(tk + 8), scale_of(tk + 9));
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          std::uint32_t a[4];
          ldmatrix_x4(a, p_s + (16 * m + lane % 16) * C::kPPitch + 2 * (16 * kk + (lane / 16) * 8));
          if constexpr (F == KvFormat::fp8_e4m3_block) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // a0, a1: tokens tk, tk + 1; a2, a3: tk + 8, tk + 9
              const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&a[q]),
                                        *reinterpret_cast<const __half2*>(&ratio[q / 2]));
              a[q] = *reinterpret_cast<const std::uint32_t*>(&v);
            }
          }
#pragma unroll
          for (int n = 0; n < 8; ++n) mma_16816<false>(o[m][n], a, b0[n], b1[n]);
        }
      }
    }
    __syncthreads();  // the stage and P are rewritten next
    if (stages == 1 && blk + 1 < n_blocks) {
      issue(blk + 1);
      cp_async_commit();
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: row sums over the quad and the m-tile's sharers, then o / l and lse ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (tq == 0) red_sum[(rg + 8 * r) * C::kSharers + slot_of_warp] = sum;
  }
  __syncthreads();
  float out_scale = p.out_scale;
  if constexpr (F != KvFormat::bf16) out_scale *= code_scale();
  if constexpr (F == KvFormat::fp8_e4m3_block) out_scale *= vmax;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * m + g + 8 * r;
      if (row >= rows) continue;
      float l = 0.0f;
#pragma unroll
      for (int sl = 0; sl < C::kSharers; ++sl) l += red_sum[row * C::kSharers + sl];
      const ops::RowEnd end = ops::finish_row(row_max[m][r], l, out_scale);
      if constexpr (F == KvFormat::bf16) {
        ops::write_row_trans(p, t, tile, warp, tq, r, row, o[m], end);
      } else {
        ops::write_row(p, t, tile, warp, tq, r, row, o[m], end);
      }
    }
}

}  // namespace fp8mla::detail::portable
