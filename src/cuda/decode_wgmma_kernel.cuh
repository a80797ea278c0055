// The fp8_e4m3 decode kernel for tiles of 17-64 rows (heads x query tokens; 128-head models run
// two 64-row tiles per request): the compute-bound target. mma.sync reached 19% of the matmul
// ceiling there with 8 warps per SM (bench/NOTES.md, v7); this kernel issues Hopper's warpgroup
// MMA (wgmma), which reads its operands from shared memory without per-thread fragment loads.
// One CTA (2 warpgroups) per WorkTile, one CTA per SM. Per block of 64 cache tokens:
//   * cp.async copies the raw 576-byte tokens into one staging buffer, a block ahead;
//   * all 256 threads dequantize them (one cvt.rn.f16x2.e4m3x2 per pair, exact) into an fp16
//     tile laid out as nine 128-byte-swizzled panels of 64 dims, the layout wgmma reads both as
//     K (K-major, for S) and as V (N-major, for O);
//   * S = Q K^T (64 x 64, fp32): warpgroup g multiplies k-steps 2 k + g of the 36
//     (Q: fp16 in shared memory, scaled per row by a power of two), and the two partial sums
//     meet in shared memory; both warpgroups then hold the same S and run the same online
//     softmax (a warp owns 16 whole rows: no cross-warp reductions);
//   * O += P V: P stays in registers as wgmma's A operand; warpgroup g owns output dims
//     [256 g, 256 g + 256) (128 fp32 accumulators per thread).
// The rope half of Q is multiplied by kpe_scale / ckv_scale before its fp16 rounding, so one
// accumulator serves both halves: exact when the two scales are equal (fp8mla's caches, SGLang's
// pools), otherwise one fp16 rounding (2^-11 relative) of q_pe.
#pragma once

#include <cstdint>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace wg {

inline constexpr int kThreads = 256;
inline constexpr int kBlockN = 64;
inline constexpr int kRows = 64;
inline constexpr int kPanel = 64 * 128;  // 64 rows (tokens or q rows) x 64 fp16 dims, swizzled
inline constexpr int kPitch = 592;       // staging row pitch: conflict-free dequantization reads
inline constexpr int kQ = 0;
inline constexpr int kTile = kQ + 9 * kPanel;
inline constexpr int kRaw = kTile + 9 * kPanel;
inline constexpr int kXch = kRaw + kBlockN * kPitch;  // 64 x 64 fp32 partial S
inline constexpr int kFlags = kXch + kRows * kBlockN * 4;
inline constexpr int kQInv = kFlags + 2 * kBlockN;
inline constexpr int kQAmax = kQInv + kRows * 4;
inline constexpr int kSmemBytes = kQAmax + kRows * 4 + 1024;  // + slack to align the base to 1 KB
static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");

// Q rows into the nine swizzled fp16 panels (zero rows past the tile), each row scaled by 2^e
// (decode::q_row_exponent over its nope values and its ratio-scaled rope values); kQInv gets
// 2^-e. Ends with a barrier.
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
  std::uint32_t* amax = reinterpret_cast<std::uint32_t*>(smem + kQAmax);
  float* inv = reinterpret_cast<float*>(smem + kQInv);
  if (threadIdx.x < kRows) amax[threadIdx.x] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * 72; i += kThreads) {
    const int r = i / 72, c = i % 72;
    if (r >= rows) continue;
    float m = __uint_as_float(decode::abs_max_bits(q_chunk(r, c)));
    if (c >= 64) m *= ratio;
    atomicMax(&amax[r], __float_as_uint(m));  // non-negative floats order as their bits
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * 72; i += kThreads) {
    const int r = i / 72, c = i % 72;
    const int e = decode::q_row_exponent(__uint_as_float(amax[r]));
    const float scale = c < 64 ? ldexpf(1.0f, e) : ldexpf(ratio, e);
    if (c == 0) inv[r] = ldexpf(1.0f, -e);
    const uint4 v = q_chunk(r, c);
    const uint4 h =
        make_uint4(decode::scale_to_half2(v.x, scale), decode::scale_to_half2(v.y, scale),
                   decode::scale_to_half2(v.z, scale), decode::scale_to_half2(v.w, scale));
    *reinterpret_cast<uint4*>(smem + kQ + (c / 8) * kPanel + sw128(r, 16 * (c % 8))) = h;
  }
  fence_proxy_async();
  __syncthreads();
}

