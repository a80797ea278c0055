// The wgmma decode kernel for bf16 caches at 17-64 rows (heads x query tokens; 128-head models
// run two 64-row tiles per request), and the pieces it shares with the fp8_e4m3 kernel of those
// tiles (decode_wgmma_fp8_kernel.cuh): Q's load, the softmax fragments and the epilogue.
// mma.sync reached 19% of the matmul ceiling there with 8 warps per SM (bench/NOTES.md, v7); this
// kernel issues Hopper's warpgroup MMA (wgmma), which reads its operands from shared memory
// without per-thread fragment loads. One CTA (2 warpgroups) per WorkTile, one CTA per SM. Per
// 32-token block:
//   * cp.async copies the tokens straight into one of three bf16 tiles, two blocks ahead. A tile
//     is nine 128-byte-swizzled panels of 64 dims, the layout wgmma reads both as K (K-major,
//     for S) and as V (N-major, for O);
//   * S = Q K^T, 64 x 32 fp32 (Q bf16 in shared memory): warpgroup g multiplies k-steps 2 k + g
//     for all 32 tokens, the partial sums meet in shared memory, and both warpgroups run the
//     same softmax (16 tokens a warpgroup read Q from shared memory twice as often per token:
//     9% slower, bench/NOTES.md v23);
//   * O += P V: warpgroup g owns output dims [256 g, 256 g + 256) (128 fp32 accumulators per
//     thread).
#pragma once

#include <cstdint>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace wg {

inline constexpr int kThreads = 256;
inline constexpr int kRows = 64;
inline constexpr int kQPanel = kRows * 128;  // 64 q rows x 64 16-bit dims, swizzled

// The bf16 kernel's shared memory: Q (73.7 KB) and three 32-token tiles (36.9 KB each), the
// partial-S exchange and the flags of the blocks in flight.
struct Layout {
  static constexpr bool kBf16 = true;  // load_q: bf16 Q as given
  static constexpr int kN = 32;        // cache tokens per block
  static constexpr int kTiles = 3;
  static constexpr int kPanel = kN * 128;
  static constexpr int kTileBytes = 9 * kPanel;
  static constexpr int kFlagSlots = 4;  // token flags of the blocks in flight
  static constexpr int kQ = 0;
  static constexpr int kTile = kQ + 9 * kQPanel;
  static constexpr int kSwap = kTile + kTiles * kTileBytes;  // partial S, 64 x 32 fp32
  static constexpr int kFlags = kSwap + kRows * kN * 4;
  static constexpr int kQInv = kFlags + kFlagSlots * kN;
  static constexpr int kQAmax = kQInv + kRows * 4;
  static constexpr int kSmemBytes = kQAmax + kRows * 4 + 1024;  // + slack to align to 1 KB
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// Q rows into the nine swizzled panels at L::kQ (zero rows past the tile). fp8 caches: fp16,
// each row scaled by 2^e (decode::q_row_exponent over its nope values and its ratio-scaled rope
// values), L::kQInv = 2^-e; bf16 caches (L::kBf16): bf16 as given, kQInv = 1. L::kQAmax: 64
// words of scratch. Ends with a barrier.
template <class L>
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
  std::uint32_t* amax = reinterpret_cast<std::uint32_t*>(smem + L::kQAmax);
  float* inv = reinterpret_cast<float*>(smem + L::kQInv);
  if constexpr (!L::kBf16) {
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
  }
  for (int i = threadIdx.x; i < kRows * 72; i += kThreads) {
    const int r = i / 72, c = i % 72;
    uint4 v = q_chunk(r, c);
    if constexpr (L::kBf16) {
      if (c == 0) inv[r] = 1.0f;
    } else {
      const int e = decode::q_row_exponent(__uint_as_float(amax[r]));
      const float scale = c < 64 ? ldexpf(1.0f, e) : ldexpf(ratio, e);
      if (c == 0) inv[r] = ldexpf(1.0f, -e);
      v = make_uint4(decode::scale_to_half2(v.x, scale), decode::scale_to_half2(v.y, scale),
                     decode::scale_to_half2(v.z, scale), decode::scale_to_half2(v.w, scale));
    }
    *reinterpret_cast<uint4*>(smem + L::kQ + (c / 8) * kQPanel + sw128(r, 16 * (c % 8))) = v;
  }
  fence_proxy_async();
  __syncthreads();
}

