// The fp8_e4m3 decode kernel for tiles of <= 16 rows (heads x query tokens): the bandwidth
// targets. One CTA (8 warps) per WorkTile, two CTAs per SM. Nothing is dequantized into a
// shared-memory tile: v1-v4 spent ~300 KB of shared-memory traffic per 64-token block (36.9 KB
// from HBM) staging, dequantizing and re-reading a 16-bit tile, and took the same time per
// token for fp8 and bf16 caches (bench/NOTES.md, v4-v7). Per block:
//   * cp.async copies the raw 576-byte tokens, one block ahead, into rows of kPitch bytes (the
//     pitch makes the fragment reads below bank-conflict free); the page-table entries are
//     loaded one block earlier still (decode::token_entry);
//   * S = Q K^T: warp w owns nope dims [64 w, 64 w + 64) of all 64 tokens (8 independent mma
//     chains) and the rope dims of its own 8 tokens; each thread reads 16 code bytes per 4
//     k-steps and converts them (one cvt.rn.f16x2.e4m3x2 per pair, exact) straight into mma B
//     fragments. The head dims are permuted so those 16 bytes are contiguous; Q's fragments
//     (fp16, scaled per row by a power of two, loaded once from global memory in the same
//     permutation) stay in registers. The 8 partial sums meet in shared memory (32 KB);
//   * O += P V: V's B fragments pair two tokens' codes of one column, built with byte permutes
//     from 8-byte reads; the output columns are permuted so each thread ends up owning 16
//     contiguous columns of its two rows;
//   * P goes through shared memory (fp16, 2 KB); the row max is exchanged between warps once per
//     block, the row sums only at the end.
// Shared-memory traffic per block: 37 KB of copies, 37 KB of K reads, 64 KB of partial sums,
// 32 KB of V reads, ~18 KB of P: ~190 KB instead of ~300 KB.
#pragma once

#include <cstdint>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace fp8frag {

inline constexpr int kThreads = 256;
inline constexpr int kWarps = 8;
inline constexpr int kBlockN = 64;  // cache tokens per block
inline constexpr int kRows = 16;
inline constexpr int kStages = 2;
// 576 code bytes + 16: token stride = 80 (mod 128) bytes, so the 4 tokens of one V read hit 4
// different 32-byte bank windows, and the 2 tokens of a K read quarter-warp (t and t + 4) are 64
// bytes apart.
inline constexpr int kPitch = 592;
inline constexpr int kStageBytes = kBlockN * kPitch;
inline constexpr int kPElems = kBlockN + 8;  // fp16 P row pitch: ldmatrix conflict-free
inline constexpr int kRaw = 0;
inline constexpr int kP = kRaw + kStages * kStageBytes;
inline constexpr int kPart = kP + kRows * kPElems * 2;  // [warp][n-tile][lane] float4 partial S
inline constexpr int kRed = kPart + kWarps * 8 * 32 * 16;
inline constexpr int kFlags = kRed + kWarps * kRows * 4;
inline constexpr int kSmemBytes = kFlags + kStages * kBlockN;
// Two CTAs per SM (16 warps): v5 ran one (255 registers, Q fragments of all 576 dims per
// thread) and ncu showed it latency bound: 0.41 eligible warps per scheduler, 29% issue busy.
inline constexpr int kMinBlocks = 2;
static_assert(kMinBlocks * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs must fit an SM");

// cp.async of the thread's token (slot from entry_slot) into `stage` (decode::copy_fp8_token).
__device__ __forceinline__ void load_token(const DecodeParams& p, std::int64_t slot,
                                           std::uint8_t* smem, int stage) {
  const int tok = threadIdx.x / 4;
  decode::copy_fp8_token(p, slot, smem + kRaw + stage * kStageBytes + tok * kPitch,
                         smem + kFlags + stage * kBlockN + tok);
}

}  // namespace fp8frag

