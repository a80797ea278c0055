// fp8mla: context parallelism (one request's cache pages spread over several GPUs).
//
// Each rank holds a contiguous, page-aligned share of every request's context. It plans and runs
// decode on its share (shard_context() builds that rank's Problem), the ranks exchange their
// (out, lse) pairs (with NCCL, as [world, total_q, H, 512] bf16 and [world, total_q, H] f32),
// and merge_states() over the world axis gives the full result. The exchange is the caller's
// (its communicator); the merge is exactly the split-KV merge, so a sharded run matches an
// unsharded one up to the bf16 rounding of the exchanged partials.
#pragma once

#include <cstdint>
#include <vector>

#include "fp8mla/attention.h"

namespace fp8mla {

// One rank's share of a batch: index arrays it owns and a Problem viewing them.
struct ContextShard {
  std::vector<std::int32_t> qo_indptr, kv_indptr, kv_indices, kv_len;
  Problem problem;  // = the full problem with this rank's page table and lengths

  ContextShard() = default;
  ContextShard(const ContextShard&) = delete;  // `problem` points into this object's vectors
  ContextShard& operator=(const ContextShard&) = delete;
  ContextShard(ContextShard&&) = delete;
  ContextShard& operator=(ContextShard&&) = delete;
};

// Rank `rank` of `world` gets pages [k * n, min((k + 1) * n, pages_r)) of request r, where
// pages_r = ceil(kv_len_r / page_size) and n = ceil(pages_r / world), and the tokens in them
// (a rank past the end of a short request gets kv_len 0: its rows merge as empty states).
// Fills `shard` (its vectors, then shard.problem over them).
// Errors (invalid_argument): world < 1, rank outside [0, world), a sparse problem (its indices
// are global slots: shard them by filtering instead), causal with some qo_len > 1 (a shard
// other than the last would mask the wrong tokens), and the validation plan() would do on the
// index arrays it reads (lengths, kv_len within the pages listed).
void shard_context(const Problem& full, int rank, int world, ContextShard& shard);

}  // namespace fp8mla
