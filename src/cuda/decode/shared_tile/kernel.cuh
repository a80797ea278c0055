// shared_tile: the block format (fp8_e4m3_block) at every row count and bf16 sparse lists of
// <= 16 rows (src/core/dispatch.h). One CTA (8 warps) per WorkTile.
//
// One idea: dequantize each block of 64 cache tokens into a bf16 tile in shared memory, then run
// bf16 mma.sync on it as K for S = Q K^T and as V for O += P V. Per block: copy the tokens' raw
// bytes (cp.async, 16 bytes a thread, kStages blocks ahead; bf16: one bulk copy a token onto a
// stage mbarrier), dequantize the block format's codes into the tile (exact: power-of-two block
// scales), S with warp w owning tokens [8w, 8w + 8) of all rows, the online softmax in fp32
// (log2 domain, row max and sum exchanged through shared memory), O with warp w owning columns
// [64w, 64w + 64). Block-format tiles of <= 16 rows (Smem::kDirect) load straight into registers
// and dequantize into the tile, so two CTAs fit an SM and one CTA's loads overlap the other's
// math. Sparse tiles read token j through the index list.
#pragma once

#include <cfloat>
#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/epilogue.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/softmax.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::shared_tile {

// The shared tile operations (src/cuda/ops).
using namespace ops;

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kBlockN = 64;         // cache tokens per block
inline constexpr int kRowElems = 576 + 8;  // bf16 row pitch in smem: 1168 B, ldmatrix conflict-free
inline constexpr int kPElems = kBlockN + 8;

constexpr int raw_token_bytes(KvFormat f) {
  return f == KvFormat::bf16 ? 0 : 656;
}

// Shared-memory plan of one instantiation. bf16 caches are staged straight into the bf16 tile
// (kStages tiles); block-format caches keep kStages raw staging buffers and one bf16 tile.
template <KvFormat F, int MT>
struct Smem {
  static constexpr int kRows = 16 * MT;
  static constexpr int kQBytes = kRows * kRowElems * 2;
  static constexpr int kTileBytes = kBlockN * kRowElems * 2;
  static constexpr int kRawBytes = kBlockN * raw_token_bytes(F);
  static constexpr int kPBytes = kRows * kPElems * 2;
  static constexpr int kRedBytes = 2 * kWarps * kRows * 4;
  static constexpr int kFlagBytes = 3 * kBlockN;  // per stage (at most 3)
  // bf16 caches are copied by the TMA engine (bulk_copy_token), one mbarrier per stage.
  static constexpr bool kBulk = F == KvFormat::bf16;
  static constexpr int kBarBytes = kBulk ? 8 + 3 * 8 : 0;  // alignment + up to 3 stages
  // Block-format tiles of <= 16 rows load and dequantize straight from global memory into the tile
  // (no raw staging): ~98 KB and <= 128 registers let two CTAs share an SM, so one CTA's loads
  // overlap the other's math (one CTA an SM is latency bound).
  static constexpr bool kDirect = F != KvFormat::bf16 && MT == 1;
  static constexpr int kMinBlocks = kDirect ? 2 : 1;
  static constexpr int fixed() { return kQBytes + kPBytes + kRedBytes + kFlagBytes + kBarBytes; }
  static constexpr int bytes_for(int stages) {
    return F == KvFormat::bf16 ? fixed() + stages * kTileBytes
           : kDirect           ? fixed() + kTileBytes
                               : fixed() + kTileBytes + stages * kRawBytes;
  }
  // As many stages (up to 3) as fit in the 227 KB a CTA may use.
  static constexpr int kStages = kDirect                      ? 1
                                 : bytes_for(3) <= 227 * 1024 ? 3
                                 : bytes_for(2) <= 227 * 1024 ? 2
                                                              : 1;
  static constexpr int kBytes = bytes_for(kStages);
  static constexpr int kTiles = F == KvFormat::bf16 ? kStages : 1;
  // Offsets.
  static constexpr int kQ = 0;
  static constexpr int kTile = kQ + kQBytes;
  static constexpr int kRaw = kTile + kTiles * kTileBytes;
  static constexpr int kP = kRaw + (F == KvFormat::bf16 || kDirect ? 0 : kStages * kRawBytes);
  static constexpr int kRedMax = kP + kPBytes;
  static constexpr int kRedSum = kRedMax + kWarps * kRows * 4;
  static constexpr int kFlags = kRedSum + kWarps * kRows * 4;
  static constexpr int kBar = (kFlags + kFlagBytes + 7) / 8 * 8;
  static_assert(kBytes <= 227 * 1024, "tile does not fit in shared memory");
  static_assert(!kDirect || 2 * (kBytes + 1024) <= 228 * 1024, "two CTAs must fit an SM");
};

