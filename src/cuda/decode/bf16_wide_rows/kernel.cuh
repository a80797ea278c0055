// bf16_wide_rows: bf16 tiles of 17-64 rows on dense page tables with pages of >= 64 tokens
// (src/core/dispatch.h). Two warpgroups and no producer; one CTA per SM.
//
// One idea: FlashMLA's dense sm90 schedule (its "seesaw"): blocks go in pairs, b0 = 2i in tile 0
// and b1 = 2i + 1 in tile 1, and one warpgroup's softmax runs while the other's products keep the
// tensor cores busy. Warpgroup g owns output dims [256g, 256g + 256) (V panels 4g .. 4g + 3) and
// computes S of its own block of the pair; warpgroup 0 runs b0's softmax on the rows' shared
// running base, warpgroup 1 b1's from it, each multiplying both P V into its half. Each panel has
// its own mbarrier; a tile's half is refilled by tensor-map boxes (one 64 x 128-byte box a panel)
// issued by the warpgroup that read it last, as soon as that read completes, and S of the next
// block reads the panels in the order they were freed. Q's rope panel is kept in registers, which
// frees its shared memory for warpgroup 1's P. Handoffs between the warpgroups are mbarriers (not
// named-barrier arrive / sync), which racecheck models. Tokens past the tile's end in its last
// block are masked in S and zeroed in V (P is 0 there, but 0 * NaN would not be).
#pragma once

#include <cstdint>
#include <type_traits>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/epilogue.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/q.cuh"
#include "src/cuda/ops/softmax.cuh"
#include "src/cuda/ops/sync.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::bf16_wide_rows {

// The shared tile operations (src/cuda/ops).
using namespace ops;

inline constexpr int kN = 64;            // cache tokens a block
inline constexpr int kPanel = kN * 128;  // 64 tokens x 64 bf16 dims
inline constexpr int kTileBytes = 9 * kPanel;
inline constexpr int kThreads = rows64::kThreads;  // the two warpgroups, no producer

struct Layout {
  static constexpr bool kBf16 = true;  // ops::load_q_panels: Q as given
  static constexpr int kQ = 0;  // nine panels; panel 8 holds warpgroup 1's P once Q's rope is read
  static constexpr int kTile = kQ + 9 * rows64::kQPanel;     // [2]
  static constexpr int kP0 = kTile + 2 * kTileBytes;         // warpgroup 0's P, at b1's base
  static constexpr int kBase = kP0 + kPanel;                 // [row] the running base (log2 units)
  static constexpr int kScale0 = kBase + rows64::kRows * 4;  // [row] O's factor, b0's softmax
  static constexpr int kScale1 = kScale0 + rows64::kRows * 4;  // [row] O's factor, b1's softmax
  static constexpr int kSums = kScale1 + rows64::kRows * 4;    // [warpgroup][row] sums at the end
  static constexpr int kQInv = kSums + 2 * rows64::kRows * 4;
  static constexpr int kOnes = kQInv + rows64::kRows * 4;  // [token] 1: a copied block has them all
  static constexpr int kBars = kOnes + kN;                 // [tile][panel] mbarriers
  static constexpr int kHandoffs = kBars + 18 * 8;         // [4] mbarriers (kScale0Ready ..)
  static constexpr int kSmemBytes = kHandoffs + 4 * 8 + 1024;  // + slack to align to 1 KB
  static_assert(kSmemBytes <= 227 * 1024, "Q and two tiles fit in shared memory");
  static_assert(kTile % 1024 == 0 && kP0 % 1024 == 0, "swizzle atoms stay aligned");
};

// One-way handoffs between the two warpgroups, once per pair of blocks: mbarriers of 128
// arrivals (the sender's threads; the receiver waits for pair i's phase, parity i % 2).
// FlashMLA uses named-barrier arrive / sync for these; racecheck does not model barrier.arrive
// and flags such handoffs even in correct code, so these are checkable.
inline constexpr int kScale0Ready = 0;  // 0 -> 1: b0's base and factors written
inline constexpr int kScale1Ready = 1;  // 1 -> 0: b1's base and factors written
inline constexpr int kP0Ready = 2;      // 0 -> 1: P0 (at b1's base) written
inline constexpr int kP1Ready = 3;      // 1 -> 0: P1 written
// Named barriers (0: __syncthreads, 1: rows64::kConsumerBarrier): + warpgroup, its 128 threads.
inline constexpr int kGroupBarrier = 2;