__global__ void __launch_bounds__(fp8frag::kThreads, fp8frag::kMinBlocks)
    mla_decode_fp8_kernel(const DecodeParams p) {
  using namespace fp8frag;
  if (static_cast<int>(blockIdx.x) >= *p.num_tiles) return;
  pdl_launch_dependents();
  extern __shared__ __align__(128) std::uint8_t smem[];
  const WorkTile t = p.tiles[blockIdx.x];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;  // mma fragment row group and thread in group
  const int rows = t.q_count * t.head_count;
  const int q_first = p.qo_indptr[t.request] + t.q_begin;
  const int qo_len = p.qo_indptr[t.request + 1] - p.qo_indptr[t.request];
  const int kv_len = p.topk > 0 ? 0 : p.kv_len[t.request];
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  static_assert(kStages == 2, "the entry prefetch below assumes one block in flight");
  const std::int32_t kv_base = p.topk > 0 ? 0 : p.kv_indptr[t.request];
  load_token(p, decode::entry_slot(p, t, 0, decode::token_entry(p, t, q_first, kv_base, 0)), smem,
             0);
  cp_async_commit();
  // The entry of the block issued in iteration 0, used only there (see token_entry).
  std::int32_t next_entry = decode::token_entry(p, t, q_first, kv_base, 1);

  // ---- Q fragments: rows g and g + 8 of the warp's nope dims 64 warp + 16 tq + [0, 16)
  // (k-steps 0..3 of its slice) and of rope dims 16 tq + [0, 16). k-step j pairs logical k
  // (2 tq, 2 tq + 1) with dims +4 j, +4 j + 1 and (2 tq + 8, 2 tq + 9) with +4 j + 2, +4 j + 3:
  // the layout of a 16-byte K read (below).
  auto q_chunk = [&](int r, int i, int half) {  // 8 bf16 values: dims 64 i + 16 tq + 8 half
    if (r >= rows) return make_uint4(0, 0, 0, 0);
    const std::int64_t tok = q_first + r / t.head_count, h = t.head_begin + r % t.head_count;
    const __nv_bfloat16* src =
        i < 8 ? p.q_nope + tok * p.q_nope_stride[0] + h * p.q_nope_stride[1] + 64 * i
              : p.q_pe + tok * p.q_pe_stride[0] + h * p.q_pe_stride[1];
    return *reinterpret_cast<const uint4*>(src + 16 * tq + 8 * half);
  };
  float q_inv[2];
  std::uint32_t qn[4][4], qr[4][4];  // nope slice, rope
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    // Row scale 2^e (decode::q_row_exponent); 2^-e is undone on the scores.
    std::uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 9; ++i)
      m = max(m,
              max(decode::abs_max_bits(q_chunk(r, i, 0)), decode::abs_max_bits(q_chunk(r, i, 1))));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const int e = decode::q_row_exponent(__uint_as_float(m));
    const float scale = ldexpf(1.0f, e);
    q_inv[h] = ldexpf(1.0f, -e);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      const int i = part == 0 ? warp : 8;
      const uint4 lo = q_chunk(r, i, 0), hi = q_chunk(r, i, 1);
      const std::uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      std::uint32_t(&q)[4][4] = part == 0 ? qn : qr;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        q[j][h] = decode::scale_to_half2(w[2 * j], scale);
        q[j][h + 2] = decode::scale_to_half2(w[2 * j + 1], scale);
      }
    }
  }

  // Last visible token (inclusive) of the thread's rows g, g + 8.
  const int limit[2] = {decode::row_limit(p, t, g, kv_len, qo_len),
                        decode::row_limit(p, t, g + 8, kv_len, qo_len)};
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's tokens only; summed over the CTA at the end
  float o[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + kP);
  float* red_max = reinterpret_cast<float*>(smem + kRed);
  // The S-phase tokens of this thread (columns 2 tq, 2 tq + 1 of the warp's n-tile).
  const int tok_a = 8 * warp + tq, tok_b = tok_a + 4;
  // Its K-read token within an n-tile: fragment column g holds token g / 2 + 4 (g % 2).
  const int k_tok = g / 2 + 4 * (g % 2);
  float* part_s = reinterpret_cast<float*>(smem + kPart);

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % kStages;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // block blk landed for all threads; block blk - 1 is done with
    if (blk + 1 < n_blocks) {
      load_token(p, decode::entry_slot(p, t, blk + 1, next_entry), smem, (blk + 1) % kStages);
      next_entry = decode::token_entry(p, t, q_first, kv_base, blk + 2);
    }
    cp_async_commit();
    const std::uint8_t* raw = smem + kRaw + stage * kStageBytes;
    const std::uint8_t* flags = smem + kFlags + stage * kBlockN;

    // ---- S = Q K^T: the warp's 64 nope dims for all 64 tokens (8 independent chains of 4
    // mma), rope for its own 8 tokens; partial sums meet in shared memory ----
    float acc[8][4] = {}, acc_pe[4] = {};
    // Two n-tiles at a time: their mma chains interleave (v6 stalled on "wait").
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      // n-tile n, fragment column g: token 8 n + g / 2 + 4 (g % 2) (bank-conflict free reads).
      const std::uint8_t* k_col = raw + k_tok * kPitch + 64 * warp + 16 * tq;
      const uint4 v0 = *reinterpret_cast<const uint4*>(k_col + 8 * n * kPitch);
      const uint4 v1 = *reinterpret_cast<const uint4*>(k_col + 8 * (n + 1) * kPitch);
      const std::uint32_t w0[4] = {v0.x, v0.y, v0.z, v0.w}, w1[4] = {v1.x, v1.y, v1.z, v1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint32_t b0, b1, c0, c1;
        fp8x4_to_half2x2(w0[j], b0, b1);
        fp8x4_to_half2x2(w1[j], c0, c1);
        mma_16816<false>(acc[n], qn[j], b0, b1);
        mma_16816<false>(acc[n + 1], qn[j], c0, c1);
      }
