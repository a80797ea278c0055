// The fp8_e4m3 decode kernel for tiles of <= 16 rows on pages of >= 8 tokens (dense page tables):
// S on fp8 tensor cores with the cache bytes as they are. The fragment kernel
// (decode_fp8_kernel.cuh) converts every K code to fp16 for mma.sync (sm_90 has no fp8
// mma.sync), and at ~650 instructions per warp and block that count, not a pipe, sets its pace
// (bench/NOTES.md v16, v17). wgmma multiplies e4m3 by e4m3 when both operands are K-major, and
// S^T = K Q^T has both K-major as stored: A = the block's 64 tokens of 576 code bytes, B = Q^T.
// Per block:
//   * the TMA engine copies each page run of the block (min(page_size, 64) tokens) as 128-byte
//     x run tiles of a tensor map, 128-byte swizzled (ckv, four 8 KB slabs) and 64-byte
//     swizzled (kpe, one 4 KB slab): wgmma's operand layout, which per-token bulk copies cannot
//     write;
//   * Q: bf16 q rows, scaled per row by 2^e so that max |q| is in [2^7, 2^8), are two e4m3
//     terms, q = hi + lo / 16 (hi = e4m3(q), lo = e4m3(16 (q - hi))): exact for every element
//     above 2^-6, since q - hi is at most 8 units of q's last place. hi and lo are wgmma's 32
//     N columns (rows 0-15 and 16-31 of the B operand); q_pe carries kpe_scale / ckv_scale, a
//     power of two (the launcher's condition), so the fold is exact (e4m3_row_scales);
//   * S: warpgroup w multiplies 9 of the 18 k-steps of 32 dims (m64n32k32); the sums meet
//     through a 4 KB exchange (the fragment kernel: 64 KB of partial sums), and each thread
//     finishes 2 tokens x 2 rows: tokens 16 (warp % 4) + g (+ 8), rows 8 (warp / 4) + 2 tq (+ 1);
//   * softmax and O += P V as in the fragment kernel (P fp16 through shared memory, V's codes
//     converted into mma.sync B fragments), V read from the swizzled slabs.
// Tokens past the tile's end inside a copied page run (and rows of runs not copied) are zeroed
// before P V reads them: P is 0 there, but 0 * NaN would not be.
// Pages of < 8 tokens run decode_fp8_gather_kernel.cuh (a one-token box into the swizzled layout
// faults, bench/NOTES.md v50), which shares this file's store_q_terms, block_max, p_bits,
// row_total and TokenProducer.
#pragma once

#include <cstdint>
#include <type_traits>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_fp8_kernel.cuh"
#include "src/cuda/decode_kernel.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace fp8tma {

// The fragment kernel's CTA (8 warps, 64-token blocks, 16 rows, two stages) and P pitch.
using fp8frag::kBlockN;
using fp8frag::kPElems;
using fp8frag::kRows;
using fp8frag::kStages;
using fp8frag::kThreads;
using fp8frag::kWarps;
inline constexpr int kN = 2 * kRows;            // wgmma N: the hi and lo terms of each q row
inline constexpr int kSlab = kBlockN * 128;     // 128 ckv dims of a block (128-byte swizzle)
inline constexpr int kRopeSlab = kBlockN * 64;  // its 64 rope dims (64-byte swizzle)
inline constexpr int kStageBytes = 4 * kSlab + kRopeSlab;
inline constexpr int kQSlab = kN * 128;
inline constexpr int kQBytes = 4 * kQSlab + kN * 64;
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
static_assert(kMinBlocks * (kSmemBytes + 1024) + decode::kMergeCtaSmem <= 228 * 1024,
              "two CTAs and a merge CTA must fit an SM");
static_assert(kQ % 1024 == 0 && kStageBytes % 1024 == 0, "swizzle atoms stay aligned");

// This warpgroup's 9 k-steps of S^T = K Q^T into d[c] (m64n32 accumulators): warpgroup w takes
// ckv slabs 2 w and 2 w + 1 (8 steps) and rope step w, so both run the same code on offset
// descriptors (a branch per warpgroup made ptxas serialize the wgmma). a_* / b_*: the
// descriptors of the stage's and Q's slab 2 w and rope step w.
// Hopper's fp8 MMA keeps its accumulator to 13 mantissa bits, truncating (SageAttention2,
// DeepSeek-V3 report), so one chain of 9 steps loses ~2e-4 of a score's magnitude: steps go to
// kChains chains of 3 (step i to chain i / 3), summed in fp32 (bench/NOTES.md v20: the output
// error at scores ~50 drops from 2.4-3.6e-3 to ~1e-3 for 0-4% of time; 4 chains gained little
// more at 128 registers, above the 112 this kernel may use (decode::kMaxRegsTwoCtas); 9 make
// ptxas serialize the wgmma).
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