// cp.async of block `blk` straight into tile blk % 3 and its flags: 8 threads per token,
// thread sub copies dims 8 sub + 64 i (panel i, swizzled unit sub) for i = 0..8; the page-table
// entry of block blk + 1 is loaded for the next call (decode::token_entry). One commit.
__device__ __forceinline__ void stage_bf16_block(const DecodeParams& p, const WorkTile& t,
                                                 int q_first, std::int32_t kv_base, int blk,
                                                 std::int32_t& entry, std::uint8_t* smem) {
  using L = Layout;
  const int tok = threadIdx.x / 8, sub = threadIdx.x % 8;
  const decode::TokenAddr a = decode::slot_addr(p, decode::entry_slot<L::kN, 8>(p, t, blk, entry));
  const bool valid = a.ckv != nullptr;
  if (sub == 0) smem[L::kFlags + (blk % L::kFlagSlots) * L::kN + tok] = valid ? 1 : 0;
  std::uint8_t* dst = smem + L::kTile + (blk % L::kTiles) * L::kTileBytes + sw128(tok, 16 * sub);
#pragma unroll
  for (int i = 0; i < 9; ++i) {
    const std::uint8_t* src = i < 8 ? a.ckv + 16 * (sub + 8 * i) : a.kpe + 16 * sub;
    cp_async_16(dst + i * L::kPanel, valid ? src : p.ckv, valid);  // p.ckv: a mapped address
  }
  cp_async_commit();
  entry = decode::token_entry<L::kN, 8>(p, t, q_first, kv_base, blk + 1);
}

// This warpgroup's partial S of the tile at byte offset `tile` (64 x 32): all 32 tokens,
// k-steps 2 k + g of 36 (panel k / 2, byte 64 (k % 2) + 32 g). dq and dk carry the group's
// offset, so the descriptors differ by a register, not a branch (ptxas serializes every wgmma of
// a kernel that has a branch around one: C7520).
__device__ __forceinline__ void s_steps(float (&s)[16], std::uint64_t dq, std::uint64_t dk,
                                        std::uint32_t tile) {
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 18; ++k) {
    const int d = 64 * (k % 2);
    wgmma_64x32x16_ss<true>(s, desc_add(dq, (k / 2) * kQPanel + d),
                            desc_add(dk, tile + (k / 2) * Layout::kPanel + d), k > 0);
  }
  wgmma_commit();
}

// The partial-S exchange: float4 i of this thread's slots (xch[128 i]) holds s[4 i .. 4 i + 3];
// warpgroup 0 puts, warpgroup 1 adds and puts the sum back, warpgroup 0 gets it.
template <int kS>
__device__ __forceinline__ void put_scores(const float (&s)[kS], float4* xch) {
#pragma unroll
  for (int i = 0; i < kS / 4; ++i)
    xch[128 * i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
}
template <int kS>
__device__ __forceinline__ void get_scores(float (&s)[kS], const float4* xch) {
#pragma unroll
  for (int i = 0; i < kS / 4; ++i) {
    const float4 v = xch[128 * i];
    s[4 * i] = v.x, s[4 * i + 1] = v.y, s[4 * i + 2] = v.z, s[4 * i + 3] = v.w;
  }
}
template <int kS>
__device__ __forceinline__ void add_scores(float (&s)[kS], float4* xch) {
#pragma unroll
  for (int i = 0; i < kS / 4; ++i) {
    const float4 v = xch[128 * i];
    s[4 * i] += v.x, s[4 * i + 1] += v.y, s[4 * i + 2] += v.z, s[4 * i + 3] += v.w;
    xch[128 * i] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
  }
}

// The running row max moves only when a block's max exceeds it by more than 2^8 (log2 units):
// p = 2^(s - m) then stays below 256 (16-bit P keeps its relative precision, fp32 sums have
// room), and the 128 rescaling multiplies per thread run only in the first blocks instead of in
// about half of them.
inline constexpr float kMaxSlack = 8.0f;

// ---- softmax and output pieces shared by the wgmma kernels. Fragments: an m64nNk16
// accumulator's s[r] is row 16 warp + g + 8 ((r / 2) % 2), column 8 (r / 4) + 2 tq + r % 2 ----

// A row's base moves to a block's max m only when m exceeds it by more than kMaxSlack; p is
// then at most 2^8. factor: from the old base to the new (0 when a row first sees a token);
// rows with nothing visible yet keep base -inf and take p's offset 0.
__device__ __forceinline__ float new_base(float old, float m) {
  return m > old + kMaxSlack ? m : old;
}
__device__ __forceinline__ float factor(float from, float to) {
  return from == to ? 1.0f : fast_exp2(from - to);
}

// S's columns (tokens j0 + column) masked to -inf where flagged absent (fl[column] == 0) or past
// a row's limit, unless `visible` holds for the whole warp; mx: the rows' maxima (over the quad).
template <int kS>
__device__ __forceinline__ void mask_and_max(float (&s)[kS], float (&mx)[2], bool visible,
                                             const std::uint8_t* fl, int j0,
                                             const int (&limit)[2]) {
  const int tq = threadIdx.x % 4;
  if (!__all_sync(0xffffffffu, visible)) {
#pragma unroll
    for (int r = 0; r < kS; ++r) {
      const int h = (r / 2) % 2, col = 8 * (r / 4) + 2 * tq + r % 2;
      if (fl[col] == 0 || j0 + col > limit[h]) s[r] = -INFINITY;
    }
  }
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int r = 0; r < kS; ++r) mx[(r / 2) % 2] = fmaxf(mx[(r / 2) % 2], s[r]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
}

// P (fp16 or bf16, the tile's type) = 2^(s sc - pbase) as wgmma A fragments, which are the S
// accumulator's layout: k-step kk holds columns 16 kk + [0, 16), pa[j] rows g + 8 (j % 2),
// columns + 2 tq + 8 (j / 2). A rounded product, never fused with the subtraction: the row max
// is the rounded product of the max score, so the max gives 2^0 exactly (an FMA would expose
// the product's rounding error, 2^52 in absolute terms for a row scaled by 2^60).
template <bool kBf16, int kS>
__device__ __forceinline__ void p_frags(std::uint32_t (&pa)[4], const float (&s)[kS], int kk,
                                        const float (&sc)[2], const float (&pbase)[2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = 8 * kk + 2 * j, h = j % 2;
    const float p0 = fast_exp2(__fmul_rn(s[r], sc[h]) - pbase[h]);
    const float p1 = fast_exp2(__fmul_rn(s[r + 1], sc[h]) - pbase[h]);
    pa[j] = kBf16 ? float2_to_bf16x2(p0, p1) : float2_to_half2(p0, p1);
  }
}

// Row sums of what the tensor cores multiply (the rounded p), so o / l is exact.
template <bool kBf16>
__device__ __forceinline__ void add_sums(float (&row_sum)[2], const std::uint32_t (&pa)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f =
        kBf16 ? bf16x2_to_float2(pa[j]) : __half22float2(*reinterpret_cast<const __half2*>(&pa[j]));
    row_sum[j % 2] += f.x + f.y;
  }
}