#pragma unroll
      for (int m = n; m < n + 2; ++m)
        *reinterpret_cast<float4*>(part_s + ((warp * 8 + m) * 32 + lane) * 4) =
            make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    }
    {
      const uint4 v =
          *reinterpret_cast<const uint4*>(raw + (8 * warp + k_tok) * kPitch + 512 + 16 * tq);
      const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        std::uint32_t b0, b1;
        fp8x4_to_half2x2(w[j], b0, b1);
        mma_16816<false>(acc_pe, qr[j], b0, b1);
      }
    }
    __syncthreads();
    float nope[4] = {};
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(part_s + ((w * 8 + warp) * 32 + lane) * 4);
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
      s[i] = ok ? (nope[i] * p.scale_nope + acc_pe[i] * p.scale_pe) * q_inv[h] : -INFINITY;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[2 * h], s[2 * h + 1]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      if (tq == 0) red_max[warp * kRows + g + 8 * h] = mx;
    }
    __syncthreads();

    // ---- online softmax: P = exp2(s - m_new) into shared memory, rescale O and the sums ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;
      float mx = row_max[h];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_max[w * kRows + r]);
      const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
      const float alpha = exp2f(row_max[h] - base);
      row_max[h] = mx;
      const __half pa = __float2half_rn(exp2f(s[2 * h] - base));
      const __half pb = __float2half_rn(exp2f(s[2 * h + 1] - base));
      p_s[r * kPElems + tok_a] = __half_as_ushort(pa);
      p_s[r * kPElems + tok_b] = __half_as_ushort(pb);
      // Sum what the tensor cores multiply (the rounded p), so o / l stays exact.
      row_sum[h] = row_sum[h] * alpha + (__half2float(pa) + __half2float(pb));
      // The max rarely moves after the first blocks: skip the 16 multiplies when no row of the
      // warp needs them.
      if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          o[n][2 * h] *= alpha;
          o[n][2 * h + 1] *= alpha;
        }
      }
    }
    __syncthreads();

    // ---- O += P V: the warp's columns 64 warp + [0, 64); n-tile n, fragment column g is
    // column 64 warp + 8 g + n, so one 8-byte read per token covers the thread's 8 n-tiles ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      const std::uint8_t* v_col = raw + 64 * warp + 8 * g;
      const int tk = 16 * kk + 2 * tq;  // tokens tk, tk + 1 (b0) and tk + 8, tk + 9 (b1)
      const uint2 v0 = *reinterpret_cast<const uint2*>(v_col + tk * kPitch);
      const uint2 v1 = *reinterpret_cast<const uint2*>(v_col + (tk + 1) * kPitch);
      const uint2 v8 = *reinterpret_cast<const uint2*>(v_col + (tk + 8) * kPitch);
      const uint2 v9 = *reinterpret_cast<const uint2*>(v_col + (tk + 9) * kPitch);
      std::uint32_t b0[8], b1[8];
      // Byte permutes pair token tk's and tk + 1's codes of a column: [x0 y0 x1 y1], [x2 y2 x3 y3].
      fp8x4_to_half2x2(__byte_perm(v0.x, v1.x, 0x5140), b0[0], b0[1]);
      fp8x4_to_half2x2(__byte_perm(v0.x, v1.x, 0x7362), b0[2], b0[3]);
      fp8x4_to_half2x2(__byte_perm(v0.y, v1.y, 0x5140), b0[4], b0[5]);
      fp8x4_to_half2x2(__byte_perm(v0.y, v1.y, 0x7362), b0[6], b0[7]);
      fp8x4_to_half2x2(__byte_perm(v8.x, v9.x, 0x5140), b1[0], b1[1]);
      fp8x4_to_half2x2(__byte_perm(v8.x, v9.x, 0x7362), b1[2], b1[3]);
      fp8x4_to_half2x2(__byte_perm(v8.y, v9.y, 0x5140), b1[4], b1[5]);
      fp8x4_to_half2x2(__byte_perm(v8.y, v9.y, 0x7362), b1[6], b1[7]);