// 8 bf16 values times `scale` times `scale2` -> their hi and lo e4m3 codes (8 bytes each,
// lowest dim first).
__device__ __forceinline__ void split_e4m3(uint4 v, float scale, float scale2, uint2& hi,
                                           uint2& lo) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
  std::uint32_t h[2] = {0, 0}, l[2] = {0, 0};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = bf16x2_to_float2(w[k]);
    const float2 x = make_float2(f.x * scale * scale2, f.y * scale * scale2);
    const __nv_fp8x2_storage_t hc = __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
    const float2 back = fp8x2_to_float2(hc);
    const __nv_fp8x2_storage_t lc = __nv_cvt_float2_to_fp8x2(
        make_float2((x.x - back.x) * 16.0f, (x.y - back.y) * 16.0f), __NV_SATFINITE, __NV_E4M3);
    h[k / 2] |= static_cast<std::uint32_t>(hc) << (16 * (k % 2));
    l[k / 2] |= static_cast<std::uint32_t>(lc) << (16 * (k % 2));
  }
  hi = make_uint2(h[0], h[1]);
  lo = make_uint2(l[0], l[1]);
}

// Row scales for the e4m3 terms. The rope's products are scaled by scale_pe and the nope's by
// scale_nope, so q_pe carries r = scale_pe / scale_nope (a power of two: q_pe * r is exact, and
// pe_a, pe_b are powers of two) and the row takes one exponent e, with
// max(|q_nope|, |q_pe| r) * 2^e in [2^7, 2^8) (e4m3 holds up to 448); 2^-e is undone on the
// scores. Exponents are added as integers, so no product overflows: q_nope * nope and
// (q_pe * pe_a) * pe_b are the scaled values. Rows of zeros keep e = 0.
struct RowScales {
  float nope, pe_a, pe_b;
  int e;
};
__device__ __forceinline__ RowScales e4m3_row_scales(float amax_nope, float amax_pe,
                                                     float scale_nope, float scale_pe) {
  int en = 0, ep = 0, ek = 0, es = 0, eq = 0;
  frexpf(amax_nope, &en);  // amax in [2^(en-1), 2^en)
  const float mp = frexpf(amax_pe, &ep);
  const float r = frexpf(scale_pe, &es) / frexpf(scale_nope, &ek);  // in (1/2, 2)
  frexpf(mp * r, &eq);
  const int e_pe = ep + eq + es - ek;  // |q_pe| r in [2^(e_pe-1), 2^e_pe)
  const int top =
      amax_nope > 0.0f ? (amax_pe > 0.0f ? max(en, e_pe) : en) : (amax_pe > 0.0f ? e_pe : 8);
  const int e = min(max(8 - top, -125), 125);
  const int a = min(max(-ep, -126), 126);  // q_pe * 2^a ~ 1, then * r 2^(e - a + es - ek)
  return {__int_as_float((127 + e) << 23), __int_as_float((127 + a) << 23),
          ldexpf(r, e - a + es - ek), e};
}

// Byte offset of q column n (0..31), 8-dim chunk c (0..71) in a Q operand at byte kQAt.
template <int kQAt>
__device__ __forceinline__ int q_offset(int n, int c) {
  return c < 64 ? kQAt + c / 16 * kQSlab + n / 8 * 1024 + sw128(n % 8, c % 16 * 8)
                : kQAt + 4 * kQSlab + n / 8 * 512 + sw64(n % 8, (c - 64) * 8);
}

