// wide_rows' producer (warpgroup 2): the tile layout, and each block's tokens loaded and stored
// into a 16-bit tile as fp16 converted from fp8 codes (Share), as bf16 from the block format's
// codes times their block scales (BlockShare), or copied as bf16 by cp.async; contiguous blocks
// of fused pools take one page-table entry a block. kernel.cuh runs it beside the consumers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/convert.cuh"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/q.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::wide_rows {

// The shared tile operations (src/cuda/ops).
using namespace ops;

inline constexpr int kN = 64;  // cache tokens per block
inline constexpr int kPanel = kN * 128;
inline constexpr int kTileBytes = 9 * kPanel;

template <bool kBf16Cache>
struct Layout {
  // load_q_panels: bf16 Q as given, else fp16 x 2^e
  static constexpr bool kBf16 = kBf16Cache;
  static constexpr int kQ = 0;
  static constexpr int kTile = kQ + 9 * rows64::kQPanel;          // [2] 16-bit tiles
  static constexpr int kFlags = kTile + 2 * kTileBytes;           // [tile][token] present
  static constexpr int kFactor = kFlags + 2 * kN;                 // [tile][row] O's rescale factor
  static constexpr int kStats = kFactor + 2 * rows64::kRows * 4;  // [row] max, sum at the end
  static constexpr int kQInv = kStats + 2 * rows64::kRows * 4;
  static constexpr int kBars = kQInv + rows64::kRows * 4;  // full[2], ready[2], free[2]
  static constexpr int kSmemBytes = kBars + 6 * 8 + 1024;  // + slack to align to 1 KB
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// The producer's (warpgroup 2's) share of a block (72 bytes a thread). Per token, for any page
// size, layout or sparse list: thread i (0-127) holds tokens 16 (i / 32) + 8 j + i % 8 (j = 0,
// 1), 16-byte chunks 4 k + i % 32 / 8 (k = 0..8, fp16 panel k); eight consecutive threads read
// the same 64 bytes of 8 tokens and store 8 rows of a panel (conflict-free). Contiguous blocks
// use the same registers as 36 8-byte units (load_block_units).
struct Share {
  uint4 v[2][9];
  bool ok[2];
};

__device__ __forceinline__ int share_token(int j) {
  return 16 * (threadIdx.x % 128 / 32) + 8 * j + threadIdx.x % 8;
}

// Tokens stored as fused rows of kToken bytes (kpe right after ckv: 576 fp8, 1152 bf16).
template <int kToken>
__device__ __forceinline__ bool fused_rows(const DecodeParams& p) {
  return p.kpe == p.ckv + kToken / 9 * 8 && p.ckv_token_stride == kToken &&
         p.kpe_token_stride == kToken && p.kpe_page_stride == p.ckv_page_stride;
}

// Pools of fused rows whose pages lie back to back (fp8mla's and SGLang's pools): a token's row is
// slot x kToken bytes in, one multiply instead of ops::slot_addr's two 64-bit products a
// pointer.
template <int kToken>
__device__ __forceinline__ bool fused_pool(const DecodeParams& p) {
  return fused_rows<kToken>(p) && p.ckv_page_stride == (std::int64_t{kToken} << p.page_shift);
}

// Token `tok`'s ckv and kpe (nullptr when absent) from its entry e.
template <int kToken>
__device__ __forceinline__ ops::TokenAddr token_addr(const DecodeParams& p, const WorkTile& t,
                                                     int blk, std::int32_t e, int tok, bool fused) {
  const std::int64_t slot = ops::entry_slot_of<kN>(p, t, blk, e, tok);
  if (!fused) return ops::slot_addr(p, slot);
  if (slot < 0) return {nullptr, nullptr};
  const std::uint8_t* ckv = p.ckv + slot * kToken;
  return {ckv, ckv + kToken / 9 * 8};  // ckv: 8 of the 9 64-dim parts
}

// Tokens of block `blk` inside the tile (kN but for the last block).
__device__ __forceinline__ int block_tokens(const WorkTile& t, int blk) {
  return min(kN, t.kv_end - t.kv_begin - blk * kN);
}

// Loads block `blk` (entries e: the page-table or index entries of the two tokens, loaded a
// block earlier); absent tokens hold zeros.
__device__ __forceinline__ void load_share(const DecodeParams& p, const WorkTile& t, int blk,
                                           const std::int32_t (&e)[2], bool fused, Share& sh) {
  const int cc = threadIdx.x % 32 / 8;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const ops::TokenAddr a = token_addr<576>(p, t, blk, e[j], share_token(j), fused);
    sh.ok[j] = a.ckv != nullptr;
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      const std::uint8_t* src = k < 8 ? a.ckv + 16 * (4 * k + cc) : a.kpe + 16 * cc;
      sh.v[j][k] = sh.ok[j] ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
    }
  }
}