// This thread's token (tid / kPerToken) of block `blk`: its entry (ops::token_entry_of) and slot
// (ops::entry_slot_of).
template <int kBlock = kBlockN, int kPerToken = 4>
__device__ __forceinline__ std::int32_t token_entry(const DecodeParams& p, const WorkTile& t,
                                                    int q_token, std::int32_t kv_base, int blk) {
  return token_entry_of<kBlock>(p, t, q_token, kv_base, blk,
                                static_cast<int>(threadIdx.x) / kPerToken);
}

template <int kBlock = kBlockN, int kPerToken = 4>
__device__ __forceinline__ std::int64_t entry_slot(const DecodeParams& p, const WorkTile& t,
                                                   int blk, std::int32_t e) {
  return entry_slot_of<kBlock>(p, t, blk, e, static_cast<int>(threadIdx.x) / kPerToken);
}

// Issue the cp.async copies of the thread's token (slot from entry_slot) into stage `stage`;
// 4 threads per token (block-format caches).
// bf16: the bulk copies of the copier's token (bulk_token) instead, onto the stage's mbarrier.
template <KvFormat F, int MT>
__device__ __forceinline__ void load_block(const DecodeParams& p, std::int64_t slot,
                                           std::uint8_t* smem, int stage) {
  using S = Smem<F, MT>;
  if constexpr (S::kBulk) {
    const int tok = bulk_token();
    bulk_copy_token<1024, 128>(
        p, slot, smem + S::kTile + stage * S::kTileBytes + tok * kRowElems * 2,
        smem + S::kFlags + stage * kBlockN + tok, smem + S::kBar + 8 * stage);
  } else {
    const int tok = threadIdx.x / 4, sub = threadIdx.x % 4;
    const TokenAddr a = slot_addr(p, slot);
    const bool valid = a.ckv != nullptr;
    if (sub == 0) smem[S::kFlags + stage * kBlockN + tok] = valid ? 1 : 0;
    std::uint8_t* dst = smem + S::kRaw + stage * S::kRawBytes + tok * 656;
    for (int c = sub; c < 41; c += 4)  // p.ckv: a mapped address for the zero-fill copies
      cp_async_16(dst + 16 * c, valid ? a.ckv + 16 * c : p.ckv, valid);
  }
}

// kDirect: load block `blk` from global memory (all of a thread's loads in flight first) and
// write it dequantized into the bf16 tile, with the token flags. 4 threads per token.
template <KvFormat F, int MT>
__device__ __forceinline__ void load_dequantize_block(const DecodeParams& p, std::int64_t slot,
                                                      std::uint8_t* smem) {
  using S = Smem<F, MT>;
  constexpr int kChunks = 10;  // 40 chunks / 4 threads
  const int tok = threadIdx.x / 4, sub = threadIdx.x % 4;
  const TokenAddr a = slot_addr(p, slot);
  const bool valid = a.ckv != nullptr;
  if (sub == 0) smem[S::kFlags + tok] = valid ? 1 : 0;
  uint4 v[kChunks];
  float scale[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = sub + 4 * i;
    v[i] = make_uint4(0, 0, 0, 0);
    scale[i] = 1.0f;
    if (valid) {
      const std::uint8_t* src = c < 32 ? a.ckv + 16 * c : a.ckv + 528 + 16 * (c - 32);
      v[i] = __ldg(reinterpret_cast<const uint4*>(src));
      if (c < 32) scale[i] = __ldg(reinterpret_cast<const float*>(a.ckv + 512) + c / 8);
    }
  }
  std::uint8_t* row = smem + S::kTile + tok * kRowElems * 2;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = sub + 4 * i;
    if (c >= 32) {
      *reinterpret_cast<uint4*>(row + 2 * (512 + 8 * (c - 32))) = v[i];  // bf16 rope as is
    } else {
      dequantize16(v[i], scale[i], row + 2 * 16 * c);
    }
  }
}

