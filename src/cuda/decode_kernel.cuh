// The shared-memory-tile MLA decode kernel: one CTA per WorkTile (request, query block, head
// block, kv range). It runs the 656-byte block-format caches and bf16 tiles of <= 16 rows on
// sparse lists; bf16 tiles of <= 16 rows on page tables run decode_bf16_tma_kernel.cuh (pages of
// < 8 tokens its gather instantiation), fp8_e4m3 tiles of <= 16 rows their own kernels
// (decode_fp8_tma_kernel.cuh on pages of >= 8 tokens, decode_fp8_gather_kernel.cuh on smaller
// pages, decode_fp8_kernel.cuh on sparse lists and for PlanOptions::exact_scores), and
// fp8_e4m3 and bf16 tiles of 17-64 rows the warp-specialized one (decode_wgmma_ws_kernel.cuh).
//
// Per block of 64 cache tokens:
//   1. cp.async the tokens' raw bytes (any format, paged or gathered per token, 16-byte vectors)
//      into a shared staging buffer, kStages blocks ahead;
//   2. block format: dequantize the staged codes into a bf16 tile in shared memory (exact: its
//      power-of-two block scales applied in the conversion);
//   3. S = Q K^T on tensor cores (mma.sync m16n8k16, fp32 accumulators): warp w owns tokens
//      [8w, 8w + 8) of the block, all rows;
//   4. online softmax in fp32 (log2 domain), row max and sum exchanged through shared memory;
//   5. O += P V: warp w owns output columns [64w, 64w + 64), all rows.
// The epilogue writes bf16 out + lse, or an fp32 partial (o, lse) row when the request is split.
// Block-format tiles of <= 16 rows (Smem::kDirect) fuse steps 1 and 2: global loads straight
// into registers, dequantized into the tile, so two CTAs fit an SM (bench/NOTES.md, v3).
// Sparse (DSA) tiles are the same kernel: token j of a tile is read through the index list.
#pragma once

#include <cfloat>
#include <cstdint>

#include "src/cuda/cuda_util.cuh"
#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

