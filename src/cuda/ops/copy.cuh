// Copies into shared memory: cp.async, mbarriers, bulk and tensor-map (TMA) copies (PTX, named
// once), and a cache token's address from the tile's page table or index list, copied whole by
// one bulk copy.
#pragma once

#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; when `valid` is false the destination is
// zero-filled and nothing is read (src must still be a mapped address).
__device__ __forceinline__ void cp_async_16(std::uint32_t smem, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(bytes));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(smem_addr(smem), gmem, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
// A hint that the 128-byte line holding `gmem` is wanted soon: fetched into L2, no register
// waits on it.
__device__ __forceinline__ void prefetch_l2(const void* gmem) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem));
}

// mbarriers and bulk copies (sm_90): the TMA engine copies contiguous global bytes (16-byte
// aligned, a multiple of 16) into shared memory and counts them on an mbarrier, whose phase
// completes once its arrivals and the expected bytes are all in.
__device__ __forceinline__ void mbar_init(void* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals));
}
// After mbar_init, before a barrier makes the mbarriers visible to the CTA and the TMA engine.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(void* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrive and add `bytes` to the bytes the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(void* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Wait until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(void* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// Whether the phase of parity `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(void* bar, unsigned parity) {
  std::uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      " selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// Orders this thread's earlier generic-proxy shared-memory accesses before its later async-proxy
// ones (bulk copies into the same bytes).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    void* bar) {
  asm volatile(
      "cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// A tile of a 3-D tensor map (the TMA engine: box, swizzle and bounds from the map, encoded on
// the host) at coordinates (x, y, z) into shared memory, counted on the mbarrier `bar`. `map` is
// the generic address of a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tma_load_3d(void* dst, const void* map, int x, int y, int z,
                                            void* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3, %4}], [%5];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(smem_addr(bar))
      : "memory");
}

// The dynamic shared memory aligned up to 1024 bytes (the swizzle atoms' alignment); kernels
// that use it reserve 1 KB of slack. Offsetting the array (not rounding a cast integer) keeps the
// pointer visibly in shared memory, so accesses stay LDS / STS.
__device__ __forceinline__ std::uint8_t* dynamic_smem_1k() {
  extern __shared__ std::uint8_t dynamic_smem[];
  return dynamic_smem + ((1024 - smem_addr(dynamic_smem) % 1024) % 1024);
}

namespace ops {

// Byte address of cache token j of the tile's sequence, or null when the slot is skipped.
struct TokenAddr {
  const std::uint8_t* ckv;
  const std::uint8_t* kpe;
};

// The page-table entry (dense: page id) or index-list entry (sparse: pool slot) of token `tok` of
// block `blk` (kBlock tokens a block), loaded but not yet used: the kernels load it one block
// before the token's copies are issued and turn it into a slot (entry_slot_of) only then, so the
// load overlaps a block of math instead of stalling every warp right after a barrier.
// kv_base = kv_indptr[request].
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
// token_entry_of's line fetched into L2 only (prefetch_l2): issued before the programmatic wait
// where the entries are the caller's, so that their load after the wait is an L2 hit. A
// prefetch returns nothing to the thread and the previous kernel's writes land in L2, so the
// load still sees them.
template <int kBlock>
__device__ __forceinline__ void prefetch_token_entry(const DecodeParams& p, const WorkTile& t,
                                                     int q_token, std::int32_t kv_base, int blk,
                                                     int tok) {
  const int j = t.kv_begin + blk * kBlock + tok;
  if (j < t.kv_end)
    prefetch_l2(p.topk > 0 ? p.sparse_indices + static_cast<std::int64_t>(q_token) * p.topk + j
                           : p.kv_indices + kv_base + (j >> p.page_shift));
}
// Pool slot (page * page_size + offset) of token `tok` of block `blk`, or -1 when it is past the
// tile or skipped. An entry outside the pool is skipped too: plan() checks the page ids it
// copies, but a borrowed page table (Problem::borrowed_kv_indices) is read as the caller left
// it, and a sparse list passed to run() is never checked on the host.
template <int kBlock>
__device__ __forceinline__ std::int64_t entry_slot_of(const DecodeParams& p, const WorkTile& t,
                                                      int blk, std::int32_t e, int tok) {
  const int j = t.kv_begin + blk * kBlock + tok;
  if (j >= t.kv_end || e < 0) return -1;
  const std::int64_t slot = p.topk > 0 ? e
                                       : (static_cast<std::int64_t>(e) << p.page_shift) |
                                             (j & ((1 << p.page_shift) - 1));
  return slot < p.pool_slots ? slot : -1;
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
// (Broadcasting each address to the whole warp, one elected issuer, is slower: its shuffles queue
// on the MIO path the fragment reads need.)
static_assert(rows16::kBlockN == 8 * rows16::kWarps,
              "one bulk-copied token per lane 0..7 of each warp");
__device__ __forceinline__ bool bulk_copier() {
  return threadIdx.x % 32 < 8;
}
__device__ __forceinline__ int bulk_token() {
  return 8 * (threadIdx.x / 32) + threadIdx.x % 32;
}

// The bulk copy of one token (slot from entry_slot_of) into `row`: its ckv (kCkv bytes) and kpe
// (kKpe bytes) in one copy when the kpe bytes follow the ckv bytes (the PagedLatentCache
// layout) or there are none (kKpe = 0: the block format's whole token is kCkv), else in two;
// they complete on the stage mbarrier `bar` (one arrival per token and phase). A skipped token is
// zero-filled and flagged 0.
template <int kCkv, int kKpe>
__device__ __forceinline__ void bulk_copy_token(const DecodeParams& p, std::int64_t slot,
                                                std::uint8_t* row, std::uint8_t* flag, void* bar) {
  const TokenAddr a = slot_addr(p, slot);
  *flag = a.ckv != nullptr ? 1 : 0;
  if (a.ckv != nullptr) {
    mbar_arrive_expect_tx(bar, kCkv + kKpe);
    if (kKpe == 0 || a.kpe == a.ckv + kCkv) {
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

}  // namespace ops

}  // namespace fp8mla::detail