// Dequantize the staged block into the bf16 tile.
template <KvFormat F, int MT>
__device__ __forceinline__ void dequantize_block(std::uint8_t* smem, int stage) {
  using S = Smem<F, MT>;
  const std::uint8_t* raw = smem + S::kRaw + stage * S::kRawBytes;
  std::uint8_t* tile = smem + S::kTile;
  constexpr int kItems = 40;  // 32 16-code chunks + 8 rope chunks
  for (int i = threadIdx.x; i < kBlockN * kItems; i += kThreads) {
    const int tok = i / kItems, c = i % kItems;
    std::uint8_t* dst_row = tile + tok * kRowElems * 2;
    if (c >= 32) {
      // rope: 8 bf16 values copied as they are
      *reinterpret_cast<uint4*>(dst_row + 2 * (512 + 8 * (c - 32))) =
          *reinterpret_cast<const uint4*>(raw + tok * 656 + 528 + 16 * (c - 32));
      continue;
    }
    const std::uint8_t* src = raw + tok * 656 + 16 * c;
    const float scale = *reinterpret_cast<const float*>(raw + tok * 656 + 512 + 4 * (c / 8));
    dequantize16(*reinterpret_cast<const uint4*>(src), scale, dst_row + 2 * 16 * c);
  }
}

// Q rows of the tile into shared memory (bf16), zero rows past the tile. Ends with a barrier.
template <KvFormat F, int MT>
__device__ __forceinline__ void load_q(const DecodeParams& p, const WorkTile& t, int q_first,
                                       std::uint8_t* smem) {
  using S = Smem<F, MT>;
  const int rows = t.q_count * t.head_count;
  std::uint8_t* q_s = smem + S::kQ;
  for (int i = threadIdx.x; i < S::kRows * 72; i += kThreads) {
    const int r = i / 72, c = i % 72;  // 8 bf16 values of row r, chunk c of 72
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows) {
      const std::int64_t tok = q_first + r / t.head_count, h = t.head_begin + r % t.head_count;
      const __nv_bfloat16* src =
          c < 64 ? p.q_nope + tok * p.q_nope_stride[0] + h * p.q_nope_stride[1] + 8 * c
                 : p.q_pe + tok * p.q_pe_stride[0] + h * p.q_pe_stride[1] + 8 * (c - 64);
      v = ops::q_as_bf16(*reinterpret_cast<const uint4*>(src), p.q_f16);
    }
    *reinterpret_cast<uint4*>(q_s + 2 * (r * kRowElems + 8 * c)) = v;
  }
  __syncthreads();
}

