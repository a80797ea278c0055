// The wgmma decode kernel for tiles of 17-64 rows (heads x query tokens; 128-head models run two
// 64-row tiles per request): the compute-bound target, for fp8_e4m3 and bf16 caches. mma.sync
// reached 19% of the matmul ceiling there with 8 warps per SM (bench/NOTES.md, v7); this kernel
// issues Hopper's warpgroup MMA (wgmma), which reads its operands from shared memory without
// per-thread fragment loads. One CTA (2 warpgroups) per WorkTile, one CTA per SM. Per block:
//   * fp8_e4m3 (64-token blocks): cp.async copies the raw 576-byte tokens into two staging
//     buffers, two blocks ahead; each warpgroup dequantizes its 32 tokens (one
//     cvt.rn.f16x2.e4m3x2 per pair, exact) into an fp16 tile and publishes them with a
//     warpgroup barrier; bf16 (32-token blocks): cp.async copies the tokens straight into one of
//     three bf16 tiles, two blocks ahead. A tile is nine 128-byte-swizzled panels of 64 dims, the
//     layout wgmma reads both as K (K-major, for S) and as V (N-major, for O);
//   * S = Q K^T, 64 x 32 fp32 per warpgroup (Q in shared memory: fp16 scaled per row by a power
//     of two for fp8 caches, bf16 as given for bf16 caches). fp8: warpgroup g multiplies all 576
//     dims for its tokens [32 g, 32 g + 32), turns them into P at its own base and multiplies
//     them into O at once; warp w of each warpgroup holds rows 16 w .. 16 w + 15, and the two
//     warps of those rows swap their bases and P halves (fp16, in the fp16 tile's rope panel,
//     which only S reads) through a 64-thread barrier, then add the partner's half at the common
//     base (bench/NOTES.md v23). bf16: warpgroup g multiplies k-steps 2 k + g for all 32 tokens,
//     the partial sums meet in shared memory, and both warpgroups run the same softmax;
//   * O += P V: warpgroup g owns output dims [256 g, 256 g + 256) (128 fp32 accumulators per
//     thread).
// fp8: the rope half of Q is multiplied by kpe_scale / ckv_scale before its fp16 rounding, so one
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
inline constexpr int kRows = 64;
inline constexpr int kQPanel = kRows * 128;  // 64 q rows x 64 16-bit dims, swizzled