// The staged block into the fp16 tile: thread t converts token t % 64, dims 16 (t / 64) + 64 i
// of panel i (conflict-free: 8 consecutive threads read 8 rows 592 bytes apart and write 8
// different swizzled units).
__device__ __forceinline__ void dequantize_block(std::uint8_t* smem) {
  const int row = threadIdx.x % kBlockN, sub = threadIdx.x / kBlockN;
  const std::uint8_t* src = smem + kRaw + row * kPitch + 16 * sub;
  std::uint8_t* dst = smem + kTile;
#pragma unroll
  for (int i = 0; i < 9; ++i) {
    const uint4 c = *reinterpret_cast<const uint4*>(src + 64 * i);
    uint4 a, b;
    fp8x4_to_half2x2(c.x, a.x, a.y);
    fp8x4_to_half2x2(c.y, a.z, a.w);
    fp8x4_to_half2x2(c.z, b.x, b.y);
    fp8x4_to_half2x2(c.w, b.z, b.w);
    *reinterpret_cast<uint4*>(dst + i * kPanel + sw128(row, 32 * sub)) = a;
    *reinterpret_cast<uint4*>(dst + i * kPanel + sw128(row, 32 * sub + 16)) = b;
  }
}

// Partial S, the warpgroup's 18 k-steps: warpgroup g takes k-steps 2 k + g, whose offsets are
// (k / 2) panels + 32 (2 (k % 2) + g) bytes, so dq and dk carry the group's 32 g and the rest is
// a compile-time constant: no branch on the group around a wgmma (ptxas serializes every wgmma
// of a kernel that has one: C7520).
__device__ __forceinline__ void s_steps(float (&s)[32], std::uint64_t dq, std::uint64_t dk) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 18; ++k) {
    const int off = (k / 2) * kPanel + 64 * (k % 2);
    wgmma_64x64x16_ss<0>(s, desc_add(dq, off), desc_add(dk, off), k > 0);
  }
  wgmma_commit();
}

// The running row max moves only when a block's max exceeds it by more than 2^8 (log2 units):
// p = 2^(s - m) then stays below 256 (fp16 keeps its relative precision, fp32 sums have room),
// and the 128 rescaling multiplies per thread run only in the first blocks instead of in about
// half of them.
inline constexpr float kMaxSlack = 8.0f;

}  // namespace wg

