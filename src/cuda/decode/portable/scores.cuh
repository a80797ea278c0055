// The portable family's scores: Q into shared memory as the products want it (load_q) and one
// warp's half of S = Q K^T from the staged token rows (half_scores), for each Scores form
// (config.h). kernel.cuh runs them.
#pragma once

#include <cstdint>

#include "src/cuda/decode/portable/config.h"
#include "src/cuda/decode/portable/convert.cuh"
#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::portable {

// D (16 x 8 fp32) += A (16 x 32 e4m3, the m16n8k32 A fragment) * B (32 x 8 e4m3). sm_89+.
__device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], const std::uint32_t (&a)[4],
                                               std::uint32_t b0, std::uint32_t b1) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
#endif
}

__device__ __forceinline__ void words(const uint4 v, std::uint32_t (&w)[4]) {
  w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
}

// Q rows of the tile into shared memory as the scores multiply them; 2^-e of each row's scale
// into q_inv. Rows past the tile are zeros. Ends with a barrier.
template <KvFormat F, int MT, Scores kScores>
__device__ __forceinline__ void load_q(const DecodeParams& p, const WorkTile& t, int q_first,
                                       std::uint8_t* smem) {
  using C = Config<F, MT, kScores>;
  constexpr int kPerRow = kThreads / C::kRows;  // threads a row: 16, 8, 4
  const int rows = t.q_count * t.head_count;
  const int r = threadIdx.x / kPerRow, part = threadIdx.x % kPerRow;
  const std::int64_t tok = q_first + r / t.head_count, head = t.head_begin + r % t.head_count;
  const __nv_bfloat16* nope = p.q_nope + tok * p.q_nope_stride[0] + head * p.q_nope_stride[1];
  const __nv_bfloat16* pe = p.q_pe + tok * p.q_pe_stride[0] + head * p.q_pe_stride[1];
  // 8 dims: nope chunks 0..63, rope 64..71; bf16 (fp16 rounded to it), but bf16x2 keeps fp16.
  auto chunk = [&](int c) {
    if (r >= rows) return make_uint4(0, 0, 0, 0);
    const uint4 v = *reinterpret_cast<const uint4*>(c < 64 ? nope + 8 * c : pe + 8 * (c - 64));
    return kScores == Scores::bf16x2 ? v : ops::q_as_bf16(v, p.q_f16);
  };
  // The row's scale 2^e: fp16 products put max |q| in [2^14, 2^15), e4m3 terms in [2^7, 2^8);
  // the block format scales its nope dims only (its rope multiplies bf16 by bf16).
  int e = 0;
  if constexpr (F != KvFormat::bf16) {
    constexpr int kScaled = F == KvFormat::fp8_e4m3_block ? 64 : 72;
    std::uint32_t m = 0;
    for (int c = part; c < kScaled; c += kPerRow) m = max(m, ops::abs_max_bits(chunk(c)));
#pragma unroll
    for (int x = kPerRow / 2; x >= 1; x /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, x));
    e = ops::q_row_exponent(__uint_as_float(m)) - (kScores == Scores::e4m3 ? 7 : 0);
  }
  const float scale = ops::exp2i(e);
  std::uint8_t* row = smem + C::kQ + r * C::kQPitch;
  for (int c = part; c < 72; c += kPerRow) {
    const uint4 v = chunk(c);
    std::uint32_t w[4];
    words(v, w);
    if constexpr (kScores == Scores::e4m3) {
      // q = hi + lo with hi = e4m3(q), lo = e4m3(q - hi): after the row scale (max |q| in
      // [2^7, 2^8)) q keeps ~8 significant bits down to 2^-9 (lo's smallest subnormal), and
      // both terms multiply into one accumulator.
      std::uint32_t hi[2], lo[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        std::uint16_t h2[2], l2[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float2 f = bf16x2_to_float2(w[2 * k + i]);
          const float2 q = make_float2(f.x * scale, f.y * scale);
          h2[i] = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3);
          const float2 hf = fp8x2_to_float2(h2[i]);
          l2[i] = __nv_cvt_float2_to_fp8x2(make_float2(q.x - hf.x, q.y - hf.y), __NV_SATFINITE,
                                           __NV_E4M3);
        }
        hi[k] = h2[0] | static_cast<std::uint32_t>(h2[1]) << 16;
        lo[k] = l2[0] | static_cast<std::uint32_t>(l2[1]) << 16;
      }
      *reinterpret_cast<uint2*>(row + 8 * c) = make_uint2(hi[0], hi[1]);
      *reinterpret_cast<uint2*>(row + C::kRows * C::kQPitch + 8 * c) = make_uint2(lo[0], lo[1]);
    } else if (F == KvFormat::bf16 || (F == KvFormat::fp8_e4m3_block && c >= 64)) {
      *reinterpret_cast<uint4*>(row + 16 * c) = v;
    } else {
      *reinterpret_cast<uint4*>(row + 16 * c) =
          make_uint4(ops::scale_to_half2(w[0], scale), ops::scale_to_half2(w[1], scale),
                     ops::scale_to_half2(w[2], scale), ops::scale_to_half2(w[3], scale));
    }
  }
  if (part == 0) reinterpret_cast<float*>(smem + C::kQInv)[r] = ops::exp2i(-e);
  __syncthreads();
}