// The loaded share converted into tile `tile` (fp16, swizzled panels) and its flags.
__device__ __forceinline__ void store_share(const Share& sh, std::uint8_t* smem, int tile) {
  using L = Layout<false>;
  const int cc = threadIdx.x % 32 / 8;
  std::uint8_t* dst = smem + L::kTile + tile * kTileBytes;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int row = share_token(j);
    if (cc == 0) smem[L::kFlags + tile * kN + row] = sh.ok[j] ? 1 : 0;
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      const uint4 c = sh.v[j][k];
      uint4 a, b;
      fp8x4_to_half2x2(c.x, a.x, a.y);
      fp8x4_to_half2x2(c.y, a.z, a.w);
      fp8x4_to_half2x2(c.z, b.x, b.y);
      fp8x4_to_half2x2(c.w, b.z, b.w);
      *reinterpret_cast<uint4*>(dst + k * kPanel + sw128(row, 32 * cc)) = a;
      *reinterpret_cast<uint4*>(dst + k * kPanel + sw128(row, 32 * cc + 16)) = b;
    }
  }
}

// The block format (fp8_e4m3_block, 656-byte tokens: 512 codes, four float32 scales of 128 dims
// each, 64 bf16 rope dims): the producer's share is the same two tokens a thread as Share's, with
// the same 16-code chunks 4 k + i % 32 / 8 (k = 0..7) and scale i % 32 / 8 of the token (the four
// lanes of a token, 8 apart, exchange theirs when they convert); the rope is copied by cp.async
// when the tile is stored, from lines the load asked L2 for: 70 registers a thread (fp8's share
// holds 72; with the rope and four scales a token, 88 spill at the producer's 120, Regs). The
// tile is bf16: a code times its power-of-two block scale is exact there (fp16 lacks the range),
// and the bf16 rope is stored as it came.
struct BlockShare {
  uint4 code[2][8];
  const std::uint8_t* token[2];  // null: absent
  float scale[2];
};

// Pools whose pages of 656-byte tokens lie back to back: a token is slot x 656 bytes in.
__device__ __forceinline__ bool block_pool(const DecodeParams& p) {
  return p.ckv_token_stride == 656 && p.ckv_page_stride == (std::int64_t{656} << p.page_shift);
}

__device__ __forceinline__ void load_block_share(const DecodeParams& p, const WorkTile& t, int blk,
                                                 const std::int32_t (&e)[2], bool pool,
                                                 BlockShare& sh) {
  const int cc = threadIdx.x % 32 / 8;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const std::int64_t slot = ops::entry_slot_of<kN>(p, t, blk, e[j], share_token(j));
    const std::uint8_t* a = slot < 0 ? nullptr
                            : pool   ? p.ckv + slot * 656
                                     : ops::slot_addr(p, slot).ckv;
    sh.token[j] = a;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      sh.code[j][k] = a != nullptr ? __ldg(reinterpret_cast<const uint4*>(a + 16 * (4 * k + cc)))
                                   : make_uint4(0, 0, 0, 0);
    sh.scale[j] = a != nullptr ? __ldg(reinterpret_cast<const float*>(a + 512) + cc) : 0.0f;
    if (a != nullptr) prefetch_l2(a + 528 + 32 * cc);  // the rope's 128 bytes, 4 sectors
  }
}