// Q row q_r (q_v: its 16-byte chunks q_part + 16 i, fp8frag::load_q_chunks, 16 threads a row)
// as the B operand at byte kQAt of smem: the row's exponent (e4m3_row_scales) from the |q|
// maxima of its 16 threads, its hi and lo e4m3 terms (split_e4m3; a row holding inf or NaN gets
// NaN codes, so its outputs are NaN, never a finite guess), and scale[q_r] = scale_nope * 2^-e
// for the scores.
template <int kQAt>
__device__ __forceinline__ void store_q_terms(const DecodeParams& p, const uint4 (&q_v)[5], int q_r,
                                              int q_part, std::uint8_t* smem, float* scale) {
  std::uint32_t mn = 0, mp = 0;  // |q| maxima as float bits (NaN above inf)
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const int c = q_part + 16 * i;
    if (c < 64) mn = max(mn, decode::abs_max_bits(q_v[i]));
    if (c >= 64 && c < 72) mp = max(mp, decode::abs_max_bits(q_v[i]));
  }
#pragma unroll
  for (int x = 8; x >= 1; x /= 2) {
    mn = max(mn, __shfl_xor_sync(0xffffffffu, mn, x));
    mp = max(mp, __shfl_xor_sync(0xffffffffu, mp, x));
  }
  const bool bad = mn >= 0x7f800000u || mp >= 0x7f800000u;
  const RowScales rs = e4m3_row_scales(bad ? 0.0f : __uint_as_float(mn),
                                       bad ? 0.0f : __uint_as_float(mp), p.scale_nope, p.scale_pe);
#pragma unroll
  for (int i = 0; i < 5; ++i) {
    const int c = q_part + 16 * i;
    if (c >= 72) continue;
    uint2 hi, lo;
    split_e4m3(q_v[i], c < 64 ? rs.nope : rs.pe_a, c < 64 ? 1.0f : rs.pe_b, hi, lo);
    if (bad) hi = make_uint2(0x7f7f7f7fu, 0x7f7f7f7fu);
    *reinterpret_cast<uint2*>(smem + q_offset<kQAt>(q_r, c)) = hi;
    *reinterpret_cast<uint2*>(smem + q_offset<kQAt>(q_r + kRows, c)) = lo;
  }
  if (q_part == 0) scale[q_r] = p.scale_nope * __int_as_float((127 - rs.e) << 23);
  fence_proxy_async();  // the generic stores above, read by wgmma (async proxy)
}

// The max over the 4 warps' values of a row and the row's running max: the thread that writes
// a row's P and the thread that rescales its O compute it alike, so they agree exactly.
__device__ __forceinline__ float block_max(const float* red_row, float running) {
  const float4 m = *reinterpret_cast<const float4*>(red_row);
  return fmaxf(fmaxf(fmaxf(m.x, m.y), fmaxf(m.z, m.w)), running);
}

// ---- the block steps the <= 16-row kernels share (this one, decode_bf16_tma_kernel.cuh,
// decode_fp8_gather_kernel.cuh) ----
// The kStages stages' mbarriers, `full` (full_arrivals a phase) and `released`
// (released_arrivals), made visible to the TMA engine; one thread sets them up, before a barrier
// shows them to the others.
template <int kStages = 2>
__device__ __forceinline__ void init_stage_barriers(std::uint8_t* full, unsigned full_arrivals,
                                                    std::uint8_t* released,
                                                    unsigned released_arrivals) {
  for (int s = 0; s < kStages; ++s) mbar_init(full + 8 * s, full_arrivals);
  for (int s = 0; s < kStages; ++s) mbar_init(released + 8 * s, released_arrivals);
  fence_mbar_init();
}