#pragma unroll
      for (int n = 0; n < 8; ++n) mma_16816<false>(o[n], a, b0[n], b1[n]);
    }
  }
  cp_async_wait<0>();

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
    const decode::RowEnd end = decode::finish_row(row_max[h], l, p.out_scale);
    const float inv = end.inv, lse = end.lse;
    const int tr = r / t.head_count;
    const std::int64_t head = t.head_begin + r % t.head_count;
    const std::int64_t token = q_first + tr;
    const int col0 = 64 * warp + 16 * tq;  // columns col0 + n (c0, c2) and col0 + 8 + n (c1, c3)
    if (t.split < 0) {
      __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col0;
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        *reinterpret_cast<__nv_bfloat162*>(dst + n) =
            __floats2bfloat162_rn(o[n][2 * h] * inv, o[n + 1][2 * h] * inv);
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 + n) =
            __floats2bfloat162_rn(o[n][2 * h + 1] * inv, o[n + 1][2 * h + 1] * inv);
      }
      if (p.lse != nullptr && warp == 0 && tq == 0)
        p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = lse;
    } else {
      const std::int64_t prow = decode::partial_row(p, t, qo_len, tr, head);
      float* dst = p.partial_o + prow * 512 + col0;
#pragma unroll
      for (int n = 0; n < 8; n += 4) {
        *reinterpret_cast<float4*>(dst + n) = make_float4(
            o[n][2 * h] * inv, o[n + 1][2 * h] * inv, o[n + 2][2 * h] * inv, o[n + 3][2 * h] * inv);
        *reinterpret_cast<float4*>(dst + 8 + n) =
            make_float4(o[n][2 * h + 1] * inv, o[n + 1][2 * h + 1] * inv, o[n + 2][2 * h + 1] * inv,
                        o[n + 3][2 * h + 1] * inv);
      }
      if (warp == 0 && tq == 0) p.partial_lse[prow] = lse;
    }
  }
}

}  // namespace fp8mla::detail