// The loaded block-format share into tile `tile` (bf16, swizzled panels) with its flags: the
// rope's cp.async copies first (one commit group), then the codes dequantized; the caller waits
// for the group before it hands the tile over.
__device__ __forceinline__ void store_block_share(const DecodeParams& p, const BlockShare& sh,
                                                  std::uint8_t* smem, int tile) {
  using L = Layout<true>;
  const int cc = threadIdx.x % 32 / 8;
  std::uint8_t* dst = smem + L::kTile + tile * kTileBytes;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const bool ok = sh.token[j] != nullptr;
    const std::uint8_t* rope = (ok ? sh.token[j] : p.ckv) + 528;  // p.ckv: mapped, not read
#pragma unroll
    for (int m = 0; m < 2; ++m)
      cp_async_16(dst + 8 * kPanel + sw128(share_token(j), 16 * (cc + 4 * m)),
                  rope + 16 * (cc + 4 * m), ok);
  }
  cp_async_commit();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int row = share_token(j);
    if (cc == 0) smem[L::kFlags + tile * kN + row] = sh.token[j] != nullptr ? 1 : 0;
    float scale[4];
#pragma unroll
    for (int b = 0; b < 4; ++b)
      scale[b] = __shfl_sync(0xffffffffu, sh.scale[j], threadIdx.x % 8 + 8 * b);
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // dims 64 k + 16 cc + [0, 16): panel k, block k / 2
      uint4 a, b;
      dequantize16(sh.code[j][k], scale[k / 2], a, b);
      *reinterpret_cast<uint4*>(dst + k * kPanel + sw128(row, 32 * cc)) = a;
      *reinterpret_cast<uint4*>(dst + k * kPanel + sw128(row, 32 * cc + 16)) = b;
    }
  }
}

// Blocks whose 64 tokens lie in a row of one page with fused tokens (kCkv + 64 x the element
// size: 576 bytes fp8, 1152 bf16) (dense page tables, pages of >= 64 tokens, fp8mla's and
// SGLang's pools): one page-table entry a block, and every byte's address a constant offset from
// the block's first token. fp8: warpgroup 1 reads the block's 36,864 bytes as 8-byte units i =
// 128 k + u (thread u, k = 0..35), so a warp's load is 256 bytes in a row (2 L1 wavefronts, where
// the per-token loads above take many more). Unit i is token i / 72,
// 8-byte unit w = i % 72 of it: panel w / 8, 16-byte unit w % 8 of the row, so 8 consecutive
// threads store one row's 8 units of a panel (conflict-free). Unit i + 1152 is 16 tokens
// further: the same place 2048 bytes on, so 9 addresses serve all 36.
template <bool kBf16>
__device__ __forceinline__ bool contiguous_blocks(const DecodeParams& p, const WorkTile& t) {
  constexpr int kToken = kBf16 ? 1152 : 576;
  return p.topk == 0 && p.page_shift >= 6 && (t.kv_begin & (kN - 1)) == 0 && fused_rows<kToken>(p);
}

// The address of block `blk`'s first token in a contiguous tile (e: its page).
__device__ __forceinline__ const std::uint8_t* block_base(const DecodeParams& p, const WorkTile& t,
                                                          int blk, std::int32_t e,
                                                          int token_bytes) {
  const int j0 = t.kv_begin + blk * kN;
  return p.ckv + static_cast<std::int64_t>(e) * p.ckv_page_stride +
         static_cast<std::int64_t>(j0 & ((1 << p.page_shift) - 1)) * token_bytes;
}

// Loads block `blk` of a contiguous tile (e: its page, loaded a block earlier) into sh.v (unit
// k in half k % 2 of sh.v[k / 2]); units of tokens past the tile are zeros.
__device__ __forceinline__ void load_block_units(const DecodeParams& p, const WorkTile& t, int blk,
                                                 std::int32_t e, Share& sh) {
  const std::uint8_t* base = block_base(p, t, blk, e, 576);
  const int u = threadIdx.x % 128, lim = 72 * block_tokens(t, blk);
  std::uint32_t* v = &sh.v[0][0].x;
#pragma unroll
  for (int k = 0; k < 36; ++k) {
    const int i = 128 * k + u;
    const uint2 x =
        i < lim ? __ldg(reinterpret_cast<const uint2*>(base + 8 * i)) : make_uint2(0, 0);
    v[2 * k] = x.x, v[2 * k + 1] = x.y;
  }
}