// The copies: lane i of warp 0 copies page run i of a block (np runs of run = min(page_size, 64)
// tokens) as kCkvSlabs ckv slabs of 128 bytes a token and one kpe slab of kKpeRow bytes a token
// (the tensor maps' boxes), completing on the stage's mbarrier (kTokenBytes a token); a
// block's page-table entries are loaded a block before its copies.
template <int kCkvSlabs, int kKpeRow>
struct PageRunCopier {
  static constexpr int kTokenBytes = kCkvSlabs * 128 + kKpeRow;
  int lane, run, np, kv_begin, kv_end, kv_base;
  bool copier;
  __device__ PageRunCopier(const DecodeParams& p, const DeviceTile& tile, int warp, int l)
      : lane(l),
        run(min(1 << p.page_shift, kBlockN)),
        np(kBlockN / run),
        kv_begin(tile.tile.kv_begin),
        kv_end(tile.tile.kv_end),
        kv_base(tile.kv_base),
        copier(warp == 0 && l < np) {}
  __device__ int first(int blk) const { return kv_begin + blk * kBlockN + lane * run; }
  __device__ std::int32_t entry(const DecodeParams& p, int blk) const {
    const int j = first(blk);
    return j < kv_end ? p.kv_indices[kv_base + (j >> p.page_shift)] : 0;
  }
  // Before the kernel reads anything the kernel before it may write: the first two blocks'
  // entries (copier lanes), the stages' mbarriers (full: np arrivals, one a page run; released:
  // kWarps, lane 0 of each warp), then decode::begin_after_previous_kernel.
  __device__ void start(const DecodeParams& p, std::uint8_t* full, std::uint8_t* released,
                        std::int32_t& entry0, std::int32_t& entry1) const {
    if (copier) {
      entry0 = entry(p, 0);
      entry1 = entry(p, 1);
    }
    if (threadIdx.x == 0) init_stage_barriers(full, np, released, kWarps);
    decode::begin_after_previous_kernel();
  }
  // A warp's reads of the stage whose `released` mbarrier this is are done: lane 0 arrives for
  // the warp (one copier thread writes the stage).
  __device__ void release(void* released) const {
    __syncwarp();
    if (lane == 0) mbar_arrive(released);
  }
  // Block blk's run `lane` (page `page`) into the stage at `dst`; an arrival alone past the end.
  __device__ void issue(const DecodeParams& p, int blk, std::int32_t page, std::uint8_t* dst,
                        void* bar) const {
    const int j = first(blk);
    if (j < kv_end) {
      mbar_arrive_expect_tx(bar, run * kTokenBytes);
      const int y = j & ((1 << p.page_shift) - 1);
#pragma unroll
      for (int c = 0; c < kCkvSlabs; ++c)
        tma_load_3d(dst + c * kSlab + lane * run * 128, &p.ckv_map, 128 * c, y, page, bar);
      tma_load_3d(dst + kCkvSlabs * kSlab + lane * run * kKpeRow, &p.kpe_map, 0, y, page, bar);
    } else {
      mbar_arrive(bar);
    }
  }
};

// The top of block blk's iteration for a PageRunCopier (two stages at `stages`, kStageBytes apart,
// their full and released mbarriers): block blk + 1 goes into block blk - 1's stage once every
// warp has released it (a stage mbarrier, not a CTA barrier: the other warps run on;
// bench/NOTES.md v19), block blk + 2's entries are loaded, then every thread waits for block blk
// to land.
template <int kStageBytes, class Copier>
__device__ __forceinline__ void next_block(const Copier& runs, const DecodeParams& p, int blk,
                                           int n_blocks, std::int32_t& next_entry,
                                           std::uint8_t* stages, std::uint8_t* full,
                                           std::uint8_t* released) {
  if (runs.copier && blk + 1 < n_blocks && blk >= 1)
    mbar_wait(released + 8 * ((blk + 1) % 2), ((blk - 1) / 2) % 2);
  if (runs.copier && blk + 1 < n_blocks) {
    const int next = (blk + 1) % 2;
    runs.issue(p, blk + 1, next_entry, stages + next * kStageBytes, full + 8 * next);
    next_entry = runs.entry(p, blk + 2);
  }
  mbar_wait(full + 8 * (blk % 2), (blk / 2) % 2);  // block blk landed
}

// The gather kernels' copies (pages of < 8 tokens, where a one-token box into the swizzled
// layout faults, bench/NOTES.md v50, and bf16's long tiles at any page size, v67b): four producer
// warps beside the kThreads math threads, lanes 0-15 of producer warp w copying tokens 16 w + lane
// of each block, one bulk copy a token (decode::bulk_copy_token: kCkv + kKpe bytes) into a
// kPitch-byte row of a kStageBytes stage; a token past the tile's end is zero-filled, so P V reads
// zeros there (its flag byte lands in the row's padding, unread: dense page tables only, whose mask
// is kv_end). ptxas issues a bulk copy once per active lane through the uniform datapath: issued by
// the math warps (v65, v66) that loop sat on their chain, one producer warp issued too slowly for
// the copies (1.25x), two or four keep the copies at their rate alone (v67). A stage completes on
// its full mbarrier (kBlockN arrivals, one a token) and is released by the kReleasers math threads
// that read it (each thread arrives: with lane 0 arriving for its warp after a __syncwarp,
// racecheck reports the copies against the other lanes' reads,
// bench/results/h200_v66_bf16_gather_ab.txt).
inline constexpr int kProducerWarps = 4;
inline constexpr int kProducerLanes = kBlockN / kProducerWarps;
static_assert(kProducerLanes <= 32, "a token a producer lane");
template <bool kGather>
inline constexpr int kCtaThreads = kThreads + (kGather ? 32 * kProducerWarps : 0);