// The page-table entry of block blk's page (pages of >= 64 tokens, blocks 64-aligned: one page).
__device__ __forceinline__ std::int32_t block_entry(const DecodeParams& p, const DeviceTile& tile,
                                                    int blk) {
  const int j0 = tile.tile.kv_begin + blk * kN;
  return j0 < tile.tile.kv_end ? p.kv_indices[tile.kv_base + (j0 >> p.page_shift)] : 0;
}

// Panels [k0, k1) of block blk (page entry e) into `tile`, each counted on its own mbarrier.
template <int k0, int k1>
__device__ __forceinline__ void copy_panels(const DecodeParams& p, const WorkTile& t, int blk,
                                            std::int32_t e, std::uint8_t* tile,
                                            std::uint8_t* bars) {
  const int y = (t.kv_begin + blk * kN) & ((1 << p.page_shift) - 1);
#pragma unroll
  for (int k = k0; k < k1; ++k) {
    mbar_arrive_expect_tx(bars + 8 * k, kPanel);
    if (k < 8) {
      tma_load_3d(tile + k * kPanel, &p.ckv_map, 128 * k, y, e, bars + 8 * k);
    } else {
      tma_load_3d(tile + k * kPanel, &p.kpe_map, 0, y, e, bars + 8 * k);
    }
  }
}

// S's panel k (Q's panel k times the tile's, at descriptors dq / dk; panel 8's Q from registers)
// into s: four k-steps, one commit group, once the panel's copy (phase `parity`) has landed.
template <int k, bool kFirst>
__device__ __forceinline__ void s_panel(float (&s)[32], std::uint64_t dq, std::uint64_t dk,
                                        const std::uint32_t (&qpe)[4][4], std::uint8_t* bars,
                                        unsigned parity) {
  mbar_wait(bars + 8 * k, parity);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int acc = !kFirst || kk > 0;
    if constexpr (k < 8) {
      wgmma_64x64x16_ss<0, true>(s, desc_add(dq, k * rows64::kQPanel + 32 * kk),
                                 desc_add(dk, k * kPanel + 32 * kk), acc);
    } else {
      wgmma_64x64x16_rs<true>(s, qpe[kk], desc_add(dk, k * kPanel + 32 * kk), acc);
    }
  }
  wgmma_commit();
}
template <int k0, int k1, bool kFirst>
__device__ __forceinline__ void s_panels(float (&s)[32], std::uint64_t dq, std::uint64_t dk,
                                         const std::uint32_t (&qpe)[4][4], std::uint8_t* bars,
                                         unsigned parity) {
  s_panel<k0, kFirst>(s, dq, dk, qpe, bars, parity);
  if constexpr (k0 + 1 < k1) s_panels<k0 + 1, k1, false>(s, dq, dk, qpe, bars, parity);
}

// P's floats (the S accumulator's layout) times f per row, as bf16 A fragments.
__device__ __forceinline__ void pack_p(std::uint32_t (&pa)[4][4], const float (&s)[32],
                                       const float (&f)[2]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = 8 * kk + 2 * j;
      pa[kk][j] = float2_to_bf16x2(s[r] * f[j % 2], s[r + 1] * f[j % 2]);
    }
}

