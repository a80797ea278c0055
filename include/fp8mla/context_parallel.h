// fp8mla: context parallelism (one request's cache pages spread over several GPUs).
//
// Each rank holds a contiguous, page-aligned share of every request's context. It plans and runs
// decode on its share (shard_context() builds that rank's Problem), the ranks exchange their
// (out, lse) pairs with an NCCL all-gather (as [world, total_q, H, 512] bf16 and
// [world, total_q, H] f32), and merge_states() over the world axis gives the full result. The
// merge is exactly the split-KV merge, so a sharded run matches an unsharded one up to the bf16
// rounding of the exchanged partials.
//
// Two levels: shard_context() alone (the caller exchanges and merges with its own communicator),
// or NcclComm + plan_context_parallel() + run_context_parallel(), which do all three on CUDA.
// NCCL is loaded at run time (dlopen), so the library does not link it: FP8MLA_NCCL_LIBRARY
// names the file, else the process's own libnccl.so.2 (e.g. PyTorch's) or the loader's.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "fp8mla/attention.h"

namespace fp8mla {

// One rank's share of a batch: index arrays it owns and a Problem viewing them.
struct ContextShard {
  std::vector<std::int32_t> qo_indptr, kv_indptr, kv_indices, kv_len;
  // Causal problems: kv_len_r - (this rank's first token of request r), where the rank holds any
  // of its tokens (else 0): the shard's causal mask counts from the whole context
  // (Problem::causal_len), so multi-token rows see the tokens the unsharded problem shows them.
  std::vector<std::int32_t> causal_len;
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
// Errors (invalid_argument): world < 1, rank outside [0, world), a sparse problem (its indices are
// global slots: shard them by filtering instead), a full problem that already has a causal_len
// (shards of shards are not supported), a page table on the device (device_kv_indices: shards are
// cut on the host) or borrowed (borrowed_kv_indices: each shard holds its own copy), out_dtype
// other than bf16 (run_context_parallel merges the ranks' rows in bf16), and plan()'s validation of
// the scalars and index arrays (offsets from 0, non-decreasing, kv_indptr ending at
// kv_indices.size(), kv_len within the pages listed, causal qo_len <= kv_len, the row bound), with
// arguments named "problem.<field>". The page ids are not checked here: the full table may list
// other ranks' pages by their pools' ids; each shard's plan() checks the ones it holds.
void shard_context(const Problem& full, int rank, int world, ContextShard& shard);

// ---- The NCCL exchange (CUDA devices) ----

// NCCL's unique id (ncclUniqueId): one rank (or a launcher) makes it and every rank of the group
// passes the same bytes to NcclComm.
struct NcclId {
  std::array<char, 128> bytes{};
};

// A new id (ncclGetUniqueId; the process that makes it serves the group's bootstrap until every
// rank has joined, so it must outlive the NcclComm constructors). Errors: unsupported when NCCL
// cannot be loaded (the message names the library tried), cuda_error when NCCL fails.
NcclId nccl_unique_id();

// One rank's NCCL communicator on one CUDA device (a process or a thread per GPU).
class NcclComm {
 public:
  // Joins the group: every rank in [0, world) calls this with the same id (it blocks until all
  // have). Errors: invalid_argument for world < 1, rank outside [0, world) or device_id not a
  // visible CUDA device; unsupported without NCCL or CUDA; cuda_error when NCCL fails.
  NcclComm(const NcclId& id, int rank, int world, int device_id);
  // Uses a communicator the caller owns (an ncclComm_t on device_id, e.g. from an engine's
  // process group): rank and world are read from it, and it is not destroyed here.
  static NcclComm borrow(void* nccl_comm, int device_id);
  ~NcclComm();
  NcclComm(NcclComm&&) noexcept;
  NcclComm& operator=(NcclComm&&) noexcept;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const noexcept { return rank_; }
  int world() const noexcept { return world_; }
  int device_id() const noexcept { return device_id_; }
  void* handle() const noexcept { return comm_; }  // the ncclComm_t

 private:
  NcclComm() = default;
  void* comm_ = nullptr;
  int rank_ = 0, world_ = 1, device_id_ = 0;
  bool owned_ = false;
};

// One rank's plan for a context-parallel batch: its shard's Plan and the exchange buffers
// ([world, rows, 512] bf16 and [world, rows] f32, rows = total_q x H: ~1 KB a row and rank).
class ContextParallelPlan {
 public:
  ContextParallelPlan();
  ~ContextParallelPlan();
  ContextParallelPlan(ContextParallelPlan&&) noexcept;
  ContextParallelPlan& operator=(ContextParallelPlan&&) noexcept;

  const Plan& local() const;          // this rank's shard, planned
  const ContextShard& shard() const;  // its page table and lengths
  const NcclComm& comm() const;

 private:
  struct State;
  State& state() const;  // invalid_argument when empty (default-constructed or moved from)
  friend ContextParallelPlan plan_context_parallel(const Problem&, const NcclComm&,
                                                   const PlanOptions&);
  friend void replan_context_parallel(ContextParallelPlan&, const Problem&);
  friend void run_context_parallel(const ContextParallelPlan&, const RunArgs&);
  std::unique_ptr<State> state_;
};

// Shards `full` for comm's rank of comm's world (shard_context), plans the shard on comm's
// device, and allocates the exchange buffers (total_q x H rows). `comm` must outlive the plan
// and stay where it is (the plan keeps its address). Errors: those of shard_context() and
// plan(), and invalid_argument when full.device is not cuda or full.device_id is not comm's.
ContextParallelPlan plan_context_parallel(const Problem& full, const NcclComm& comm,
                                          const PlanOptions& options = {});

// Graph mode (options.cuda_graph): re-shards and re-plans in place for new lengths and pages,
// so a captured run_context_parallel() replays on them. The batch's query tokens stay as
// captured (the all-gather's size is part of the graph): invalid_argument when total_q or
// qo_indptr differ, plus replan()'s errors.
void replan_context_parallel(ContextParallelPlan& plan, const Problem& full);

// Decode of the whole contexts, on every rank: run() of this rank's shard into its slot of the
// exchange buffers, one NCCL all-gather of (out, lse) on args.stream, then merge_states() into
// args.out / args.lse. `args` are run()'s for the full batch: q, out and lse hold all total_q
// rows (out and lse dense over their [total_q, H] rows: stride[0] = H x stride[1]); kv is this
// rank's cache view, which must hold its shard's pages (ids as in the full page table). Every
// rank calls it, in the same order as its other collectives on the communicator; a plan's
// exchange buffers serve one run at a time (as a Plan's workspace). No allocation and no host
// synchronisation: capturable in a CUDA graph. Errors: run()'s and merge_states()'s checks,
// invalid_argument for out / lse rows that are not dense, cuda_error when NCCL fails.
void run_context_parallel(const ContextParallelPlan& plan, const RunArgs& args);

}  // namespace fp8mla