// O (4 panels of 64 dims) times f per row; only when a row of the warp has f != 1.
__device__ __forceinline__ void rescale_o(float (&o)[4][32], const float (&f)[2]) {
  if (__any_sync(0xffffffffu, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int r = 0; r < 32; ++r) o[c][r] *= f[(r / 2) % 2];
  }
}

// The warpgroup index broadcast from lane 0, so ptxas knows it is uniform and keeps the wgmma
// descriptors in uniform registers (v8's first build moved each one with R2UR: 10% of all
// instructions).
__device__ __forceinline__ int uniform_warpgroup() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
}

// This thread's rows 16 warp + g (+ 8): their causal limits and score scales (scale_nope times
// the row's 1 / q scale, qinv). Rows past the tile (zero q, never written) take no bound, so they
// do not force the masked path.
__device__ __forceinline__ void row_bounds(const DecodeParams& p, const DeviceTile& tile, int warp,
                                           int g, const float* qinv, int (&limit)[2],
                                           float (&sc)[2]) {
  const int rows = tile.tile.q_count * tile.tile.head_count;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    limit[h] = r < rows ? decode::row_limit(p, tile.tile, r, tile.kv_len, tile.qo_len) : INT32_MAX;
    sc[h] = p.scale_nope * qinv[r];
  }
}

// Epilogue: this thread's rows 16 warp + g + 8 h of O (output dims 256 group + 64 c + 8 n +
// 2 tq, + 1) divided by the row sums l (whole rows), with max m: bf16 out (+ lse), or the fp32
// partial row of a split.
__device__ __forceinline__ void store_rows(const DecodeParams& p, const DeviceTile& tile, int group,
                                           int warp, int lane, const float (&o)[4][32],
                                           const float (&m)[2], const float (&l)[2]) {
  const WorkTile& t = tile.tile;
  const int g = lane / 4, tq = lane % 4;
  const int rows = t.q_count * t.head_count;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    if (r >= rows) continue;
    const decode::RowEnd end = decode::finish_row(m[h], l[h], p.out_scale);
    const int tr = r / t.head_count;
    const std::int64_t head = t.head_begin + r % t.head_count;
    const std::int64_t token = tile.q_first + tr;
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
      const std::int64_t prow = decode::partial_row(p, t, tile.qo_len, tr, head);
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

}  // namespace wg