namespace decode {

inline constexpr int kThreads = 256;
// Register cap of the kernels that run two CTAs per SM (the fp8_e4m3 <= 16-row kernels):
// 2 x 256 x 112 leaves 8192 of an SM's 65536 registers, room for one split-merge CTA (256
// threads x 32), so the merge, launched as a programmatic dependent, becomes resident and waits
// while the decode grid runs. At 124-128 registers it could start only as decode CTAs exited:
// +2.5 us at 1/8/32768 (bench/NOTES.md v21). Shared memory leaves room for it too.
inline constexpr int kMaxRegsTwoCtas = 112;
inline constexpr int kMergeCtaSmem = 6 * 1024;  // split_merge_kernel: 5 KB + the 1 KB reserved
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kBlockN = 64;         // cache tokens per block
inline constexpr int kRowElems = 576 + 8;  // bf16 row pitch in smem: 1168 B, ldmatrix conflict-free
inline constexpr int kPElems = kBlockN + 8;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

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
  // overlap the other's math. v2 ran 1 CTA (8 warps) per SM and ncu showed it latency bound.
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

// Byte address of cache token j of the tile's sequence, or null when the slot is skipped.
struct TokenAddr {
  const std::uint8_t* ckv;
  const std::uint8_t* kpe;
};

// The page-table entry (dense: page id) or index-list entry (sparse: pool slot) of this thread's
// token (tid / 4) of block `blk`, loaded but not yet used: the kernels load it one block before
// the token's copies are issued and turn it into a slot (entry_slot) only then, so the load
// overlaps a block of math. v6 stalled every warp on this load right after a barrier (1.4
// long-scoreboard cycles per instruction), and v7's first try, which also computed the slot at
// once, stalled on the use instead (bench/NOTES.md). kv_base = kv_indptr[request].
// kBlock: the kernel's tokens per block; tok: the token within the block (the overload below:
// this thread's, tid / kPerToken).
template <int kBlock>
__device__ __forceinline__ std::int32_t token_entry_of(const DecodeParams& p, const WorkTile& t,
                                                       int q_token, std::int32_t kv_base, int blk,
                                                       int tok) {
  const int j = t.kv_begin + blk * kBlock + tok;
  std::int32_t e = 0;  // a predicated load: nothing waits on it here
  if (j < t.kv_end)
    e = p.topk > 0 ? p.sparse_indices[static_cast<std::int64_t>(q_token) * p.topk + j]
                   : p.kv_indices[kv_base + (j >> p.page_shift)];
  return e;
}
template <int kBlock = kBlockN, int kPerToken = 4>
__device__ __forceinline__ std::int32_t token_entry(const DecodeParams& p, const WorkTile& t,
                                                    int q_token, std::int32_t kv_base, int blk) {
  return token_entry_of<kBlock>(p, t, q_token, kv_base, blk,
                                static_cast<int>(threadIdx.x) / kPerToken);
}

// Pool slot (page * page_size + offset) of token `tok` of block `blk`, or -1 when it is past the
// tile or skipped; the overload below: this thread's token.
template <int kBlock>
__device__ __forceinline__ std::int64_t entry_slot_of(const DecodeParams& p, const WorkTile& t,
                                                      int blk, std::int32_t e, int tok) {
  const int j = t.kv_begin + blk * kBlock + tok;
  if (j >= t.kv_end) return -1;
  if (p.topk > 0) return e < 0 || e >= p.pool_slots ? -1 : e;
  return (static_cast<std::int64_t>(e) << p.page_shift) | (j & ((1 << p.page_shift) - 1));
}
template <int kBlock = kBlockN, int kPerToken = 4>
__device__ __forceinline__ std::int64_t entry_slot(const DecodeParams& p, const WorkTile& t,
                                                   int blk, std::int32_t e) {
  return entry_slot_of<kBlock>(p, t, blk, e, static_cast<int>(threadIdx.x) / kPerToken);
}

__device__ __forceinline__ TokenAddr slot_addr(const DecodeParams& p, std::int64_t slot) {
  if (slot < 0) return {nullptr, nullptr};
  const std::int64_t page = slot >> p.page_shift, offset = slot & ((1 << p.page_shift) - 1);
  return {
      p.ckv + page * p.ckv_page_stride + offset * p.ckv_token_stride,
      p.kpe == nullptr ? nullptr : p.kpe + page * p.kpe_page_stride + offset * p.kpe_token_stride};
}

// Bulk (TMA) copies: lanes 0..7 of every warp issue them, one token each (bulk_token()). A bulk
// copy is a uniform-datapath instruction that ptxas issues once per active lane in turn (a loop
// of ~7 instructions a copy), so 8 issuers a warp keep that loop short and spread over the CTA.
// Broadcasting each address to the whole warp (uniform operands, one elected issuer, no loop)
// measured slower: its shuffles queue on the MIO path the fragment reads need (bench/NOTES.md
// v12).
static_assert(kBlockN == 8 * kWarps, "one bulk-copied token per lane 0..7 of each warp");
__device__ __forceinline__ bool bulk_copier() {
  return threadIdx.x % 32 < 8;
}
__device__ __forceinline__ int bulk_token() {
  return 8 * (threadIdx.x / 32) + threadIdx.x % 32;
}

// The bulk copy of one token (slot from entry_slot_of) into `row`: its ckv (kCkv bytes) and kpe
// (kKpe bytes) in one copy when the kpe bytes follow the ckv bytes (the PagedLatentCache
// layout), else in two; they complete on the stage mbarrier `bar` (one arrival per token and
// phase). A skipped token is zero-filled and flagged 0.
template <int kCkv, int kKpe>
__device__ __forceinline__ void bulk_copy_token(const DecodeParams& p, std::int64_t slot,
                                                std::uint8_t* row, std::uint8_t* flag, void* bar) {
  const TokenAddr a = slot_addr(p, slot);
  *flag = a.ckv != nullptr ? 1 : 0;
  if (a.ckv != nullptr) {
    mbar_arrive_expect_tx(bar, kCkv + kKpe);
    if (a.kpe == a.ckv + kCkv) {
      bulk_copy_to_shared(row, a.ckv, kCkv + kKpe, bar);
    } else {
      bulk_copy_to_shared(row, a.ckv, kCkv, bar);
      bulk_copy_to_shared(row + kCkv, a.kpe, kKpe, bar);
    }
  } else {
#pragma unroll
    for (int c = 0; c < (kCkv + kKpe) / 16; ++c)
      reinterpret_cast<uint4*>(row)[c] = make_uint4(0, 0, 0, 0);
    // The row's later bulk copies (async proxy) must land after these generic stores.
    fence_proxy_async_shared();
    mbar_arrive(bar);
  }
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

// 16 e4m3 codes times a (power-of-two) scale -> 16 bf16 values at dst (exact).
__device__ __forceinline__ void dequantize16(uint4 codes, float scale, std::uint8_t* dst) {
  const std::uint32_t w[4] = {codes.x, codes.y, codes.z, codes.w};
  std::uint32_t out[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 lo = fp8x2_to_float2(static_cast<std::uint16_t>(w[k] & 0xffff));
    const float2 hi = fp8x2_to_float2(static_cast<std::uint16_t>(w[k] >> 16));
    out[2 * k] = float2_to_bf16x2(lo.x * scale, lo.y * scale);
    out[2 * k + 1] = float2_to_bf16x2(hi.x * scale, hi.y * scale);
  }
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(out[0], out[1], out[2], out[3]);
  d[1] = make_uint4(out[4], out[5], out[6], out[7]);
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

// ---- pieces shared with the fp8 and wgmma kernels ----

// |x| of 8 bf16 values as the bits of a non-negative float (orders like the value; NaN above inf).
__device__ __forceinline__ std::uint32_t abs_max_bits(uint4 v) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
  std::uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) m = max(m, max(w[k] & 0x7fffu, (w[k] >> 16) & 0x7fffu));
  return m << 16;
}

// fp16 tiles scale q row r by 2^e with max|q_r| * 2^e in [2^14, 2^15): exact for every bf16 value
// above 2^-29 of the row maximum (smaller ones round at 2^-25 of it); 2^-e is undone on the
// scores. Rows of zeros, inf or NaN keep e = 0.
__device__ __forceinline__ int q_row_exponent(float amax) {
  int e = 0;
  if (amax > 0.0f && amax <= FLT_MAX) {
    frexpf(amax, &e);  // amax in [2^(e-1), 2^e)
    e = min(max(15 - e, -120), 120);
  }
  return e;
}

// Two bf16 values times `scale` as an f16x2 word.
__device__ __forceinline__ std::uint32_t scale_to_half2(std::uint32_t bf16x2, float scale) {
  const float2 f = bf16x2_to_float2(bf16x2);
  return float2_to_half2(f.x * scale, f.y * scale);
}

// The last cache token (inclusive) tile row r may see: -1 past the tile's rows, the causal bound
// of its query token, or no bound.
__device__ __forceinline__ int row_limit(const DecodeParams& p, const WorkTile& t, int r,
                                         int kv_len, int qo_len) {
  if (r >= t.q_count * t.head_count) return -1;
  return p.topk == 0 && p.causal ? kv_len - qo_len + t.q_begin + r / t.head_count : INT32_MAX;
}

// Partial-output row of a split tile's query token q_begin + tr, head `head`: the request's
// partial rows are [split][query token][head]. The base is re-read here (a cache hit) rather
// than kept in two registers through the block loop.
__device__ __forceinline__ std::int64_t partial_row(const DecodeParams& p, const WorkTile& t,
                                                    int qo_len, int tr, std::int64_t head) {
  return p.tiles[blockIdx.x].partial_base +
         (static_cast<std::int64_t>(t.split) * qo_len + t.q_begin + tr) * p.num_heads + head;
}

// This thread's place in an mma fragment (row group g, thread tq in the group) and in its
// warpgroup (wg; warp wr of its four). wg comes from lane 0's shuffle: ptxas then knows it is
// warp-uniform and keeps the wgmma descriptors built from it in uniform registers.
struct ThreadRoles {
  int warp, lane, g, tq, wg, wr;
};
__device__ __forceinline__ ThreadRoles thread_roles() {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  return {warp, lane, lane / 4, lane % 4, __shfl_sync(0xffffffffu, warp / 4, 0), warp % 4};
}

// This CTA's tile, or false when blockIdx.x is past the live tiles (graph-mode plans launch
// their capacity). The tile is loaded before the count is checked, so the two loads overlap:
// the array holds the grid's capacity, so the read is in bounds either way.
__device__ __forceinline__ bool load_tile(const DecodeParams& p, DeviceTile& d) {
  d = p.tiles[blockIdx.x];
  return static_cast<int>(blockIdx.x) < *p.num_tiles;
}

// The decode grid is a programmatic dependent of the kernel before it in the stream (cuda_run),
// so its launch and set-up overlap that kernel's end. Before this call a kernel reads only the
// plan's buffers (tiles, page table), which only the host writes (plan, replan: synchronous
// copies); q, the cache, sparse indices and every write come after it. The split merge is then
// let launch: not before the wait, or the chain of calls would run ahead (merge, then the next
// decode) and place a decode's CTAs beside the running one's (bench/NOTES.md v34).
__device__ __forceinline__ void begin_after_previous_kernel() {
  pdl_wait();
  pdl_launch_dependents();
}

// Output scale (out_scale / l) and lse (natural log) of a finished row with log2-domain max m and
// sum l. l == 0: the row saw nothing (o = 0, lse = -inf); l NaN: a NaN in the cache reached the
// row (fmaxf skipped it in the max), so o and lse are NaN as in the reference.
struct RowEnd {
  float inv, lse;
};
__device__ __forceinline__ RowEnd finish_row(float m, float l, float out_scale) {
  if (l > 0.0f) return {out_scale / l, (m + log2f(l)) * kLn2};
  if (l == 0.0f) return {0.0f, -INFINITY};
  return {NAN, NAN};
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
      v = *reinterpret_cast<const uint4*>(src);
    }
    *reinterpret_cast<uint4*>(q_s + 2 * (r * kRowElems + 8 * c)) = v;
  }
  __syncthreads();
}

}  // namespace decode