template <int kStages, int kStageBytes, int kPitch, int kCkv, int kKpe, int kReleasers = kThreads>
struct TokenProducer {
  static_assert(kPitch > kCkv + kKpe, "the flag byte lands in the padding");
  // The producer warps' whole work: the stages' mbarriers (kStages at `full`, kStages at
  // `released`), blocks 0 .. kStages - 1, the CTA barrier after which the math warps wait on the
  // mbarriers (cta_sync), then block blk into stage blk % kStages once block blk - kStages is
  // released. Page-table entries are loaded a block ahead of their copies. pwarp: the producer
  // warp, 0..kProducerWarps - 1.
  __device__ static void run(const DecodeParams& p, const DeviceTile& tile, int pwarp, int lane,
                             int n_blocks, std::uint8_t* stages, std::uint8_t* full,
                             std::uint8_t* released) {
    const int tok = kProducerLanes * pwarp + lane;
    const bool copier = lane < kProducerLanes;
    std::int32_t e0 = copier ? entry(p, tile, 0, tok) : 0;
    std::int32_t e1 = copier ? entry(p, tile, 1, tok) : 0;
    if (pwarp == 0 && lane == 0) init_stage_barriers<kStages>(full, kBlockN, released, kReleasers);
    bar_sync_aligned<2, 32 * kProducerWarps>();  // the mbarriers, before any producer uses them
    decode::begin_after_previous_kernel();
    const auto issue = [&](int blk) {
      if (copier) {
        const int stage = blk % kStages;
        std::uint8_t* row = stages + stage * kStageBytes + tok * kPitch;
        decode::bulk_copy_token<kCkv, kKpe>(
            p, decode::entry_slot_of<kBlockN>(p, tile.tile, blk, e0, tok), row, row + kCkv + kKpe,
            full + 8 * stage);
        e0 = e1;
        e1 = entry(p, tile, blk + 2, tok);
      }
    };
    for (int blk = 0; blk < min(n_blocks, kStages); ++blk) issue(blk);
    cta_sync();
    for (int blk = kStages; blk < n_blocks; ++blk) {
      mbar_wait(released + 8 * (blk % kStages), (blk / kStages - 1) % 2);
      issue(blk);
    }
  }
  // The CTA's one barrier of all its warps (after the mbarriers' set-up and Q), reached from
  // different instructions by the producer and the math warps.
  __device__ static void cta_sync() { named_barrier_sync(0, kCtaThreads<true>); }

 private:
  __device__ static std::int32_t entry(const DecodeParams& p, const DeviceTile& tile, int blk,
                                       int tok) {
    return decode::token_entry_of<kBlockN>(p, tile.tile, tile.q_first, tile.kv_base, blk, tok);
  }
};

// The math warps' barrier: the CTA's, or (kProducer) named barrier 1 of the kThreads math
// threads, which a producer warp beside them never joins.
template <bool kProducer>
__device__ __forceinline__ void math_sync() {
  if constexpr (kProducer)
    bar_sync_aligned<1, kThreads>();
  else
    __syncthreads();
}

// A thread's S entries: tokens tok0 = 16 (warp % 4) + g and tok0 + 8 of the block, P rows
// pr = 8 wg + 2 tq and pr + 1, as (tok0, pr), (tok0, pr + 1), (tok0 + 8, pr), (tok0 + 8, pr + 1).

