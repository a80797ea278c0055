// The work tile and the CTA shapes every decode family shares: a CTA's WorkTile (load_tile),
// the launch order against the kernel before it (begin_after_previous_kernel), a row's causal
// limit and split partial row, a thread's place in mma fragments and warpgroups.
#pragma once

#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/sync.cuh"

namespace fp8mla::detail::ops {

// Register cap of the kernels that run two CTAs per SM (fp8_exact, fp8_tma): 2 x 256 x 112
// leaves 8192 of an SM's 65536 registers, room for one split-merge CTA (256 threads x 32), so
// the merge, launched as a programmatic dependent, becomes resident and waits while the decode
// grid runs instead of starting only as decode CTAs exit. Shared memory leaves room for it too.
inline constexpr int kMaxRegsTwoCtas = 112;
inline constexpr int kMergeCtaSmem = 6 * 1024;  // merge::split_merge_kernel's, and more
inline constexpr float kLn2 = 0.6931471805599453f;

// The CTA of the <= 16-row families (fp8_exact, fp8_tma, fp8_gather, bf16_tma, bf16_gather):
// 8 math warps, 16 rows, blocks of 64 cache tokens, two stages.
namespace rows16 {
inline constexpr int kThreads = 256;
inline constexpr int kWarps = 8;
inline constexpr int kBlockN = 64;  // cache tokens per block
inline constexpr int kRows = 16;
inline constexpr int kStages = 2;
// A staged token's row: 576 code bytes + 16, a stride of 80 (mod 128) bytes, so the 4 tokens of
// one V read hit 4 different 32-byte bank windows, and the 2 tokens of a K read quarter-warp (t
// and t + 4) are 64 bytes apart.
inline constexpr int kPitch = 592;
inline constexpr int kPElems = kBlockN + 8;  // P row pitch (16-bit): ldmatrix conflict-free
inline constexpr int kSlab = kBlockN * 128;  // 128 bytes of a block's tokens, swizzled
}  // namespace rows16

// The CTA of the 17-64-row families (wide_rows, bf16_wide_rows): two consumer warpgroups of a
// 64-row tile, Q in nine 128-byte-swizzled panels of 64 16-bit dims.
namespace rows64 {
inline constexpr int kThreads = 256;
inline constexpr int kRows = 64;
inline constexpr int kQPanel = kRows * 128;  // 64 q rows x 64 16-bit dims, swizzled
inline constexpr int kConsumerBarrier = 1;   // threads 0-255, named barrier 1
}  // namespace rows64

// This CTA's tile, or false when blockIdx.x is past the live tiles (graph-mode plans launch
// their capacity). The tile is loaded before the count is checked, so the two loads overlap:
// the array holds the grid's capacity, so the read is in bounds either way.
__device__ __forceinline__ bool load_tile(const DecodeParams& p, DeviceTile& d) {
  d = p.tiles[blockIdx.x];
  return static_cast<int>(blockIdx.x) < *p.num_tiles;
}

// The decode grid is a programmatic dependent of the kernel before it in the stream (cuda_run),
// so its launch and set-up overlap that kernel's end. Before this call a kernel reads only the
// plan's buffers (tiles; the page table or sparse list when DecodeParams::entries_before_wait),
// which only the host writes (plan, replan: copies); q, the cache, a caller's page table or
// sparse indices (whose lines may be prefetched into L2 before it: prefetch_token_entry) and
// every write come after it. The split merge is then
// let launch: not before the wait, or the chain of calls would run ahead (merge, then the next
// decode) and place a decode's CTAs beside the running one's.
__device__ __forceinline__ void begin_after_previous_kernel() {
  pdl_wait();
  pdl_launch_dependents();
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

// The warpgroup index broadcast from lane 0, so ptxas knows it is uniform and keeps the wgmma
// descriptors in uniform registers; otherwise each use moves them with R2UR.
__device__ __forceinline__ int uniform_warpgroup() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
}

// The math warps' barrier: the CTA's, or (kProducer) named barrier 1 of the kThreads math
// threads, which a producer warp beside them never joins.
template <bool kProducer>
__device__ __forceinline__ void math_sync() {
  if constexpr (kProducer)
    bar_sync_aligned<1, rows16::kThreads>();
  else
    __syncthreads();
}

}  // namespace fp8mla::detail::ops