// Rows [valid, kN) of V panels [k0, k0 + 4) of a tile set to zero by one warpgroup and made
// visible to its wgmma (the tile's S has completed).
__device__ __forceinline__ void zero_v_rows(std::uint8_t* tile, int k0, int valid, int group) {
  for (int i = threadIdx.x % 128; i < (kN - valid) * 32; i += 128) {
    const int row = valid + i / 32, k = k0 + i / 8 % 4;
    *reinterpret_cast<uint4*>(tile + k * kPanel + row * 128 + 16 * (i % 8)) =
        make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier_sync(kGroupBarrier + group, 128);
}

// kHalfIo: the instantiation for plans with fp16 queries or outputs (KernelEntry::half_fn).
template <bool kHalfIo>
__global__ void __launch_bounds__(kThreads, 1)
    bf16_wide_rows_kernel(const __grid_constant__ DecodeParams p) {
  using L = Layout;
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  std::uint8_t* smem = dynamic_smem_1k();
  const WorkTile t = tile.tile;
  const int group = ops::uniform_warpgroup();
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, tq = lane % 4;
  const int n_blocks = (t.kv_end - t.kv_begin + kN - 1) / kN;
  std::uint8_t* tiles = smem + L::kTile;
  std::uint8_t* bars = smem + L::kBars;  // tile u's panel k: bars + 72 u + 8 k
  float* base_of = reinterpret_cast<float*>(smem + L::kBase);
  float* scale0 = reinterpret_cast<float*>(smem + L::kScale0);
  float* scale1 = reinterpret_cast<float*>(smem + L::kScale1);
  float* sums = reinterpret_cast<float*>(smem + L::kSums);
  const std::uint8_t* ones = smem + L::kOnes;
  // Copies: warpgroup 0's thread 0 issues panels 0-3 of both tiles, warpgroup 1's panels 4-8;
  // each holds the entries of the blocks its next copies fetch (e[u]: tile u's next block),
  // the first two read before the wait where they are the plan's own
  // (DecodeParams::entries_before_wait), else after it.
  const bool issuer = threadIdx.x % 128 == 0;
  std::int32_t e[2] = {};
  const auto first_entries = [&] {
    if (issuer) {
      e[0] = block_entry(p, tile, 0);
      e[1] = block_entry(p, tile, 1);
    }
  };
  if (p.entries_before_wait) first_entries();

  if (threadIdx.x == 0) {
    for (int i = 0; i < 18; ++i) mbar_init(bars + 8 * i, 1);
    for (int h = 0; h < 4; ++h) mbar_init(smem + L::kHandoffs + 8 * h, 128);
    fence_mbar_init();
  }
  if (threadIdx.x < rows64::kRows) base_of[threadIdx.x] = -INFINITY;
  if (threadIdx.x < kN / 4)
    reinterpret_cast<std::uint32_t*>(smem + L::kOnes)[threadIdx.x] = 0x01010101u;
  __syncthreads();
  ops::begin_after_previous_kernel();
  if (!p.entries_before_wait) first_entries();
  // Block blk into tile u (= blk % 2, a constant: e[] stays in registers), this issuer's panels.
  auto issue = [&](int blk, auto u_const, auto half) {
    constexpr int u = decltype(u_const)::value;
    constexpr int k0 = decltype(half)::value == 0 ? 0 : 4, k1 = k0 == 0 ? 4 : 9;
    copy_panels<k0, k1>(p, t, blk, e[u], tiles + u * kTileBytes, bars + 72 * u);
    e[u] = block_entry(p, tile, blk + 2);
  };
  constexpr std::integral_constant<int, 0> kTile0{}, kLeft{};
  constexpr std::integral_constant<int, 1> kTile1{}, kRight{};
  if (issuer) {
    const auto run = [&](auto half) {
      if (n_blocks > 0) issue(0, kTile0, half);
      if (n_blocks > 1) issue(1, kTile1, half);
    };
    if (group == 0) {
      run(kLeft);
    } else {
      run(kRight);
    }
  }
  ops::load_q_panels<L, kHalfIo>(p, t, tile.q_first, 1.0f,
                                 smem);  // ends with a barrier of both warpgroups
  // Q's rope panel into registers (S's panel 8 takes A from them); warpgroup 1 writes P1 there
  // only after warpgroup 0's first kScale0Ready, which follows these loads.
  std::uint32_t qpe[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    ldmatrix_x4(qpe[kk], ops::frag_addr(smem + L::kQ + 8 * rows64::kQPanel, warp, lane, kk));

  int limit[2];
  float sc[2];
  ops::row_bounds(p, tile, warp, g, reinterpret_cast<const float*>(smem + L::kQInv), limit, sc);
  limit[0] = min(limit[0], t.kv_end - 1);  // tokens past the tile (a split's end) are not its own
  limit[1] = min(limit[1], t.kv_end - 1);
  const int limit_min = min(limit[0], limit[1]);
  const int row0 = 16 * warp + g;  // this thread's rows: row0, row0 + 8

  const std::uint64_t dq = wgmma_desc(smem + L::kQ, 16, 1024);
  const std::uint64_t dk = wgmma_desc(tiles, 16, 1024);
  // P V: this warpgroup's 4 V panels; the leading offset (one panel) steps m64n256k16 across them.
  const std::uint64_t dv = wgmma_desc(tiles + 4 * group * kPanel, kPanel, 1024);
  float o[4][32];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int r = 0; r < 32; ++r) o[c][r] = 0.0f;
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns of its rows
  float s[32] = {};  // S, then P's floats (warpgroup 1 without a second block: masked whole)
  // O[:, 256 group + [0, 256)] += P V of tile u, P as A fragments; one commit group.
  auto pv = [&](int u, const std::uint32_t(&pa)[4][4]) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_64x256x16_rs<true>(o, pa[kk], desc_add(dv, u * kTileBytes + kk * 2048));
    wgmma_commit();
  };
  auto valid_tokens = [&](int blk) { return min(kN, t.kv_end - t.kv_begin - blk * kN); };
  // The softmax of block blk's S on the shared running base: s becomes P's floats, f O's factor
  // for the rows (also stored at `factor`).
  auto softmax = [&](int blk, float* factor, float(&f)[2]) {
    const int j0 = t.kv_begin + blk * kN;
    float mx[2];
    ops::mask_and_max(s, mx, j0 + kN - 1 <= limit_min, ones, j0, limit);
    float pbase[2], nb[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float old = base_of[row0 + 8 * h];
      nb[h] = ops::new_base(old, __fmul_rn(mx[h], sc[h]));  // sc > 0
      f[h] = ops::factor(old, nb[h]);
      pbase[h] = nb[h] == -INFINITY ? 0.0f : nb[h];
    }
    __syncwarp();  // the quad's reads of the old base before its write
    if (tq == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) base_of[row0 + 8 * h] = nb[h], factor[row0 + 8 * h] = f[h];
    }
#pragma unroll
    for (int r = 0; r < 32; ++r) {
      const int h = (r / 2) % 2;
      s[r] = fast_exp2(__fmul_rn(s[r], sc[h]) - pbase[h]);
    }
  };
  const float one[2] = {1.0f, 1.0f};
  auto send = [&](int h) { mbar_arrive(smem + L::kHandoffs + 8 * h); };
  auto receive = [&](int h, int pair) { mbar_wait(smem + L::kHandoffs + 8 * h, pair & 1); };

  if (group == 0) {
    // ---- warpgroup 0: b0's softmax and P0 V0, P1 V1, S of b0 + 2 ----
    if (n_blocks > 0) {
      s_panels<0, 9, true>(s, dq, dk, qpe, bars, 0);
      wgmma_wait<0>();
      wgmma_fence_operand(s);
    }
    for (int i = 0; 2 * i < n_blocks; ++i) {
      const int b0 = 2 * i, b1 = b0 + 1;
      const bool has1 = b1 < n_blocks, next0 = b0 + 2 < n_blocks, next1 = b1 + 2 < n_blocks;
      float f0[2];
      softmax(b0, scale0, f0);
      std::uint32_t pa[4][4];
      pack_p(pa, s, one);
      ops::rescale_o(o, f0);
      row_sum[0] *= f0[0], row_sum[1] *= f0[1];
      ops::add_sums(row_sum, s);
      send(kScale0Ready);
      if (valid_tokens(b0) < kN) zero_v_rows(tiles, 0, valid_tokens(b0), 0);
      pv(0, pa);
      wgmma_wait<0>();
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
      // V0's left half is read: refilled at once (before the wait for warpgroup 1's softmax,
      // where FlashMLA issues it, which is slower here).
      if (next0 && issuer) issue(b0 + 2, kTile0, kLeft);
      receive(kScale1Ready, i);
      float f1[2] = {1.0f, 1.0f};
      if (has1) f1[0] = scale1[row0], f1[1] = scale1[row0 + 8];
      if (__any_sync(0xffffffffu, f1[0] != 1.0f || f1[1] != 1.0f)) pack_p(pa, s, f1);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        stmatrix_x4(ops::frag_addr(smem + L::kP0, warp, lane, kk), pa[kk]);
      send(kP0Ready);
      if (has1) {
        receive(kP1Ready, i);
        ops::rescale_o(o, f1);
        row_sum[0] *= f1[0], row_sum[1] *= f1[1];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ldmatrix_x4(pa[kk], ops::frag_addr(smem + L::kQ + 8 * rows64::kQPanel, warp, lane, kk));
        if (valid_tokens(b1) < kN) zero_v_rows(tiles + kTileBytes, 0, valid_tokens(b1), 0);
        pv(1, pa);
      }
      if (next0) s_panels<0, 4, true>(s, dq, dk, qpe, bars, (i + 1) & 1);
      if (next1) {
        wgmma_wait<4>();  // P1 V1: V1's left half read (S's four groups may run on)
        if (issuer) issue(b1 + 2, kTile1, kLeft);
      }
      if (next0) s_panels<4, 9, false>(s, dq, dk, qpe, bars, (i + 1) & 1);
      wgmma_wait<0>();
      wgmma_fence_operand(s);
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
    }
  } else {
    // ---- warpgroup 1: b1's softmax, P1 V1 and P0 V0, S of b1 + 2 ----
    if (n_blocks > 1) {
      s_panels<4, 9, true>(s, dq, desc_add(dk, kTileBytes), qpe, bars + 72, 0);
      s_panels<0, 4, false>(s, dq, desc_add(dk, kTileBytes), qpe, bars + 72, 0);
      wgmma_wait<0>();
      wgmma_fence_operand(s);
    }
    for (int i = 0; 2 * i < n_blocks; ++i) {
      const int b0 = 2 * i, b1 = b0 + 1;
      const bool has1 = b1 < n_blocks, next0 = b0 + 2 < n_blocks, next1 = b1 + 2 < n_blocks;
      receive(kScale0Ready, i);
      const float f0[2] = {scale0[row0], scale0[row0 + 8]};
      // Without a block b1 (an odd count's last pair) every column is past the rows' limits: P1
      // is 0, the base stays and f1 is 1. Run unconditionally, the softmax keeps ptxas from
      // serializing the wgmmas (C7515: S's registers otherwise flow unchanged around the loop).
      float f1[2];
      softmax(b1, scale1, f1);
      std::uint32_t pa[4][4];
      pack_p(pa, s, one);
      const float f[2] = {f0[0] * f1[0], f0[1] * f1[1]};
      ops::rescale_o(o, f);
      row_sum[0] *= f[0], row_sum[1] *= f[1];
      ops::add_sums(row_sum, s);
      send(kScale1Ready);
      if (has1) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          stmatrix_x4(ops::frag_addr(smem + L::kQ + 8 * rows64::kQPanel, warp, lane, kk), pa[kk]);
        if (valid_tokens(b1) < kN) zero_v_rows(tiles + kTileBytes, 4, valid_tokens(b1), 1);
        pv(1, pa);
      }
      receive(kP0Ready, i);
      std::uint32_t pb[4][4];  // P0; pa may still be read by P1 V1 in flight
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        ldmatrix_x4(pb[kk], ops::frag_addr(smem + L::kP0, warp, lane, kk));
      if (valid_tokens(b0) < kN) zero_v_rows(tiles, 4, valid_tokens(b0), 1);
      pv(0, pb);
      if (has1) send(kP1Ready);
      if (next1) {
        wgmma_wait<1>();  // P1 V1: V1's right half read
        if (issuer) issue(b1 + 2, kTile1, kRight);
      }
      wgmma_wait<0>();  // P0 V0: V0's right half read
      if (next0 && issuer) issue(b0 + 2, kTile0, kRight);
      if (next1) {
        s_panels<4, 9, true>(s, dq, desc_add(dk, kTileBytes), qpe, bars + 72, (i + 1) & 1);
        s_panels<0, 4, false>(s, dq, desc_add(dk, kTileBytes), qpe, bars + 72, (i + 1) & 1);
      }
      wgmma_wait<0>();
      wgmma_fence_operand(s);
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
    }
  }

  // ---- both: the rows' sums meet; O's halves share the final base ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] = ops::quad_sum(row_sum[h]);
    if (tq == 0) sums[group * rows64::kRows + row0 + 8 * h] = row_sum[h];
  }
  named_barrier_sync(rows64::kConsumerBarrier, kThreads);
  float m[2], l[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m[h] = base_of[row0 + 8 * h];
    l[h] = sums[row0 + 8 * h] + sums[rows64::kRows + row0 + 8 * h];
  }
  ops::store_rows<kHalfIo>(p, tile, group, warp, lane, o, m, l);
}

}  // namespace fp8mla::detail::bf16_wide_rows