// Shared-memory plan per cache format. Q (73.7 KB) and a 64-token fp16 tile (73.7 KB) leave room
// for two fp8 staging buffers; bf16 needs no staging, so three 32-token tiles fit instead.
// S: fp8 (64-token blocks) splits the tokens between the warpgroups (kSplitTokens); bf16
// (32-token blocks) splits the k-steps, since 16 tokens a warpgroup would read Q from shared
// memory twice as often per token (bench/NOTES.md v23: 9% slower).
template <KvFormat F>
struct Layout {
  static constexpr bool kBf16 = F == KvFormat::bf16;
  static constexpr bool kSplitTokens = !kBf16;
  static constexpr int kN = kBf16 ? 32 : 64;  // cache tokens per block
  static constexpr int kCols = 32;            // S columns per warpgroup (tokens)
  static_assert(kCols == (kSplitTokens ? kN / 2 : kN), "one m64n32 accumulator of S");
  static constexpr int kTiles = kBf16 ? 3 : 1;
  static constexpr int kStages = kBf16 ? 0 : 2;  // fp8 staging buffers
  static constexpr int kPanel = kN * 128;
  static constexpr int kTileBytes = 9 * kPanel;
  static constexpr int kPitch = 592;  // fp8 staging row pitch: conflict-free dequantization reads
  static constexpr int kStageBytes = kN * kPitch;
  static constexpr int kFlagSlots = 4;  // token flags of the blocks in flight
  static constexpr int kQ = 0;
  static constexpr int kTile = kQ + 9 * kQPanel;
  static constexpr int kRaw = kTile + kTiles * kTileBytes;
  // fp8: P (64 rows x 64 tokens, fp16) in the tile's rope panel, which only S reads: the half
  // of warpgroup g (its 32 tokens, 64-byte rows, 64-byte swizzle) in the panel rows of its own
  // tokens, which only its own S reads, so it may write them once its S has completed.
  static constexpr int kP = kTile + 8 * kPanel;
  static constexpr int kPHalf = kRows * kCols * 2;
  static_assert(kPHalf == kCols * 128, "a P half fills its warpgroup's rope-panel rows");
  // What the warpgroups swap: bf16 the partial S (64 x 32 fp32), fp8 each warpgroup's base for
  // P per row ([warpgroup][row]: the running max, or its block max where that moves the row).
  static constexpr int kSwap = kRaw + kStages * kStageBytes;
  static constexpr int kFlags = kSwap + (kSplitTokens ? 2 * kRows * 4 : kRows * kN * 4);
  static constexpr int kQInv = kFlags + kFlagSlots * kN;
  static constexpr int kQAmax = kQInv + kRows * 4;
  static constexpr int kSmemBytes = kQAmax + kRows * 4 + 1024;  // + slack to align to 1 KB
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// Q rows into the nine swizzled panels (zero rows past the tile). fp8 caches: fp16, each row
// scaled by 2^e (decode::q_row_exponent over its nope values and its ratio-scaled rope values),
// kQInv = 2^-e; bf16 caches: bf16 as given, kQInv = 1. Ends with a barrier.
template <KvFormat F>
__device__ __forceinline__ void load_q(const DecodeParams& p, const WorkTile& t, int q_first,
                                       float ratio, std::uint8_t* smem) {
  using L = Layout<F>;
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

// fp8: this warpgroup's 32 tokens of the block staged at `raw` into the fp16 tile (the rows its
// S reads): thread t of warpgroup g converts token 32 g + t % 32, dims 16 (t / 32) + 64 i of
// panel i (conflict-free: 8 consecutive threads read 8 rows 592 bytes apart and write 8 different
// swizzled units).
__device__ __forceinline__ void dequantize_own_tokens(const std::uint8_t* raw, std::uint8_t* smem) {
  using L = Layout<KvFormat::fp8_e4m3>;
  const int row = 32 * (threadIdx.x / 128) + threadIdx.x % 32, sub = threadIdx.x % 128 / 32;
  const std::uint8_t* src = raw + row * L::kPitch + 16 * sub;
  std::uint8_t* dst = smem + L::kTile;
#pragma unroll
  for (int i = 0; i < 9; ++i) {
    const uint4 c = *reinterpret_cast<const uint4*>(src + 64 * i);
    uint4 a, b;
    fp8x4_to_half2x2(c.x, a.x, a.y);
    fp8x4_to_half2x2(c.y, a.z, a.w);
    fp8x4_to_half2x2(c.z, b.x, b.y);
    fp8x4_to_half2x2(c.w, b.z, b.w);
    *reinterpret_cast<uint4*>(dst + i * L::kPanel + sw128(row, 32 * sub)) = a;
    *reinterpret_cast<uint4*>(dst + i * L::kPanel + sw128(row, 32 * sub + 16)) = b;
  }
}

// bf16: cp.async of block `blk` straight into tile blk % 3 and its flags: 8 threads per token,
// thread sub copies dims 8 sub + 64 i (panel i, swizzled unit sub) for i = 0..8; the page-table
// entry of block blk + 1 is loaded for the next call (decode::token_entry). One commit.
__device__ __forceinline__ void stage_bf16_block(const DecodeParams& p, const WorkTile& t,
                                                 int q_first, std::int32_t kv_base, int blk,
                                                 std::int32_t& entry, std::uint8_t* smem) {
  using L = Layout<KvFormat::bf16>;
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

// S of the tile at byte offset `tile` into this warpgroup's 64 x 32 accumulator. kSplitTokens:
// its 32 tokens, 36 k-steps of 16 dims (step k: panel k / 4, byte 32 (k % 4)); otherwise all 32
// tokens, k-steps 2 k + g of 36 (panel k / 2, byte 64 (k % 2) + 32 g): a partial sum. dq and dk
// carry the group's offset, so the descriptors differ by a register, not a branch (ptxas
// serializes every wgmma of a kernel that has a branch around one: C7520).
template <KvFormat F>
__device__ __forceinline__ void s_steps(float (&s)[Layout<F>::kCols / 2], std::uint64_t dq,
                                        std::uint64_t dk, std::uint32_t tile) {
  using L = Layout<F>;
  constexpr int kSteps = L::kSplitTokens ? 36 : 18, kPerPanel = kSteps / 9;
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int d = 128 / kPerPanel * (k % kPerPanel);
    const std::uint64_t a = desc_add(dq, (k / kPerPanel) * kQPanel + d);
    const std::uint64_t b = desc_add(dk, tile + (k / kPerPanel) * L::kPanel + d);
    wgmma_64x32x16_ss<L::kBf16>(s, a, b, k > 0);
  }
  wgmma_commit();
}

// bf16's partial-S exchange: float4 i of this thread's slots (xch[128 i]) holds s[4 i .. 4 i + 3];
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

}  // namespace wg

template <KvFormat F>
__global__ void __launch_bounds__(wg::kThreads, 1) mla_decode_wgmma_kernel(const DecodeParams p) {
  using namespace wg;
  using L = Layout<F>;
  constexpr int kN = L::kN;
  constexpr int kCols = L::kCols;
  DeviceTile tile;
  if (!decode::load_tile(p, tile)) return;
  pdl_launch_dependents();
  extern __shared__ std::uint8_t smem_base[];
  // The swizzle atoms need 1024-byte alignment.
  std::uint8_t* smem = smem_base + ((1024 - smem_addr(smem_base) % 1024) % 1024);
  const WorkTile t = tile.tile;
  // The warpgroup index broadcast from lane 0, so ptxas knows it is uniform and keeps the wgmma
  // descriptors in uniform registers (v8's first build moved each one with R2UR: 10% of all
  // instructions).
  const int group = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int rows = t.q_count * t.head_count;
  const int q_first = tile.q_first;
  const int qo_len = tile.qo_len;
  const int kv_len = tile.kv_len;
  const int n_blocks = (t.kv_end - t.kv_begin + kN - 1) / kN;

  const std::int32_t kv_base = tile.kv_base;
  std::uint8_t* flags = smem + L::kFlags;
  // fp8: this thread's token of the blocks staged next and after next is present (all present:
  // no flag reads).
  bool valid_next = false, valid_after = false;
  std::int32_t next_entry = 0;  // page-table entry of the next block to stage (token_entry)
  // fp8: block b's copies into staging buffer b % 2 (4 threads a token), one commit group.
  auto stage_fp8_block = [&](int b) {
    const std::int64_t slot = decode::entry_slot(p, t, b, next_entry);
    decode::copy_fp8_token(
        p, slot, smem + L::kRaw + (b % 2) * L::kStageBytes + (threadIdx.x / 4) * L::kPitch,
        flags + (b % L::kFlagSlots) * kN + threadIdx.x / 4);
    next_entry = decode::token_entry(p, t, q_first, kv_base, b + 1);
    return slot >= 0;
  };
  if constexpr (L::kBf16) {
    next_entry = decode::token_entry<kN, 8>(p, t, q_first, kv_base, 0);
    stage_bf16_block(p, t, q_first, kv_base, 0, next_entry, smem);
    stage_bf16_block(p, t, q_first, kv_base, 1, next_entry, smem);
  } else {
    next_entry = decode::token_entry(p, t, q_first, kv_base, 0);
    valid_next = stage_fp8_block(0);
    cp_async_commit();
    valid_after = stage_fp8_block(1);  // a one-block tile: zero-filled, nothing read
    cp_async_commit();
  }

  const float ratio = p.scale_pe / p.scale_nope;
  load_q<F>(p, t, q_first, ratio, smem);

  // This thread's rows (16 warp + g, + 8) of S, P and O. Rows past the tile (zero q, never
  // written) take no bound, so they do not force the masked path.
  int limit[2];
  float sc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + g + 8 * h;
    limit[h] = r < rows ? decode::row_limit(p, t, r, kv_len, qo_len) : INT32_MAX;
    sc[h] = p.scale_nope * reinterpret_cast<const float*>(smem + L::kQInv)[r];
  }
  const int limit_min = min(limit[0], limit[1]);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; summed over the quad at the end
  float o[4][32];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int r = 0; r < 32; ++r) o[c][r] = 0.0f;

  const std::uint8_t* tiles = smem + L::kTile;
  // S's descriptors carry the group's first token row (kSplitTokens) or first k-step.
  const std::uint64_t dq = wgmma_desc(smem + L::kQ + (L::kSplitTokens ? 0 : 32 * group), 16, 1024);
  const std::uint64_t dk =
      wgmma_desc(tiles + (L::kSplitTokens ? kCols * 128 : 32) * group, 16, 1024);
  const std::uint64_t dv = wgmma_desc(tiles + 4 * group * L::kPanel, L::kPanel, 1024);
  float* row_base = reinterpret_cast<float*>(smem + L::kSwap);  // fp8: [warpgroup][row]
  float4* xch = reinterpret_cast<float4*>(smem + L::kSwap) + threadIdx.x % 128;  // bf16
  // fp8: P's (row, token) (tokens in pairs or eights: 4 or 16 bytes).
  auto p_addr = [&](int row, int tok) {
    return smem + L::kP + L::kPHalf * (tok / kCols) + sw64(row, 2 * (tok % kCols));
  };
  const int own0 = L::kSplitTokens ? kCols * group : 0;  // the group's first token of S

  for (int blk = 0; blk < n_blocks; ++blk) {
    bool all_present;
    float s[kCols / 2];
    // Tile offset of this block, broadcast so the descriptors stay uniform.
    const auto tile =
        static_cast<std::uint32_t>(__shfl_sync(0xffffffffu, (blk % L::kTiles) * L::kTileBytes, 0));
    const std::uint8_t* fl = flags + (blk % L::kFlagSlots) * kN;
    if constexpr (L::kBf16) {
      cp_async_wait<1>();
      fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads async
      __syncthreads();      // block blk landed for all; every wgmma of block blk - 1 completed
      if (blk + 2 < n_blocks) {
        stage_bf16_block(p, t, q_first, kv_base, blk + 2, next_entry, smem);
      } else {
        cp_async_commit();  // one group per iteration: wait_group 1 always means block blk
      }
      s_steps<F>(s, dq, dk, tile);
      const uint4 f0 = reinterpret_cast<const uint4*>(fl)[0];
      const uint4 f1 = reinterpret_cast<const uint4*>(fl)[1];
      all_present = (f0.x & f0.y & f0.z & f0.w & f1.x & f1.y & f1.z & f1.w) == 0x01010101u;
    } else {
      cp_async_wait<1>();  // one group per block: block blk landed, blk + 1 may be in flight
      // Block blk staged for all; every wgmma of block blk - 1 has completed.
      all_present = __syncthreads_and(valid_next);
      // Each warpgroup converts the tokens its S reads, so a warpgroup barrier publishes them
      // (a CTA barrier here measured 4% slower, v23). Its rows of staging buffer blk % 2 are then
      // free: it alone reads and refills them (thread t copies token t / 4).
      dequantize_own_tokens(smem + L::kRaw + (blk % 2) * L::kStageBytes, smem);
      fence_proxy_async();
      named_barrier_sync(1 + group, 128);
      s_steps<F>(s, dq, dk, 0);
      // Block blk + 2's copies are issued while the tensor cores run S.
      valid_next = valid_after;
      if (blk + 2 < n_blocks) valid_after = stage_fp8_block(blk + 2);
      cp_async_commit();
    }
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    if constexpr (!L::kSplitTokens) {
      // The partial sums meet, and both warpgroups hold bit-identical scores. Whole-CTA
      // barriers: racecheck reported hazards on a bar.arrive / bar.sync hand-off (v9).
      if (group == 0) put_scores(s, xch);
      __syncthreads();
      if (group == 1) add_scores(s, xch);
      __syncthreads();
      if (group == 0) get_scores(s, xch);
    }

    // ---- masks and online softmax (fragment: s[r] is row 16 warp + g + 8 ((r / 2) % 2), token
    // own0 + 8 (r / 4) + 2 tq + r % 2); the max is taken on unscaled scores ----
    const int j0 = t.kv_begin + blk * kN;
    if (!__all_sync(0xffffffffu, all_present && j0 + kN - 1 <= limit_min)) {
#pragma unroll
      for (int r = 0; r < kCols / 2; ++r) {
        const int h = (r / 2) % 2, tok = own0 + 8 * (r / 4) + 2 * tq + r % 2;
        if (fl[tok] == 0 || j0 + tok > limit[h]) s[r] = -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int r = 0; r < kCols / 2; ++r) mx[(r / 2) % 2] = fmaxf(mx[(r / 2) % 2], s[r]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    // P (fp16 or bf16, the tile's type) = 2^(s sc - pbase) as wgmma A fragments, which are the
    // S accumulator's layout: k-step kk holds tokens 16 kk + [0, 16), pa[j] rows g + 8 (j % 2),
    // tokens + 2 tq + 8 (j / 2). A rounded product, never fused with the subtraction: the row max
    // is the rounded product of the max score, so the max gives 2^0 exactly (an FMA would expose
    // the product's rounding error, 2^52 in absolute terms for a row scaled by 2^60).
    float pbase[2];
    auto p_frags = [&](std::uint32_t(&pa)[4], int kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = 8 * kk + 2 * j, h = j % 2;
        const float p0 = fast_exp2(__fmul_rn(s[r], sc[h]) - pbase[h]);
        const float p1 = fast_exp2(__fmul_rn(s[r + 1], sc[h]) - pbase[h]);
        pa[j] = L::kBf16 ? float2_to_bf16x2(p0, p1) : float2_to_half2(p0, p1);
      }
    };
    // O += P V over the block's k-step kk (this warpgroup's 4 panels of 64 dims).
    auto pv = [&](const std::uint32_t(&pa)[4], int kk) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        wgmma_64x64x16_rs<1, L::kBf16>(o[c], pa, desc_add(dv, tile + c * L::kPanel + kk * 2048), 1);
    };
    // Row sums of what the tensor cores multiply (the rounded p), so o / l is exact.
    auto add_sums = [&](const std::uint32_t(&pa)[4]) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = L::kBf16 ? bf16x2_to_float2(pa[j])
                                  : __half22float2(*reinterpret_cast<const __half2*>(&pa[j]));
        row_sum[j % 2] += f.x + f.y;
      }
    };
    // O and the row sums times f (per row); only when a row of the warp has f != 1.
    auto rescale = [&](const float(&f)[2]) {
      if (__any_sync(0xffffffffu, f[0] != 1.0f || f[1] != 1.0f)) {
#pragma unroll
        for (int c = 0; c < 4; ++c)
#pragma unroll
          for (int r = 0; r < 32; ++r) o[c][r] *= f[(r / 2) % 2];
        row_sum[0] *= f[0], row_sum[1] *= f[1];
      }
    };
    // A row's base moves to a block's max m only when m exceeds it by more than kMaxSlack; p is
    // then at most 2^8. f: the factor from the old base to the new (0 when a row first sees a
    // token); rows with nothing visible yet keep base -inf and take p's offset 0.
    auto new_base = [](float old, float m) { return m > old + kMaxSlack ? m : old; };
    auto factor = [](float from, float to) { return from == to ? 1.0f : fast_exp2(from - to); };
    if constexpr (L::kSplitTokens) {
      // fp8: this warpgroup's 32 tokens at its own base (the running max, or its block max
      // where that moves the row), multiplied into O at once. Warp w of each warpgroup holds
      // rows 16 w .. 16 w + 15: the two warps of those rows then swap bases and P halves through
      // a 64-thread barrier (named barrier 3 + w) and bring O and the partner's half to the
      // larger base; both see the same pair of bases, so the running max stays identical.
      float base[2], f[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        base[h] = new_base(row_max[h], __fmul_rn(mx[h], sc[h]));  // sc > 0
        f[h] = factor(row_max[h], base[h]);
        pbase[h] = base[h] == -INFINITY ? 0.0f : base[h];
        if (tq == 0) row_base[kRows * group + 16 * warp + g + 8 * h] = base[h];
      }
      rescale(f);
      std::uint32_t own[2][4];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        p_frags(own[kk], kk);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<std::uint32_t*>(p_addr(
              16 * warp + g + 8 * (j % 2), own0 + 16 * kk + 2 * tq + 8 * (j / 2))) = own[kk][j];
      }
      wgmma_fence();
      pv(own[0], 2 * group);
      pv(own[1], 2 * group + 1);
      wgmma_commit();
      add_sums(own[0]);
      add_sums(own[1]);
      named_barrier_sync(3 + warp, 64);  // the partner's base and half of P
      float fo[2], fp[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float other = row_base[kRows * (1 - group) + 16 * warp + g + 8 * h];
        row_max[h] = fmaxf(base[h], other);
        fo[h] = factor(base[h], row_max[h]);
        fp[h] = factor(other, row_max[h]);
      }
      // The partner's half (ldmatrix matrix i: rows + 8 (i % 2), tokens + 8 (i / 2)).
      std::uint32_t part[2][4];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
        ldmatrix_x4(part[kk],
                    p_addr(16 * warp + lane % 16, kCols * (1 - group) + 16 * kk + 8 * (lane / 16)));
      if (__any_sync(0xffffffffu, fp[0] != 1.0f || fp[1] != 1.0f)) {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&part[kk][j]));
            part[kk][j] = float2_to_half2(v.x * fp[j % 2], v.y * fp[j % 2]);
          }
      }
      wgmma_wait<0>();  // own half done: O may be rescaled
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
      rescale(fo);
      wgmma_fence();
      pv(part[0], 2 * (1 - group));
      pv(part[1], 2 * (1 - group) + 1);
      wgmma_commit();
      add_sums(part[0]);
      add_sums(part[1]);
    } else {
      // bf16: both warpgroups hold all 32 scores of the block.
      float f[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float b = new_base(row_max[h], __fmul_rn(mx[h], sc[h]));
        f[h] = factor(row_max[h], b);
        row_max[h] = b;
        pbase[h] = b == -INFINITY ? 0.0f : b;
      }
      std::uint32_t pa[kN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) p_frags(pa[kk], kk);
      rescale(f);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) pv(pa[kk], kk);
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) add_sums(pa[kk]);
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