template <KvFormat F, int MT>
__global__ void __launch_bounds__(kThreads, Smem<F, MT>::kMinBlocks)
    shared_tile_kernel(const DecodeParams p) {
  using S = Smem<F, MT>;
  constexpr int kRows = S::kRows;
  constexpr int kStages = S::kStages;
  DeviceTile tile;
  if (!load_tile(p, tile)) return;
  begin_after_previous_kernel();
  extern __shared__ __align__(128) std::uint8_t smem[];
  const WorkTile t = tile.tile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = t.q_count * t.head_count;
  const int q_first = tile.q_first;  // global index of the tile's first token
  const int qo_len = tile.qo_len;
  const int kv_len = tile.kv_len;
  const int n_blocks = (t.kv_end - t.kv_begin + kBlockN - 1) / kBlockN;
  const std::int32_t kv_base = tile.kv_base;

  // Prologue: the first kStages blocks in flight, then Q into shared memory (bf16 rows).
  // next_entry: the entry of the next block to load, read one block ahead (see token_entry).
  std::int32_t next_entry = 0;
  const bool copier = bulk_copier();  // bf16: issues a token's bulk copy
  if constexpr (S::kBulk) {
    // The entries of the first kStages + 1 blocks are loaded before anything waits on one.
    std::int32_t e[kStages];
    if (copier) {
#pragma unroll
      for (int s = 0; s < kStages; ++s)
        e[s] = token_entry_of<kBlockN>(p, t, q_first, kv_base, s, bulk_token());
      next_entry = token_entry_of<kBlockN>(p, t, q_first, kv_base, kStages, bulk_token());
    }
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) mbar_init(smem + S::kBar + 8 * s, kBlockN);
      fence_mbar_init();
    }
    __syncthreads();
    if (copier) {
#pragma unroll
      for (int s = 0; s < kStages; ++s)
        if (s < n_blocks)
          load_block<F, MT>(p, entry_slot_of<kBlockN>(p, t, s, e[s], bulk_token()), smem, s);
    }
  } else if constexpr (!S::kDirect) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      if (s < n_blocks)
        load_block<F, MT>(p, entry_slot(p, t, s, token_entry(p, t, q_first, kv_base, s)), smem, s);
      cp_async_commit();
    }
    next_entry = token_entry(p, t, q_first, kv_base, kStages);
  } else {
    next_entry = token_entry(p, t, q_first, kv_base, 0);
  }
  load_q<F, MT>(p, t, q_first, smem);
  const std::uint16_t* q_s = reinterpret_cast<const std::uint16_t*>(smem + S::kQ);
  // One m-tile: each warp keeps all of Q's A fragments (36 k-steps x 4 registers) so the S
  // phase stops re-reading Q from shared memory (it was a third of the smem traffic).
  constexpr bool kQInRegs = MT == 1 && !S::kDirect;  // kDirect needs <= 128 registers
  constexpr int kChains = MT == 1 ? 2 : 1;
  std::uint32_t q_frag[kQInRegs ? 36 : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int k = 0; k < 36; ++k)
      ldmatrix_x4(q_frag[k], q_s + (lane % 16) * kRowElems + (lane / 16) * 8 + 16 * k);
  }

  // Per-thread softmax state for its rows: m-tile m, half h -> row 16m + lane/4 + 8h.
  float row_max[MT][2], row_sum[MT][2];
  float o[MT][8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.0f;
  }
  // Last visible token (inclusive) of each of the thread's rows.
  int limit[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      limit[m][h] = row_limit(p, t, 16 * m + lane / 4 + 8 * h, kv_len, qo_len);

  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + S::kP);
  float* red_max = reinterpret_cast<float*>(smem + S::kRedMax);
  float* red_sum = reinterpret_cast<float*>(smem + S::kRedSum);

  for (int blk = 0; blk < n_blocks; ++blk) {
    const int stage = blk % kStages;
    if constexpr (S::kDirect) {
      // The tile is free (see below).
      load_dequantize_block<F, MT>(p, entry_slot(p, t, blk, next_entry), smem);
      next_entry = token_entry(p, t, q_first, kv_base, blk + 1);
    } else if constexpr (S::kBulk) {
      mbar_wait(smem + S::kBar + 8 * stage, (blk / kStages) % 2);  // block blk landed
    } else {
      cp_async_wait<kStages - 1>();
    }
    __syncthreads();
    // Read this block's token flags before a refill of the stage overwrites them.
    const int tok0 = 8 * warp + 2 * (lane % 4);
    const std::uint8_t* flags = smem + S::kFlags + stage * kBlockN;
    const bool tok_ok[2] = {flags[tok0] != 0, flags[tok0 + 1] != 0};
    if constexpr (F != KvFormat::bf16 && !S::kDirect) {
      dequantize_block<F, MT>(smem, stage);
      __syncthreads();
      // The raw stage is free again: refill it with the block kStages ahead.
      if (blk + kStages < n_blocks) {
        load_block<F, MT>(p, entry_slot(p, t, blk + kStages, next_entry), smem, stage);
        next_entry = token_entry(p, t, q_first, kv_base, blk + kStages + 1);
      }
      cp_async_commit();
    }
    const std::uint16_t* k_s = reinterpret_cast<const std::uint16_t*>(
        smem + S::kTile + (S::kTiles > 1 ? stage : 0) * S::kTileBytes);

    // ---- S = Q K^T for tokens [8 warp, 8 warp + 8) ----
    // With one m-tile the two mma of a k-pair go to separate accumulators (summed below), so
    // the chain of dependent mma is half as long; more m-tiles give independent chains anyway.
    float s_nope[kChains][MT][4], s_pe[kChains][MT][4];
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) s_nope[c][m][i] = s_pe[c][m][i] = 0.0f;
    const std::uint16_t* k_row = k_s + (8 * warp + lane % 8) * kRowElems + (lane / 8) * 8;
    // Two k-steps (32 dims) per ldmatrix.x4 of K; the nope and rope parts keep separate
    // accumulators so a per-tensor fp8 cache can scale them differently.
    auto qk_steps = [&](float(&acc)[kChains][MT][4], int k) {
      std::uint32_t b[4];
      ldmatrix_x4(b, k_row + 16 * k);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if constexpr (kQInRegs) {
          mma_16816<true>(acc[0][m], q_frag[k], b[0], b[1]);
          mma_16816<true>(acc[kChains - 1][m], q_frag[k + 1], b[2], b[3]);
        } else {
          std::uint32_t a0[4], a1[4];
          const std::uint16_t* q_row = q_s + (16 * m + lane % 16) * kRowElems + (lane / 16) * 8;
          ldmatrix_x4(a0, q_row + 16 * k);
          ldmatrix_x4(a1, q_row + 16 * (k + 1));
          mma_16816<true>(acc[0][m], a0, b[0], b[1]);
          mma_16816<true>(acc[kChains - 1][m], a1, b[2], b[3]);
        }
      }
    };
    if constexpr (kQInRegs) {
#pragma unroll  // register fragments need compile-time indices
      for (int k = 0; k < 32; k += 2) qk_steps(s_nope, k);
    } else {
#pragma unroll 4  // full unrolling with 2-4 m-tiles is slower (code size)
      for (int k = 0; k < 32; k += 2) qk_steps(s_nope, k);
    }