__global__ void __launch_bounds__(wg::kThreads, 1)
    mla_decode_wgmma_bf16_kernel(const DecodeParams p) {
  using namespace wg;
  using L = Layout;
  constexpr int kN = L::kN;
  DeviceTile tile;
  if (!decode::load_tile(p, tile)) return;
  pdl_launch_dependents();
  std::uint8_t* smem = dynamic_smem_1k();
  const WorkTile t = tile.tile;
  const int group = uniform_warpgroup();
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int q_first = tile.q_first;
  const int n_blocks = (t.kv_end - t.kv_begin + kN - 1) / kN;

  const std::int32_t kv_base = tile.kv_base;
  std::uint8_t* flags = smem + L::kFlags;
  // Page-table entry of the next block to stage (token_entry).
  std::int32_t next_entry = decode::token_entry<kN, 8>(p, t, q_first, kv_base, 0);
  stage_bf16_block(p, t, q_first, kv_base, 0, next_entry, smem);
  stage_bf16_block(p, t, q_first, kv_base, 1, next_entry, smem);
  load_q<L>(p, t, q_first, 1.0f, smem);

  int limit[2];
  float sc[2];
  row_bounds(p, tile, warp, g, reinterpret_cast<const float*>(smem + L::kQInv), limit, sc);
  const int limit_min = min(limit[0], limit[1]);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; summed over the quad at the end
  float o[4][32];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int r = 0; r < 32; ++r) o[c][r] = 0.0f;

  const std::uint8_t* tiles = smem + L::kTile;
  // S's descriptors carry the group's first k-step.
  const std::uint64_t dq = wgmma_desc(smem + L::kQ + 32 * group, 16, 1024);
  const std::uint64_t dk = wgmma_desc(tiles + 32 * group, 16, 1024);
  const std::uint64_t dv = wgmma_desc(tiles + 4 * group * L::kPanel, L::kPanel, 1024);
  float4* xch = reinterpret_cast<float4*>(smem + L::kSwap) + threadIdx.x % 128;

  for (int blk = 0; blk < n_blocks; ++blk) {
    float s[16];
    // Tile offset of this block, broadcast so the descriptors stay uniform.
    const auto tile =
        static_cast<std::uint32_t>(__shfl_sync(0xffffffffu, (blk % L::kTiles) * L::kTileBytes, 0));
    const std::uint8_t* fl = flags + (blk % L::kFlagSlots) * kN;
    cp_async_wait<1>();
    fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads async
    __syncthreads();      // block blk landed for all; every wgmma of block blk - 1 completed
    if (blk + 2 < n_blocks) {
      stage_bf16_block(p, t, q_first, kv_base, blk + 2, next_entry, smem);
    } else {
      cp_async_commit();  // one group per iteration: wait_group 1 always means block blk
    }
    s_steps(s, dq, dk, tile);
    const uint4 f0 = reinterpret_cast<const uint4*>(fl)[0];
    const uint4 f1 = reinterpret_cast<const uint4*>(fl)[1];
    const bool all_present = (f0.x & f0.y & f0.z & f0.w & f1.x & f1.y & f1.z & f1.w) == 0x01010101u;
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    // The partial sums meet, and both warpgroups hold bit-identical scores. Whole-CTA barriers:
    // racecheck reported hazards on a bar.arrive / bar.sync hand-off (v9).
    if (group == 0) put_scores(s, xch);
    __syncthreads();
    if (group == 1) add_scores(s, xch);
    __syncthreads();
    if (group == 0) get_scores(s, xch);

    // ---- masks and online softmax; the max is taken on unscaled scores ----
    const int j0 = t.kv_begin + blk * kN;
    float mx[2];
    mask_and_max(s, mx, all_present && j0 + kN - 1 <= limit_min, fl, j0, limit);
    float f[2], pbase[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float b = new_base(row_max[h], __fmul_rn(mx[h], sc[h]));  // sc > 0
      f[h] = factor(row_max[h], b);
      row_max[h] = b;
      pbase[h] = b == -INFINITY ? 0.0f : b;
    }
    std::uint32_t pa[kN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) p_frags<true>(pa[kk], s, kk, sc, pbase);
    rescale_o(o, f);
    row_sum[0] *= f[0], row_sum[1] *= f[1];
    // O += P V over the block's k-steps (this warpgroup's 4 panels of 64 dims).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wgmma_64x64x16_rs<1, true>(o[c], pa[kk], desc_add(dv, tile + c * L::kPanel + kk * 2048), 1);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) add_sums<true>(row_sum, pa[kk]);
    wgmma_wait<0>();
#pragma unroll
    for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
  }
  cp_async_wait<0>();

  // ---- epilogue: row sums over the quad, then o / l and lse ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  store_rows(p, tile, group, warp, lane, o, row_max, row_sum);
}

}  // namespace fp8mla::detail
