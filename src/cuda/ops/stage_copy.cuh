// The <= 16-row families' block copies into two or more stages, each completing on its `full`
// mbarrier and handed back on its `released` one: page runs as tensor-map boxes issued by one
// warp's lanes (PageRunCopier, next_block), or tokens as bulk copies issued by producer warps
// beside the math warps (TokenProducer); rows past a tile's end zeroed before P V reads them.
#pragma once

#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/ops/copy.cuh"
#include "src/cuda/ops/mma.cuh"
#include "src/cuda/ops/tile.cuh"

namespace fp8mla::detail::ops {

using rows16::kBlockN;
using rows16::kSlab;
using rows16::kThreads;
using rows16::kWarps;

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
  // The stages' mbarriers (full: np arrivals, one a page run; released: kWarps, lane 0 of each
  // warp), begin_after_previous_kernel, and the first two blocks' entries (copier lanes): before
  // the wait where they are the plan's own (DecodeParams::entries_before_wait), else after it.
  __device__ void start(const DecodeParams& p, std::uint8_t* full, std::uint8_t* released,
                        std::int32_t& entry0, std::int32_t& entry1) const {
    const auto first_entries = [&] {
      if (copier) {
        entry0 = entry(p, 0);
        entry1 = entry(p, 1);
      }
    };
    if (p.entries_before_wait) first_entries();
    if (threadIdx.x == 0) init_stage_barriers(full, np, released, kWarps);
    begin_after_previous_kernel();
    if (!p.entries_before_wait) first_entries();
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
// warp has released it (a stage mbarrier, not a CTA barrier: the other warps run on),
// block blk + 2's entries are loaded, then every thread waits for block blk
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

// The gather families' copies (pages of < 8 tokens, where a one-token box into the swizzled
// layout faults; sparse lists; the block format; bf16's long tiles at any page size): four
// producer warps beside the kThreads math threads, lanes 0-15 of producer warp w copying tokens
// 16 w + lane of each block, one bulk copy a token (bulk_copy_token: kCkv + kKpe bytes) into a
// kPitch-byte row of a kStageBytes stage; a token past the tile's end or skipped is zero-filled,
// so P V reads zeros there, and flagged 0 (TokenProducer: where its flag lies), which the
// scores' mask reads. ptxas issues a bulk copy once per active lane through the uniform
// datapath: issued by the math warps, that loop sits on their chain, and one producer warp
// issues too slowly for the copies; two or four keep the copies at their rate alone. A stage
// completes on its full mbarrier (kBlockN arrivals, one a token) and is released by the
// kReleasers math threads that read it (each thread arrives: with lane 0 arriving for its warp
// after a __syncwarp, racecheck reports the copies against the other lanes' reads).
inline constexpr int kProducerWarps = 4;
inline constexpr int kProducerLanes = kBlockN / kProducerWarps;
static_assert(kProducerLanes <= 32, "a token a producer lane");
template <bool kGather>
inline constexpr int kCtaThreads = kThreads + (kGather ? 32 * kProducerWarps : 0);

template <int kStages, int kStageBytes, int kPitch, int kCkv, int kKpe, int kReleasers = kThreads>
struct TokenProducer {
  // A token's flag: the byte after it in its row's padding, or (rows without padding: the block
  // format's 656 bytes at a pitch of 656) flags[stage][token], an array run() is given.
  static constexpr bool kFlagInRow = kPitch > kCkv + kKpe;
  // The producer warps' whole work: the stages' mbarriers (kStages at `full`, kStages at
  // `released`), blocks 0 .. kStages - 1, the CTA barrier after which the math warps wait on the
  // mbarriers (cta_sync), then block blk into stage blk % kStages once block blk - kStages is
  // released. Page-table entries are loaded a block ahead of their copies. pwarp: the producer
  // warp, 0..kProducerWarps - 1.
  __device__ static void run(const DecodeParams& p, const DeviceTile& tile, int pwarp, int lane,
                             int n_blocks, std::uint8_t* stages, std::uint8_t* full,
                             std::uint8_t* released, std::uint8_t* flags = nullptr) {
    const int tok = kProducerLanes * pwarp + lane;
    const bool copier = lane < kProducerLanes;
    // Blocks 0 and 1's entries: before the wait where they are the plan's own
    // (DecodeParams::entries_before_wait), else after it, their lines prefetched into L2 before
    // it (0.2 us of a bs-1 sparse call on the H100).
    std::int32_t e0 = 0, e1 = 0;
    const auto first_entries = [&] {
      if (copier) {
        e0 = entry(p, tile, 0, tok);
        e1 = entry(p, tile, 1, tok);
      }
    };
    if (p.entries_before_wait) {
      first_entries();
    } else if (copier) {
      prefetch_token_entry<kBlockN>(p, tile.tile, tile.q_first, tile.kv_base, 0, tok);
      prefetch_token_entry<kBlockN>(p, tile.tile, tile.q_first, tile.kv_base, 1, tok);
    }
    if (pwarp == 0 && lane == 0) init_stage_barriers<kStages>(full, kBlockN, released, kReleasers);
    bar_sync_aligned<2, 32 * kProducerWarps>();  // the mbarriers, before any producer uses them
    begin_after_previous_kernel();
    if (!p.entries_before_wait) first_entries();
    const auto issue = [&](int blk) {
      if (copier) {
        const int stage = blk % kStages;
        std::uint8_t* row = stages + stage * kStageBytes + tok * kPitch;
        std::uint8_t* flag = kFlagInRow ? row + kCkv + kKpe : flags + stage * kBlockN + tok;
        bulk_copy_token<kCkv, kKpe>(p, entry_slot_of<kBlockN>(p, tile.tile, blk, e0, tok), row,
                                    flag, full + 8 * stage);
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
    return token_entry_of<kBlockN>(p, tile.tile, tile.q_first, tile.kv_base, blk, tok);
  }
};

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

}  // namespace fp8mla::detail::ops