// The units converted into tile `tile` with the flags of the tile's tokens (kv_end bounds them).
__device__ __forceinline__ void store_block_units(const Share& sh, std::uint8_t* smem, int tile,
                                                  int valid) {
  using L = Layout<false>;
  const int u = threadIdx.x % 128;
  if (u < kN) smem[L::kFlags + tile * kN + u] = u < valid ? 1 : 0;
  std::uint8_t* dst = smem + L::kTile + tile * kTileBytes;
  const std::uint32_t* v = &sh.v[0][0].x;
#pragma unroll
  for (int k0 = 0; k0 < 9; ++k0) {
    const int i = 128 * k0 + u, r = i / 72, w = i - 72 * r;
    std::uint8_t* at = dst + (w >> 3) * kPanel + r * 128 + (((w ^ r) & 7) << 4);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int k = k0 + 9 * m;
      uint4 h;
      fp8x4_to_half2x2(v[2 * k], h.x, h.y);
      fp8x4_to_half2x2(v[2 * k + 1], h.z, h.w);
      *reinterpret_cast<uint4*>(at + 2048 * m) = h;
    }
  }
}

// bf16 caches: block `blk` copied by cp.async straight into tile `tile` with its flags: thread u
// copies 16-byte unit u % 8 of the nine panel rows of tokens u / 8 + 16 j (j = 0..3), so a warp
// instruction reads 4 tokens x 128 bytes; in a contiguous tile (e[0]: the block's page) every
// source is a constant offset from one address, otherwise (e[j]: token j's entry) from one per
// token. The 36 copies' shared addresses are constant offsets from one (token + 16 j: 2048 bytes
// on, the same swizzle): computing each copy's addresses in full would take hundreds of
// instructions a warp and block. A skipped token or one past the
// tile is zero-filled (the source p.ckv + offset < 1152: mapped, not read) and flagged 0. One
// commit group.
__device__ __forceinline__ int copy_token(int j) {
  return threadIdx.x % 128 / 8 + 16 * j;
}
__device__ __forceinline__ void copy_bf16_block(const DecodeParams& p, const WorkTile& t, int blk,
                                                const std::int32_t (&e)[4], bool contig, bool fused,
                                                std::uint8_t* smem, int tile) {
  using L = Layout<true>;
  const int sub = threadIdx.x % 8;
  const std::uint32_t dst =
      smem_addr(smem + L::kTile + tile * kTileBytes) + sw128(copy_token(0), 16 * sub);
  const int valid_tokens = block_tokens(t, blk);
  const std::uint8_t* base =
      contig ? block_base(p, t, blk, e[0], 1152) + 1152 * copy_token(0) : nullptr;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = copy_token(j);
    const std::uint8_t *ckv, *kpe;
    bool valid;
    if (contig) {
      valid = tok < valid_tokens;
      ckv = base + 1152 * 16 * j;
      kpe = ckv + 1024;
    } else {
      const ops::TokenAddr a = token_addr<1152>(p, t, blk, e[j], tok, fused);
      valid = a.ckv != nullptr;
      ckv = a.ckv, kpe = a.kpe;
    }
    if (!valid) ckv = kpe = p.ckv;
    if (sub == 0) smem[L::kFlags + tile * kN + tok] = valid ? 1 : 0;
    const int bytes = valid ? 16 : 0;
#pragma unroll
    for (int i = 0; i < 9; ++i)
      cp_async_16(dst + 2048 * j + i * kPanel, (i < 8 ? ckv + 128 * i : kpe) + 16 * sub, bytes);
  }
  cp_async_commit();
}

}  // namespace fp8mla::detail::wide_rows