// This warp's partial scores for its half of the dims: sp[n][i] for n-tile n of its pair
// (fragment (row, column) as mma's D; column 2 tq + k is token tq + 4 k of the n-tile), already
// multiplied by the scales, so the two halves add.
template <KvFormat F, int MT, Scores kScores>
__device__ __forceinline__ void half_scores(const DecodeParams& p, const std::uint8_t* smem,
                                            const std::uint8_t* raw, int h, int tg, int rg,
                                            int tq, const float (&q_inv)[2], float (&sp)[2][4]) {
  using C = Config<F, MT, kScores>;
  const int g = (threadIdx.x % 32) / 4;
  const int k_tok = g / 2 + 4 * (g % 2);
  const std::uint8_t* krow[2] = {raw + (16 * tg + k_tok) * C::kPitch,
                                 raw + (16 * tg + 8 + k_tok) * C::kPitch};
  const std::uint8_t* qa = smem + C::kQ + rg * C::kQPitch;  // rows rg and rg + 8
  const std::uint8_t* qb = qa + 8 * C::kQPitch;
  float nope[2][2][4] = {}, pe[2][4] = {};  // [n-tile][chain or 128-dim block]
  if constexpr (kScores == Scores::e4m3) {
    // Q's hi and lo terms multiply the same codes into the same accumulators. At 64 rows the
    // two n-tiles go one after the other (their O holds 128 registers), re-reading Q.
    constexpr int kLo = C::kRows * C::kQPitch;
    constexpr int kPasses = MT == 4 ? 2 : 1;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int n0 = kPasses == 2 ? pass : 0, n1 = kPasses == 2 ? pass + 1 : 2;
#pragma unroll
      for (int G = 0; G < 5; ++G) {  // four 64-dim nope groups, then the rope's 32 dims
        const int d0 = G < 4 ? 256 * h + 64 * G + 16 * tq : 512 + 32 * h + 8 * tq;
        std::uint32_t ha[4], hb[4], la[4], lb[4], k[2][4];
        if (G < 4) {
          words(*reinterpret_cast<const uint4*>(qa + d0), ha);
          words(*reinterpret_cast<const uint4*>(qb + d0), hb);
          words(*reinterpret_cast<const uint4*>(qa + kLo + d0), la);
          words(*reinterpret_cast<const uint4*>(qb + kLo + d0), lb);
#pragma unroll
          for (int n = n0; n < n1; ++n) words(*reinterpret_cast<const uint4*>(krow[n] + d0), k[n]);
        } else {
          const uint2 a2 = *reinterpret_cast<const uint2*>(qa + d0);
          const uint2 b2 = *reinterpret_cast<const uint2*>(qb + d0);
          const uint2 la2 = *reinterpret_cast<const uint2*>(qa + kLo + d0);
          const uint2 lb2 = *reinterpret_cast<const uint2*>(qb + kLo + d0);
          ha[0] = a2.x, ha[1] = a2.y, hb[0] = b2.x, hb[1] = b2.y;
          la[0] = la2.x, la[1] = la2.y, lb[0] = lb2.x, lb[1] = lb2.y;
#pragma unroll
          for (int n = n0; n < n1; ++n) {
            const uint2 k2 = *reinterpret_cast<const uint2*>(krow[n] + d0);
            k[n][0] = k2.x, k[n][1] = k2.y;
          }
        }
#pragma unroll
        for (int j = 0; j < (G < 4 ? 2 : 1); ++j) {
          const std::uint32_t ah[4] = {ha[2 * j], hb[2 * j], ha[2 * j + 1], hb[2 * j + 1]};
          const std::uint32_t al[4] = {la[2 * j], lb[2 * j], la[2 * j + 1], lb[2 * j + 1]};
#pragma unroll
          for (int n = n0; n < n1; ++n) {
            float(&acc)[4] = G < 4 ? nope[n][j] : pe[n];
            mma_16832_e4m3(acc, ah, k[n][2 * j], k[n][2 * j + 1]);
            mma_16832_e4m3(acc, al, k[n][2 * j], k[n][2 * j + 1]);
          }
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sp[n][i] =
            ((nope[n][0][i] + nope[n][1][i]) * p.scale_nope + pe[n][i] * p.scale_pe) * q_inv[i / 2];
  } else if constexpr (F == KvFormat::bf16) {
    // bf16 codes as stored: 16 bytes are 8 dims, two k-steps.
#pragma unroll
    for (int G = 0; G < 9; ++G) {  // eight 32-dim nope groups, then the rope's 32 dims
      const int d0 = G < 8 ? 256 * h + 32 * G + 8 * tq : 512 + 32 * h + 8 * tq;
      std::uint32_t a[4], b[4], k[2][4];
      words(*reinterpret_cast<const uint4*>(qa + 2 * d0), a);
      words(*reinterpret_cast<const uint4*>(qb + 2 * d0), b);
#pragma unroll
      for (int n = 0; n < 2; ++n) words(*reinterpret_cast<const uint4*>(krow[n] + 2 * d0), k[n]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const std::uint32_t af[4] = {a[2 * j], b[2 * j], a[2 * j + 1], b[2 * j + 1]};
        if constexpr (kScores == Scores::bf16x2) {  // fp16 Q: its two bf16 terms
          std::uint32_t hi[4], lo[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) ops::half2_to_bf16x2_terms(af[i], hi[i], lo[i]);
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            float(&acc)[4] = G < 8 ? nope[n][G % 2] : pe[n];
            mma_16816<true>(acc, hi, k[n][2 * j], k[n][2 * j + 1]);
            mma_16816<true>(acc, lo, k[n][2 * j], k[n][2 * j + 1]);
          }
        } else {
#pragma unroll
          for (int n = 0; n < 2; ++n)
            mma_16816<true>(G < 8 ? nope[n][G % 2] : pe[n], af, k[n][2 * j], k[n][2 * j + 1]);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sp[n][i] = (nope[n][0][i] + nope[n][1][i]) * p.scale_nope + pe[n][i] * p.scale_pe;
  } else {
    // e4m3 codes -> fp16 B fragments: 16 bytes are 16 dims, four k-steps. fp8_e4m3: two chains;
    // the block format: one accumulator per 128-dim block (its scale differs per token).
#pragma unroll
    for (int G = 0; G < 4; ++G) {
      const int d0 = 256 * h + 64 * G + 16 * tq;
      // Q: 16 fp16 dims of rows rg and rg + 8 (32 bytes each).
      const uint4 a0 = *reinterpret_cast<const uint4*>(qa + 2 * d0);
      const uint4 a1 = *reinterpret_cast<const uint4*>(qa + 2 * d0 + 16);
      const uint4 b0v = *reinterpret_cast<const uint4*>(qb + 2 * d0);
      const uint4 b1v = *reinterpret_cast<const uint4*>(qb + 2 * d0 + 16);
      const std::uint32_t a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const std::uint32_t b[8] = {b0v.x, b0v.y, b0v.z, b0v.w, b1v.x, b1v.y, b1v.z, b1v.w};
      std::uint32_t k[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n) words(*reinterpret_cast<const uint4*>(krow[n] + d0), k[n]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const std::uint32_t af[4] = {a[2 * j], b[2 * j], a[2 * j + 1], b[2 * j + 1]};
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          std::uint32_t b0, b1;
          e4m3x4_to_half2x2(k[n][j], b0, b1);
          mma_16816<false>(nope[n][F == KvFormat::fp8_e4m3 ? j % 2 : G / 2], af, b0, b1);
        }
      }
    }
    if constexpr (F == KvFormat::fp8_e4m3) {
      // Rope: 8 codes (two k-steps) at 512 + 32 h + 8 tq; Q's rope in fp16 like its nope.
      const int d0 = 512 + 32 * h + 8 * tq;
      std::uint32_t a[4], b[4];
      words(*reinterpret_cast<const uint4*>(qa + 2 * d0), a);
      words(*reinterpret_cast<const uint4*>(qb + 2 * d0), b);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const uint2 k2 = *reinterpret_cast<const uint2*>(krow[n] + d0);
        const std::uint32_t k[2] = {k2.x, k2.y};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const std::uint32_t af[4] = {a[2 * j], b[2 * j], a[2 * j + 1], b[2 * j + 1]};
          std::uint32_t b0, b1;
          e4m3x4_to_half2x2(k[j], b0, b1);
          mma_16816<false>(pe[n], af, b0, b1);
        }
      }
      const float sn = p.scale_nope * code_scale(), se = p.scale_pe * code_scale();
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          sp[n][i] = ((nope[n][0][i] + nope[n][1][i]) * sn + pe[n][i] * se) * q_inv[i / 2];
    } else {
      // Block format rope: 8 bf16 dims at byte 528 + 64 h + 16 tq; Q's rope is bf16 (unscaled).
      const int b0ff = 528 + 64 * h + 16 * tq;
      std::uint32_t a[4], b[4];
      words(*reinterpret_cast<const uint4*>(qa + 1024 + 64 * h + 16 * tq), a);
      words(*reinterpret_cast<const uint4*>(qb + 1024 + 64 * h + 16 * tq), b);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        std::uint32_t k[4];
        words(*reinterpret_cast<const uint4*>(krow[n] + b0ff), k);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const std::uint32_t af[4] = {a[2 * j], b[2 * j], a[2 * j + 1], b[2 * j + 1]};
          mma_16816<true>(pe[n], af, k[2 * j], k[2 * j + 1]);
        }
      }
      // Each token's scales of blocks 2 h and 2 h + 1 (columns 2 tq, 2 tq + 1: tokens tq, tq + 4).
      const float sn = p.scale_nope * code_scale();
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float* sc = reinterpret_cast<const float*>(
              raw + (16 * tg + 8 * n + tq + 4 * k) * C::kPitch + 512 + 8 * h);
          const float s0 = sc[0] * sn, s1 = sc[1] * sn;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int i = 2 * r + k;
            sp[n][i] = (nope[n][0][i] * s0 + nope[n][1][i] * s1) * q_inv[r] + pe[n][i] * p.scale_pe;
          }
        }
    }
  }
}

}  // namespace fp8mla::detail::portable