#pragma unroll
    for (int k = 32; k < 36; k += 2) qk_steps(s_pe, k);
    if constexpr (kChains > 1) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s_nope[0][m][i] += s_nope[1][m][i];
          s_pe[0][m][i] += s_pe[1][m][i];
        }
    }

    // ---- scores, masks, block row max ----
    const int j0 = t.kv_begin + blk * kBlockN + tok0;
    float s[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int h = i / 2, j = j0 + (i % 2);
        const bool ok = tok_ok[i % 2] && j <= limit[m][h];
        s[m][i] = ok ? s_nope[0][m][i] * p.scale_nope + s_pe[0][m][i] * p.scale_pe : -INFINITY;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = fmaxf(s[m][2 * h], s[m][2 * h + 1]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (lane % 4 == 0) red_max[warp * kRows + 16 * m + lane / 4 + 8 * h] = mx;
      }
    }
    __syncthreads();

    // ---- online softmax: P = exp2(s - m_new), rescale factors ----
    float alpha[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * m + lane / 4 + 8 * h;
        float mx = row_max[m][h];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, red_max[w * kRows + r]);
        const float base = mx == -INFINITY ? 0.0f : mx;  // rows with nothing visible yet
        alpha[m][h] = exp2f(row_max[m][h] - base);
        row_max[m][h] = mx;
        const float p0 = exp2f(s[m][2 * h] - base), p1 = exp2f(s[m][2 * h + 1] - base);
        const std::uint32_t pb = float2_to_bf16x2(p0, p1);
        *reinterpret_cast<std::uint32_t*>(p_s + r * kPElems + tok0) = pb;
        // Row sums of the fp32 p, before the bf16 rounding (ops::add_sums says why).
        float sum = p0 + p1;
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (lane % 4 == 0) red_sum[warp * kRows + r] = sum;
      }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * m + lane / 4 + 8 * h;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += red_sum[w * kRows + r];
        row_sum[m][h] = row_sum[m][h] * alpha[m][h] + sum;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          o[m][n][2 * h] *= alpha[m][h];
          o[m][n][2 * h + 1] *= alpha[m][h];
        }
      }

      // ---- O += P V for columns [64 warp, 64 warp + 64) ----
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
        ldmatrix_x4(a[m], p_s + (16 * m + lane % 16) * kPElems + 16 * kk + (lane / 16) * 8);
      const int v_tok = 16 * kk + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        std::uint32_t b[4];
        ldmatrix_x4_trans(b, k_s + v_tok * kRowElems + 64 * warp + 16 * np + (lane / 16) * 8);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma_16816<true>(o[m][2 * np], a[m], b[0], b[1]);
          mma_16816<true>(o[m][2 * np + 1], a[m], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the tile, P and the reductions are rewritten next block
    if constexpr (S::kBulk) {
      if (copier && blk + kStages < n_blocks) {
        load_block<F, MT>(p, entry_slot_of<kBlockN>(p, t, blk + kStages, next_entry, bulk_token()),
                          smem, stage);
        next_entry =
            token_entry_of<kBlockN>(p, t, q_first, kv_base, blk + kStages + 1, bulk_token());
      }
    }
  }
  if constexpr (!S::kBulk) cp_async_wait<0>();

    // ---- epilogue ----
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * m + lane / 4 + 8 * h;
      if (r >= rows) continue;
      // m-tile m's fragments are those of the <= 16-row bf16 families (ldmatrix.trans of V).
      write_row_trans(p, t, tile, warp, lane % 4, h, r, o[m],
                      finish_row(row_max[m][h], row_sum[m][h], p.out_scale));
    }
}

}  // namespace fp8mla::detail::shared_tile