__global__ void __launch_bounds__(wg::kThreads, 1) mla_decode_wgmma_kernel(const DecodeParams p) {
  using namespace wg;
  if (static_cast<int>(blockIdx.x) >= *p.num_tiles) return;
  extern __shared__ std::uint8_t smem_base[];
  // The swizzle atoms need 1024-byte alignment.
  std::uint8_t* smem = smem_base + ((1024 - smem_addr(smem_base) % 1024) % 1024);
  const WorkTile t = p.tiles[blockIdx.x];
  // The warpgroup index broadcast from lane 0, so ptxas knows it is uniform and keeps the wgmma
  // descriptors in uniform registers (v8's first build moved each one with R2UR: 10% of all
  // instructions).
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int rows = t.q_count * t.head_count;
  const int q_first = p.qo_indptr[t.request] + t.q_begin;
  const int qo_len = p.qo_indptr[t.request + 1] - p.qo_indptr[t.request];
  const int kv_len = p.topk > 0 ? 0 : p.kv_len[t.request];
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;

  const std::int32_t kv_base = p.topk > 0 ? 0 : p.kv_indptr[t.request];
  std::uint8_t* flags = smem + kFlags;  // [2][64]: block b's flags in half b % 2
  // Whether this thread's token of the block in flight is present (all present: no flag reads).
  std::int64_t slot = decode::entry_slot(p, t, 0, decode::token_entry(p, t, q_first, kv_base, 0));
  bool staged_valid = slot >= 0;
  decode::copy_fp8_token(p, slot, smem + kRaw + (threadIdx.x / 4) * kPitch,
                         flags + threadIdx.x / 4);
  cp_async_commit();
  std::int32_t next_entry = decode::token_entry(p, t, q_first, kv_base, 1);

  const float ratio = p.scale_pe / p.scale_nope;
  load_q(p, t, q_first, ratio, smem);

  // This thread's rows (16 warp + g, + 8) of S, P and O. Rows past the tile (zero q, never
  // written) take no bound, so they do not force the masked path.
  int limit[2];
  float sc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    limit[h] = r < rows ? decode::row_limit(p, t, r, kv_len, qo_len) : INT32_MAX;
    sc[h] = p.scale_nope * reinterpret_cast<const float*>(smem + kQInv)[r];
  }
  const int limit_min = min(limit[0], limit[1]);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; summed over the quad at the end
  float o[4][32];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int r = 0; r < 32; ++r) o[c][r] = 0.0f;

  const std::uint8_t* tile = smem + kTile;
  const std::uint64_t dq = wgmma_desc(smem + kQ + 32 * group, 16, 1024);
  const std::uint64_t dk = wgmma_desc(tile + 32 * group, 16, 1024);
  const std::uint64_t dv = wgmma_desc(tile + 4 * group * kPanel, kPanel, 1024);
  float4* xch = reinterpret_cast<float4*>(smem + kXch) + threadIdx.x % 128;

  for (int blk = 0; blk < n_blocks; ++blk) {
    cp_async_wait<0>();
    // Block blk staged; every wgmma of block blk - 1 has completed.
    const bool all_present = __syncthreads_and(staged_valid);
    dequantize_block(smem);
    fence_proxy_async();
    __syncthreads();  // the tile is ready, the staging buffer free
    float s[32];
    s_steps(s, dq, dk);
    // The next block's copies are issued while the tensor cores run S.
    if (blk + 1 < n_blocks) {
      slot = decode::entry_slot(p, t, blk + 1, next_entry);
      staged_valid = slot >= 0;
      decode::copy_fp8_token(p, slot, smem + kRaw + (threadIdx.x / 4) * kPitch,
                             flags + ((blk + 1) % 2) * kBlockN + threadIdx.x / 4);
      next_entry = decode::token_entry(p, t, q_first, kv_base, blk + 2);
    }
    cp_async_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    // The partial sums meet: warpgroup 1 adds warpgroup 0's and hands the total back, so both
    // hold bit-identical scores. Whole-CTA barriers: racecheck reported hazards on a
    // bar.arrive / bar.sync hand-off (bench/NOTES.md, v9), and these cost little here.
    if (group == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        xch[128 * i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
    }
    __syncthreads();
    if (group == 1) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 v = xch[128 * i];
        s[4 * i] += v.x, s[4 * i + 1] += v.y, s[4 * i + 2] += v.z, s[4 * i + 3] += v.w;
        xch[128 * i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
      }
    }
    __syncthreads();
    if (group == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 v = xch[128 * i];
        s[4 * i] = v.x, s[4 * i + 1] = v.y, s[4 * i + 2] = v.z, s[4 * i + 3] = v.w;
      }
    }

    // ---- masks and online softmax (fragment: s[r] is row 16 warp + g + 8 ((r / 2) % 2), token
    // 8 (r / 4) + 2 tq + r % 2); the max is taken on unscaled scores ----
    const int j0 = t.kv_begin + blk * kBlockN;
    if (!__all_sync(0xffffffffu, all_present && j0 + kBlockN - 1 <= limit_min)) {
      const std::uint8_t* fl = flags + (blk % 2) * kBlockN;
#pragma unroll
      for (int r = 0; r < 32; ++r) {
        const int h = (r / 2) % 2, tok = 8 * (r / 4) + 2 * tq + r % 2;
        if (fl[tok] == 0 || j0 + tok > limit[h]) s[r] = -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int r = 0; r < 32; ++r) mx[(r / 2) % 2] = fmaxf(mx[(r / 2) % 2], s[r]);
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m = __fmul_rn(mx[h], sc[h]);  // sc > 0: the max of the scaled scores
      alpha[h] = 1.0f;
      if (m > row_max[h] + kMaxSlack) {
        alpha[h] = fast_exp2(row_max[h] - m);  // 0 for the first block a row sees
        row_max[h] = m;
        row_sum[h] *= alpha[h];
      }
      base[h] = row_max[h] == -INFINITY ? 0.0f : row_max[h];  // rows with nothing visible yet
    }
    // P in fp16 as wgmma A fragments: k-step kk holds tokens 16 kk + [0, 16).
    std::uint32_t pa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 8 * kk + 2 * j, h = j % 2;  // j: (row g, n-tile 2kk), (g+8, 2kk), ...
        // A rounded product, never fused with the subtraction: the row max m is the rounded
        // product of the max score, so the max gives 2^0 exactly (an FMA would expose the
        // product's rounding error, 2^52 in absolute terms for a row scaled by 2^60).
        const __half2 v = __floats2half2_rn(fast_exp2(__fmul_rn(s[r], sc[h]) - base[h]),
                                            fast_exp2(__fmul_rn(s[r + 1], sc[h]) - base[h]));
        pa[kk][j] = *reinterpret_cast<const std::uint32_t*>(&v);
      }
    // Rescale only when a row of the warp moved its max (kMaxSlack).
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int r = 0; r < 32; ++r) o[c][r] *= alpha[(r / 2) % 2];
    }

    // ---- O += P V: this warpgroup's 4 panels of 64 dims, 4 k-steps of 16 tokens ----
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wgmma_64x64x16_rs<1>(o[c], pa[kk], desc_add(dv, c * kPanel + kk * 2048), 1);
    wgmma_commit();
    // Row sums while the tensor cores work: what they multiply (the rounded p), so o / l is exact.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&pa[kk][j]));
        row_sum[j % 2] += f.x + f.y;
      }
    wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
  }
  cp_async_wait<0>();

  // ---- epilogue: row sums over the quad, then o / l and lse ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (r >= rows) continue;
    const decode::RowEnd end = decode::finish_row(row_max[h], l, p.out_scale);
    const int tr = r / t.head_count;
    const std::int64_t head = t.head_begin + r % t.head_count;
    const std::int64_t token = q_first + tr;
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
      const std::int64_t prow = decode::partial_row(p, t, qo_len, tr, head);
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

}  // namespace fp8mla::detail