// The two warpgroups' partial products summed: rows0 / rows1 are this thread's entries of rows
// 2 tq (+ 1) and 8 + 2 tq (+ 1); warpgroup wg keeps rows 8 wg .. 8 wg + 7 and sends the others
// through xch ([warpgroup][thread] float4). One math_sync.
template <bool kProducer = false>
__device__ __forceinline__ void exchange_rows(const float (&rows0)[4], const float (&rows1)[4],
                                              int wg, float4* xch, float (&full)[4]) {
  // Selects, not an index by wg: a register array indexed at run time would live in local memory.
  float mine[4], theirs[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    mine[e] = wg == 0 ? rows0[e] : rows1[e];
    theirs[e] = wg == 0 ? rows1[e] : rows0[e];
  }
  xch[(1 - wg) * 128 + threadIdx.x % 128] = make_float4(theirs[0], theirs[1], theirs[2], theirs[3]);
  math_sync<kProducer>();
  const float4 recv = xch[wg * 128 + threadIdx.x % 128];
  full[0] = mine[0] + recv.x;
  full[1] = mine[1] + recv.y;
  full[2] = mine[2] + recv.z;
  full[3] = mine[3] + recv.w;
}

// Rows n_valid .. 63 of a stage's first kSlabs slabs (the ones P V reads) set to zero: P is 0
// there, but 0 * NaN would not be. The stage's S is done (both warpgroups waited on their
// products before the exchange's barrier).
template <int kSlabs>
__device__ __forceinline__ void zero_rows_past(std::uint8_t* kv, int n_valid) {
  for (int i = threadIdx.x; i < (kBlockN - n_valid) * kSlabs * 8; i += kThreads) {
    const int row = n_valid + i / (kSlabs * 8);
    *reinterpret_cast<uint4*>(kv + (i / 8 % kSlabs) * kSlab + row * 128 + i % 8 * 16) =
        make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();  // before a later block's TMA copies into these bytes
}

// A thread's online-softmax state in the <= 16-row TMA kernels: the running maxima of its P rows
// pr, pr + 1 and of its O rows g, g + 8 (the same values: each side computes them alike, so no
// exchange), the P rows' running sums over its tokens only (summed over the warpgroup at the end,
// reduce_row_sums), and its O fragments (fp8frag::write_row's mapping).
struct RowState {
  float max_p[2] = {-INFINITY, -INFINITY}, max_o[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float o[8][4];
  __device__ RowState() {
#pragma unroll
    for (int n = 0; n < 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  }
};

// p rounded to P's type (fp16 for the fp8 kernel's P V, bf16 for the bf16 kernel's): its bits,
// and the value the tensor cores will multiply.
template <class PT>
__device__ __forceinline__ std::uint16_t p_bits(float p, float& rounded) {
  if constexpr (std::is_same_v<PT, __half>) {
    const __half h = __float2half_rn(p);
    rounded = __half2float(h);
    return __half_as_ushort(h);
  } else {
    const __nv_bfloat16 b = __float2bfloat16_rn(p);
    rounded = __bfloat162float(b);
    return __bfloat16_as_ushort(b);
  }
}

// One block's online softmax for a thread's S entries `full`: scores full * sc (sc: the rows'
// scales) masked past the tile's end (kv_end, tokens j0 + ..) and the causal limits, the rows'
// block maxima over the warpgroup's four warps (red_max[row][4]), P rows pr, pr + 1 into p_s,
// and st updated: maxima, running sums of the rounded P, O's rows g, g + 8 rescaled. Two
// math_syncs.
template <class PT, bool kProducer = false>
__device__ __forceinline__ void softmax_block(const float (&full)[4], const float (&sc)[2], int j0,
                                              int kv_end, const int (&limit_p)[2], int tok0, int pr,
                                              int g, int wr, float* red_max, std::uint16_t* p_s,
                                              RowState& st) {
  const int tok1 = tok0 + 8;
  float s[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int k = e % 2, tok = e < 2 ? tok0 : tok1;
    const bool ok = j0 + tok < kv_end && j0 + tok <= limit_p[k];
    s[e] = ok ? full[e] * sc[k] : -INFINITY;
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float mx = fmaxf(s[k], s[2 + k]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    if (g == 0) red_max[(pr + k) * 4 + wr] = mx;
  }
  math_sync<kProducer>();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = pr + k;
    const float mx = block_max(red_max + r * 4, st.max_p[k]);
    const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
    const float alpha = fast_exp2(st.max_p[k] - base);
    st.max_p[k] = mx;
    float pa, pb;
    p_s[r * fp8frag::kPElems + tok0] = p_bits<PT>(fast_exp2(s[k] - base), pa);
    p_s[r * fp8frag::kPElems + tok1] = p_bits<PT>(fast_exp2(s[2 + k] - base), pb);
    // Sum what the tensor cores multiply (the rounded p), so o / l stays exact.
    st.row_sum[k] = st.row_sum[k] * alpha + (pa + pb);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mx = block_max(red_max + (g + 8 * h) * 4, st.max_o[h]);
    const float base = mx == -INFINITY ? 0.0f : mx;
    const float alpha = fast_exp2(st.max_o[h] - base);
    st.max_o[h] = mx;
    fp8frag::rescale_rows(st.o, h, alpha);
  }
  math_sync<kProducer>();
}

// The P rows' sums over the warpgroup into red_sum[row][4] (red_max's memory: a barrier first),
// then a barrier; row_total adds a row's four.
template <bool kProducer = false>
__device__ __forceinline__ void reduce_row_sums(const float (&row_sum)[2], int pr, int g, int wr,
                                                float* red_sum) {
  math_sync<kProducer>();  // red_max (same memory) is no longer read
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float sum = row_sum[k];
    sum += __shfl_xor_sync(0xffffffffu, sum, 4);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    if (g == 0) red_sum[(pr + k) * 4 + wr] = sum;
  }
  math_sync<kProducer>();
}
__device__ __forceinline__ float row_total(const float* red_sum, int r) {
  const float4 l4 = *reinterpret_cast<const float4*>(red_sum + r * 4);
  return (l4.x + l4.y) + (l4.z + l4.w);
}

}  // namespace fp8tma

__global__ void __maxnreg__(decode::kMaxRegsTwoCtas)
    mla_decode_fp8_tma_kernel(const __grid_constant__ DecodeParams p) {
  using namespace fp8tma;
  DeviceTile tile;
  if (!decode::load_tile(p, tile)) return;
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  // Swizzle atoms need a 1024-byte aligned base; offsetting smem_raw (not rounding a cast
  // integer) keeps the pointer visibly in shared memory, so accesses stay LDS / STS. Written
  // here rather than as dynamic_smem_1k(): with that helper ptxas spills 4 bytes in this kernel
  // (nvcc 13.0, at its 112-register cap).
  std::uint8_t* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  const WorkTile t = tile.tile;
  const auto [warp, lane, g, tq, wg, wr] = decode::thread_roles();
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
  fp8frag::load_q_chunks(p, t, q_first, rows, q_r, q_part, q_v);
  __syncthreads();
  if (copier && n_blocks > 0) runs.issue(p, 0, entry0, smem + kKv, smem + kBar);
  store_q_terms<kQ>(p, q_v, q_r, q_part, smem, reinterpret_cast<float*>(smem + kScale));
  __syncthreads();

  // This thread's S entries: tokens tok0, tok0 + 8 of the block, rows pr, pr + 1 (its P rows).
  const int tok0 = 16 * wr + g;
  const int pr = 8 * wg + 2 * tq;
  const int limit_p[2] = {decode::row_limit(p, t, pr, kv_len, qo_len),
                          decode::row_limit(p, t, pr + 1, kv_len, qo_len)};
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
    wgmma_commit();
    wgmma_wait<0>();
    float d[16];
#pragma unroll
    for (int c = 0; c < kChains; ++c) wgmma_fence_operand(dc[c]);
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      d[e] = dc[0][e];
#pragma unroll
      for (int c = 1; c < kChains; ++c) d[e] += dc[c][e];
    }
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
    // column 64 warp + 8 g + n (the fragment kernel's mapping) ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[4];
      ldmatrix_x4(a, p_s + (lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      // tokens 16 kk + 2 tq (+ 1): rows of atom 2 kk; + 8 (+ 9): atom 2 kk + 1
      const uint2 v0 = *reinterpret_cast<const uint2*>(kv + v_even + 2048 * kk);
      const uint2 v1 = *reinterpret_cast<const uint2*>(kv + v_odd + 2048 * kk);
      const uint2 v8 = *reinterpret_cast<const uint2*>(kv + v_even + 2048 * kk + 1024);
      const uint2 v9 = *reinterpret_cast<const uint2*>(kv + v_odd + 2048 * kk + 1024);
      fp8frag::pv_step(st.o, a, v0, v1, v8, v9);
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
    const decode::RowEnd end = decode::finish_row(st.max_o[h], row_total(red_sum, r), p.out_scale);
    fp8frag::write_row(p, t, tile, warp, tq, h, r, st.o, end);
  }
}

}  // namespace fp8mla::detail
