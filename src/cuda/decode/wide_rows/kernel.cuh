// wide_rows: tiles of 17-64 rows (128-head models run two 64-row tiles a request) of every
// format except bf16 on dense pages of >= 64 tokens (src/core/dispatch.h). One CTA of three
// warpgroups per WorkTile, one CTA per SM.
//
// One idea: warp specialization, so the tensor cores work while another warpgroup fetches. Q
// (nine 128-byte-swizzled panels, fp16 scaled per row for fp8 caches, bf16 as given) and two
// 64-token 16-bit tiles fill shared memory. Warpgroup 2 (the producer) fills tile b % 2 with
// block b once both consumers are done with block b - 2: fp8 codes loaded into registers a block
// ahead and converted into the tile (exact; block-format codes times their block scales into a
// bf16 tile, BlockShare), bf16 by cp.async straight into it. Warpgroup 0
// computes S = Q K^T (m64n64k16), the online softmax, writes P into the tile's rope panel (dead
// once S has read it) and O[:, 0:256] += P V with P in registers (m64n256k16); warpgroup 1
// multiplies O[:, 256:512] += P V. Three mbarrier pairs hand the tiles over: full (2 -> 0),
// ready (0 -> 1: P and the factors written), free (0 and 1 -> 2). setmaxnreg moves registers to
// where they are needed (Regs). fp8 q_pe carries kpe_scale / ckv_scale before its fp16 rounding:
// exact when the ratio is a power of two, else one fp16 rounding (2^-11 relative) of q_pe.
#pragma once

#include <cstdint>
#include <type_traits>

#include "src/cuda/decode/wide_rows/producer.cuh"
#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/epilogue.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/q.cuh"
#include "src/cuda/ops/softmax.cuh"
#include "src/cuda/ops/sync.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::wide_rows {

// The shared tile operations (src/cuda/ops).
using namespace ops;

// P of block tile `tile` (64 rows x 64 tokens, 16-bit, in the tile's rope panel once S has read
// it): lane `lane`'s ldmatrix / stmatrix address for k-step kk (ops::frag_addr).
__device__ __forceinline__ std::uint8_t* p_frag_addr(std::uint8_t* smem, int tile, int warp,
                                                     int lane, int kk) {
  return ops::frag_addr(smem + Layout<false>::kTile + tile * kTileBytes + 8 * kPanel, warp, lane,
                        kk);
}

// Threads and registers: warpgroups 0 and 1 consume (S, softmax, P V), warpgroup 2 fetches.
// The launch gives every thread kLaunchRegs (65,536 / 384, rounded down to 8); setmaxnreg then
// moves them to where they are needed: warpgroup 0 holds O's half, S and P (216), warpgroup 1
// O's half and P (176; 168 and 160 spill), the producer one fp8 block's loads (112). The block
// format's producer needs 120 for its share and the conversions (112 spill); its warpgroup 0,
// bf16 products, fits 208 (fp8's spills there).
inline constexpr int kThreads = 3 * 128;
inline constexpr int kLaunchRegs = 168;
template <KvFormat F>
struct Regs {
  static constexpr bool kBlockFmt = F == KvFormat::fp8_e4m3_block;
  static constexpr int kConsumer0 = kBlockFmt ? 208 : 216;
  static constexpr int kConsumer1 = 176;
  static constexpr int kProducer = kBlockFmt ? 120 : 112;
  static_assert(kConsumer0 + kConsumer1 + kProducer <= 3 * kLaunchRegs, "register pool exceeded");
};