template <KvFormat F, int MT>
__global__ void __launch_bounds__(decode::kThreads, decode::Smem<F, MT>::kMinBlocks)
    mla_decode_kernel(const DecodeParams p) {
  using namespace decode;
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
#pragma unroll 4  // full unrolling with 2-4 m-tiles cost 45% at 128 heads (v2 bench)
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
        // Sum what the tensor cores will multiply (the rounded p), so o / l stays exact.
        const float2 pr = bf16x2_to_float2(pb);
        float sum = pr.x + pr.y;
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
      const RowEnd end = finish_row(row_max[m][h], row_sum[m][h], p.out_scale);
      const float inv = end.inv, lse = end.lse;
      const int tq = r / t.head_count;
      const std::int64_t head = t.head_begin + r % t.head_count;
      const std::int64_t token = q_first + tq;
      const int col0 = 64 * warp + 2 * (lane % 4);
      if (t.split < 0) {
        __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1];
#pragma unroll
        for (int n = 0; n < 8; ++n)
          *reinterpret_cast<__nv_bfloat162*>(dst + col0 + 8 * n) =
              __floats2bfloat162_rn(o[m][n][2 * h] * inv, o[m][n][2 * h + 1] * inv);
        if (p.lse != nullptr && warp == 0 && lane % 4 == 0)
          p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = lse;
      } else {
        const std::int64_t prow = partial_row(p, t, qo_len, tq, head);
        float* dst = p.partial_o + prow * 512;
#pragma unroll
        for (int n = 0; n < 8; ++n)
          *reinterpret_cast<float2*>(dst + col0 + 8 * n) =
              make_float2(o[m][n][2 * h] * inv, o[m][n][2 * h + 1] * inv);
        if (warp == 0 && lane % 4 == 0) p.partial_lse[prow] = lse;
      }
    }
}

}  // namespace fp8mla::detail