// F: the cache format. bf16 and the block format share the bf16 tile (Q as given, bf16
// products); fp8_e4m3 takes the fp16 tile. kHalfIo: the instantiation for plans with fp16 queries
// or outputs (KernelEntry::half_fn); the other holds no fp16 conversion (ops::load_q_panels).
template <KvFormat F, bool kHalfIo>
__global__ void __launch_bounds__(kThreads, 1) wide_rows_kernel(const DecodeParams p) {
  constexpr bool kBf16 = F != KvFormat::fp8_e4m3;
  constexpr bool kBlockFmt = F == KvFormat::fp8_e4m3_block;
  using L = Layout<kBf16>;
  DeviceTile tile;
  if (!ops::load_tile(p, tile)) return;
  ops::begin_after_previous_kernel();
  std::uint8_t* smem = dynamic_smem_1k();
  const WorkTile t = tile.tile;
  const int group = ops::uniform_warpgroup();  // the role
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int q_first = tile.q_first;
  const int n_blocks = (t.kv_end - t.kv_begin + kN - 1) / kN;
  std::uint8_t* full = smem + L::kBars;  // producer -> warpgroup 0: the block is in
  std::uint8_t* ready = full + 16;       // warpgroup 0 -> 1: P and the factors written
  std::uint8_t* freed = ready + 16;      // warpgroups 0 and 1 -> producer: done with the tile
  float* factor = reinterpret_cast<float*>(smem + L::kFactor);
  if (threadIdx.x == 0) {
    for (int i = 0; i < 4; ++i) mbar_init(full + 8 * i, 128);  // full, ready: one warpgroup
    for (int i = 4; i < 6; ++i) mbar_init(full + 8 * i, 256);  // freed: both consumers
    fence_mbar_init();
  }
  __syncthreads();

  if (group == 2) {
    // ---- warpgroup 2: fetches block b into tile b % 2 once both consumers are done with
    // block b - 2. fp8: loads into registers a block ahead, converts into the tile; bf16:
    // cp.async copies, two blocks in flight. Entries are loaded a block before their use
    // (ops::token_entry_of): fp8 per token e[0..1], bf16 e[0..3] (one per block, e[0], for
    // contiguous blocks) ----
    setmaxnreg_dec<Regs<F>::kProducer>();
    if (n_blocks == 0) return;
    constexpr bool kCopies = kBf16 && !kBlockFmt;  // bf16: cp.async; else loads and stores
    constexpr int kEntries = kCopies ? 4 : 2;
    constexpr int kToken = kCopies ? 1152 : 576;  // bytes of a fused token
    // These two the same for the whole CTA.
    const bool contig = !kBlockFmt && contiguous_blocks<kBf16>(p, t);
    const bool fused = kBlockFmt ? block_pool(p) : fused_pool<kToken>(p);
    std::int32_t e[kEntries] = {};
    auto entries = [&](int blk) {
#pragma unroll
      for (int j = 0; j < kEntries; ++j) {
        if (j > 0 && contig) break;
        const int tok = contig ? 0 : kCopies ? copy_token(j) : share_token(j);
        e[j] = ops::token_entry_of<kN>(p, t, q_first, tile.kv_base, blk, tok);
      }
    };
    entries(0);
    // The register-staged producers (fp8 codes, the block format): block blk's loads (into the
    // share, a block ahead; the entries move on by a block), stored into tile blk % 2 once both
    // consumers are done with block blk - 2.
    auto stage_in_registers = [&](auto load, auto store) {
      load(0);
      for (int blk = 0; blk < n_blocks; ++blk) {
        const int s = blk & 1;
        if (blk >= 2) mbar_wait(freed + 8 * s, ((blk - 2) >> 1) & 1);
        store(blk, s);
        fence_proxy_async();  // st.shared and cp.async are generic-proxy writes; wgmma reads async
        mbar_arrive(full + 8 * s);
        if (blk + 1 < n_blocks) load(blk + 1);
      }
    };
    if constexpr (kBlockFmt) {
      BlockShare sh;
      stage_in_registers(
          [&](int blk) {
            load_block_share(p, t, blk, e, fused, sh);
            entries(blk + 1);
          },
          [&](int, int s) {
            store_block_share(p, sh, smem, s);
            cp_async_wait<0>();  // the rope
          });
    } else if constexpr (kCopies) {
      auto copy = [&](int blk) {  // into tile blk % 2; the entries move on by a block
        copy_bf16_block(p, t, blk, e, contig, fused, smem, blk & 1);
        entries(blk + 1);
      };
      copy(0);
      if (n_blocks > 1) {
        copy(1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      fence_proxy_async();  // cp.async writes are generic-proxy; wgmma reads async
      mbar_arrive(full);
      for (int blk = 0; blk < n_blocks; ++blk) {
        const int s = blk & 1;
        if (blk + 1 < n_blocks) {  // block blk + 1's copies (the only group in flight) are in
          cp_async_wait<0>();
          fence_proxy_async();
          mbar_arrive(full + 8 * (s ^ 1));
        }
        if (blk + 2 < n_blocks) {
          mbar_wait(freed + 8 * s, (blk >> 1) & 1);
          copy(blk + 2);
        }
      }
    } else {
      Share sh;
      stage_in_registers(
          [&](int blk) {
            if (contig) {
              load_block_units(p, t, blk, e[0], sh);
            } else {
              load_share(p, t, blk, e, fused, sh);
            }
            entries(blk + 1);
          },
          [&](int blk, int s) {
            if (contig) {
              store_block_units(sh, smem, s, block_tokens(t, blk));
            } else {
              store_share(sh, smem, s);
            }
          });
    }
    return;
  }

  // ---- warpgroups 0 and 1: Q, then per block: warpgroup 0 S, the softmax, P (for both) and
  // P V of output dims [0, 256); warpgroup 1 P V of [256, 512) with P from shared memory ----
  auto consume = [&](auto role) {
    constexpr int kGroup = decltype(role)::value;
    ops::load_q_panels<L, kHalfIo>(p, t, q_first, p.scale_pe / p.scale_nope,
                                   smem);  // ends with a barrier
    float o[4][32];
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int r = 0; r < 32; ++r) o[c][r] = 0.0f;
    const std::uint8_t* tiles = smem + L::kTile;
    // P V: this warpgroup's 4 panels of V (output dims 256 kGroup + [0, 256)); the leading
    // offset (one panel) steps m64n256k16 from one 64-column part to the next.
    const std::uint64_t dv = wgmma_desc(tiles + 4 * kGroup * kPanel, kPanel, 1024);
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};  // warpgroup 0: this thread's columns, summed over the quad
    float2* stats = reinterpret_cast<float2*>(smem + L::kStats);
    // O[:, 256 kGroup + [0, 256)] += P V of the block at tile offset off, P as A fragments; one
    // commit group.
    auto pv = [&](std::uint32_t off, const std::uint32_t(&pa)[4][4]) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_64x256x16_rs<kBf16>(o, pa[kk], desc_add(dv, off + kk * 2048));
      wgmma_commit();
    };

    if constexpr (kGroup == 1) {
      for (int blk = 0; blk < n_blocks; ++blk) {
        const int s = blk & 1;
        mbar_wait(ready + 8 * s, (blk >> 1) & 1);
        const float f[2] = {factor[s * rows64::kRows + 16 * warp + g],
                            factor[s * rows64::kRows + 16 * warp + g + 8]};
        // P (the tile's rope panel) as A fragments: read once, not once per V panel as an
        // operand from shared memory would be (8 KB a block instead of 32 KB).
        std::uint32_t pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) ldmatrix_x4(pa[kk], p_frag_addr(smem, s, warp, lane, kk));
        ops::rescale_o(o, f);
        pv(static_cast<std::uint32_t>(__shfl_sync(0xffffffffu, s * kTileBytes, 0)), pa);
        wgmma_wait<0>();
#pragma unroll
        for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
        mbar_arrive(freed + 8 * s);
      }
      named_barrier_sync(rows64::kConsumerBarrier, rows64::kThreads);  // the rows' max and sum
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 v = stats[16 * warp + g + 8 * h];
        row_max[h] = v.x, row_sum[h] = v.y;
      }
    } else {
      const int tq = lane % 4;
      int limit[2];
      float sc[2];
      ops::row_bounds(p, tile, warp, g, reinterpret_cast<const float*>(smem + L::kQInv), limit, sc);
      const int limit_min = min(limit[0], limit[1]);
      const std::uint64_t dq = wgmma_desc(smem + L::kQ, 16, 1024);
      const std::uint64_t dk = wgmma_desc(tiles, 16, 1024);
      for (int blk = 0; blk < n_blocks; ++blk) {
        const int s = blk & 1;
        const auto off = static_cast<std::uint32_t>(__shfl_sync(0xffffffffu, s * kTileBytes, 0));
        bool released = false;
        if (blk >= 1 && !__shfl_sync(0xffffffffu, mbar_test(full + 8 * s, (blk >> 1) & 1), 0)) {
          // The block is not in: release tile s ^ 1 once P V(blk - 1) completes rather than
          // after S(blk) issues, so that the producer's next fill need not wait for this one.
          wgmma_wait<0>();
          mbar_arrive(freed + 8 * (s ^ 1));
          released = true;
        }
        mbar_wait(full + 8 * s, (blk >> 1) & 1);
        float sacc[32];
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 36; ++k)
          wgmma_64x64x16_ss<0, kBf16>(sacc, desc_add(dq, (k / 4) * rows64::kQPanel + 32 * (k % 4)),
                                      desc_add(dk, off + (k / 4) * kPanel + 32 * (k % 4)), k > 0);
        wgmma_commit();
        if (blk >= 1 && !released) {
          // This warpgroup's P V of block blk - 1 has completed: tile s ^ 1 is free of it (its S
          // completed before that P V); the producer refills it once warpgroup 1 is done too.
          wgmma_wait<1>();
          mbar_arrive(freed + 8 * (s ^ 1));
        }
        wgmma_wait<0>();  // S
        wgmma_fence_operand(sacc);
#pragma unroll
        for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);

        const std::uint8_t* fl = smem + L::kFlags + s * kN;
        const uint4* f4 = reinterpret_cast<const uint4*>(fl);
        const uint4 a = f4[0], b = f4[1], c = f4[2], d = f4[3];
        const bool all_present = (a.x & a.y & a.z & a.w & b.x & b.y & b.z & b.w & c.x & c.y & c.z &
                                  c.w & d.x & d.y & d.z & d.w) == 0x01010101u;
        const int j0 = t.kv_begin + blk * kN;
        float mx[2];
        ops::mask_and_max(sacc, mx, all_present && j0 + kN - 1 <= limit_min, fl, j0, limit);
        float f[2], pbase[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float base = ops::new_base(row_max[h], __fmul_rn(mx[h], sc[h]));  // sc > 0
          f[h] = ops::factor(row_max[h], base);
          row_max[h] = base;
          pbase[h] = base == -INFINITY ? 0.0f : base;
          if (tq == 0) factor[s * rows64::kRows + 16 * warp + g + 8 * h] = f[h];
        }
        // P into the rope panel of tile s (S has read it), for warpgroup 1's P V.
        std::uint32_t pa[4][4];
        float psum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          ops::p_frags<kBf16>(pa[kk], sacc, kk, sc, pbase, psum);
          stmatrix_x4(p_frag_addr(smem, s, warp, lane, kk), pa[kk]);
        }
        // No proxy fence: warpgroup 1 reads P by ldmatrix, in the same (generic) proxy, and no
        // wgmma reads this panel before the producer refills it behind its own fence.
        mbar_arrive(ready + 8 * s);
        ops::rescale_o(o, f);
        row_sum[0] = row_sum[0] * f[0] + psum[0], row_sum[1] = row_sum[1] * f[1] + psum[1];
        pv(off, pa);
      }
      wgmma_wait<0>();
#pragma unroll
      for (int c = 0; c < 4; ++c) wgmma_fence_operand(o[c]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_sum[h] = ops::quad_sum(row_sum[h]);
        if (tq == 0) stats[16 * warp + g + 8 * h] = make_float2(row_max[h], row_sum[h]);
      }
      named_barrier_sync(rows64::kConsumerBarrier, rows64::kThreads);  // the rows' max and sum
    }
    ops::store_rows<kHalfIo>(p, tile, kGroup, warp, lane, o, row_max, row_sum);
  };
  if (group == 0) {
    setmaxnreg_inc<Regs<F>::kConsumer0>();
    consume(std::integral_constant<int, 0>{});
  } else {
    setmaxnreg_inc<Regs<F>::kConsumer1>();
    consume(std::integral_constant<int, 1>{});
  }
}

}  // namespace fp8mla::detail::wide_rows
