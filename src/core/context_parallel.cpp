// Context parallelism: shard_context(), and the NCCL exchange around run() and merge_states()
// (include/fp8mla/context_parallel.h).
#include "fp8mla/context_parallel.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/core/context_parallel_run.h"
#include "src/core/nccl.h"
#include "src/core/plan_state.h"
#include "src/core/validate.h"

namespace fp8mla {

using detail::check_tensor;
using detail::nccl;
using detail::nccl_check;
using detail::require;

void shard_context(const Problem& full, int rank, int world, ContextShard& shard) try {
  require(world >= 1, "world", "must be >= 1, got ", world);
  require(rank >= 0 && rank < world, "rank", rank, " is outside [0, ", world, ")");
  require(full.topk == 0, "problem.topk",
          "sparse problems index global slots; shard them by filtering the indices");
  require(!full.device_kv_indices.defined(), "problem.device_kv_indices",
          "context parallelism shards the page table on the host: give kv_indices");
  require(!full.borrowed_kv_indices.defined(), "problem.borrowed_kv_indices",
          "context parallelism copies each rank's share of the page table: give kv_indices");
  // run_context_parallel() merges the ranks' rows with merge_states(), which writes bf16.
  require(full.out_dtype == DType::bf16, "problem.out_dtype",
          "context parallelism merges bf16 outputs: expected bf16, got ",
          dtype_name(full.out_dtype));
  require(full.causal_len.empty(), "problem.causal_len",
          "is what shard_context sets; shard the full problem, not a shard");
  // plan()'s checks of everything read below (offsets from 0, non-decreasing and within
  // kv_indices, kv_len within the pages listed, causal qo_len <= kv_len), but not the page ids:
  // the full table may name pages of other ranks' pools. Each shard's plan checks its own.
  try {
    detail::validate_scalars(full);
    detail::validate_arrays(full, PlanOptions{}, /*page_ids=*/false);
  } catch (const Error& e) {
    detail::rethrow_with_prefix(e, "problem.");
  }
  const std::size_t batch = full.qo_indptr.size() - 1;
  shard.qo_indptr.assign(full.qo_indptr.begin(), full.qo_indptr.end());
  shard.kv_indptr.assign(1, 0);
  shard.kv_indices.clear();
  shard.kv_len.clear();
  shard.causal_len.clear();
  for (std::size_t r = 0; r < batch; ++r) {
    const std::int64_t len = full.kv_len[r], ps = full.page_size;
    const std::int64_t pages = (len + ps - 1) / ps;  // <= the pages listed (validated)
    const std::int64_t per = (pages + world - 1) / world;
    const std::int64_t first = std::min(pages, rank * per), last = std::min(pages, first + per);
    for (std::int64_t p = first; p < last; ++p)
      shard.kv_indices.push_back(full.kv_indices[full.kv_indptr[r] + p]);
    shard.kv_indptr.push_back(static_cast<std::int32_t>(shard.kv_indices.size()));
    const std::int64_t held = std::max<std::int64_t>(0, std::min(len, last * ps) - first * ps);
    shard.kv_len.push_back(static_cast<std::int32_t>(held));
    // The mask counts from the whole context: query token i of qo sees global tokens
    // [0, len - qo + i], i.e. this shard's [0, len - first * ps - qo + i].
    shard.causal_len.push_back(static_cast<std::int32_t>(held > 0 ? len - first * ps : 0));
  }
  shard.problem = full;
  shard.problem.qo_indptr = shard.qo_indptr;
  shard.problem.kv_indptr = shard.kv_indptr;
  shard.problem.kv_indices = shard.kv_indices;
  shard.problem.kv_len = shard.kv_len;
  if (full.causal) shard.problem.causal_len = shard.causal_len;
} catch (...) {
  detail::rethrow_as_error("shard_context");
}

// ---- NcclComm ----

NcclId nccl_unique_id() {
  detail::NcclUniqueIdAbi raw{};
  nccl_check(nccl().get_unique_id(&raw), "ncclGetUniqueId");
  NcclId id;
  std::memcpy(id.bytes.data(), raw.internal, sizeof raw.internal);
  return id;
}

NcclComm::NcclComm(const NcclId& id, int rank, int world, int device_id)
    : rank_(rank), world_(world), device_id_(device_id), owned_(true) {
  require(world >= 1, "world", "must be >= 1, got ", world);
  require(rank >= 0 && rank < world, "rank", rank, " is outside [0, ", world, ")");
  const detail::CurrentDeviceGuard keep(true);
  detail::cuda_set_device(device_id);  // the communicator's device is the current one
  const detail::NcclApi& api = nccl();
  detail::NcclUniqueIdAbi raw{};
  std::memcpy(raw.internal, id.bytes.data(), sizeof raw.internal);
  nccl_check(api.comm_init_rank(&comm_, world, raw, rank), "ncclCommInitRank");
}

NcclComm NcclComm::borrow(void* nccl_comm, int device_id) {
  require(nccl_comm != nullptr, "nccl_comm", "is null");
  const detail::NcclApi& api = nccl();
  NcclComm c;
  c.comm_ = nccl_comm;
  c.device_id_ = device_id;
  nccl_check(api.comm_count(nccl_comm, &c.world_), "ncclCommCount");
  nccl_check(api.comm_user_rank(nccl_comm, &c.rank_), "ncclCommUserRank");
  return c;
}

NcclComm::~NcclComm() {
  if (owned_ && comm_ != nullptr) (void)nccl().comm_destroy(comm_);
}

NcclComm::NcclComm(NcclComm&& o) noexcept
    : comm_(std::exchange(o.comm_, nullptr)),
      rank_(o.rank_),
      world_(o.world_),
      device_id_(o.device_id_),
      owned_(o.owned_) {}

NcclComm& NcclComm::operator=(NcclComm&& o) noexcept {
  std::swap(comm_, o.comm_);
  std::swap(rank_, o.rank_);
  std::swap(world_, o.world_);
  std::swap(device_id_, o.device_id_);
  std::swap(owned_, o.owned_);
  return *this;
}

// ---- ContextParallelPlan ----

struct ContextParallelPlan::State {
  const NcclComm* comm = nullptr;
  // Behind a pointer: a replan shards into a new one and keeps it only once the local replan
  // succeeded (ContextShard does not move: its problem points into its vectors).
  std::unique_ptr<ContextShard> shard = std::make_unique<ContextShard>();
  Plan local;
  std::vector<std::int32_t> qo_indptr;  // the batch's, fixed for graph-mode replans
  std::int64_t rows = 0;                // total_q x H
  detail::DeviceMemory out, lse;        // [world, rows, 512] bf16, [world, rows] f32
};

ContextParallelPlan::ContextParallelPlan() = default;
ContextParallelPlan::~ContextParallelPlan() = default;
ContextParallelPlan::ContextParallelPlan(ContextParallelPlan&&) noexcept = default;
ContextParallelPlan& ContextParallelPlan::operator=(ContextParallelPlan&&) noexcept = default;

ContextParallelPlan::State& ContextParallelPlan::state() const {
  require(state_ != nullptr, "plan", "is empty (default-constructed or moved from)");
  return *state_;
}
const Plan& ContextParallelPlan::local() const {
  return state().local;
}
const ContextShard& ContextParallelPlan::shard() const {
  return *state().shard;
}
const NcclComm& ContextParallelPlan::comm() const {
  return *state().comm;
}

ContextParallelPlan plan_context_parallel(const Problem& full, const NcclComm& comm,
                                          const PlanOptions& options) try {
  require(full.device == DeviceKind::cuda, "problem.device",
          "context parallelism exchanges over NCCL: expected cuda, got ", device_name(full.device));
  require(full.device_id == comm.device_id(), "problem.device_id", full.device_id,
          " is not the communicator's device ", comm.device_id());
  const detail::CurrentDeviceGuard keep(true);
  ContextParallelPlan cp;
  cp.state_ = std::make_unique<ContextParallelPlan::State>();
  ContextParallelPlan::State& s = *cp.state_;
  s.comm = &comm;
  shard_context(full, comm.rank(), comm.world(), *s.shard);
  s.local = plan(s.shard->problem, options);
  s.qo_indptr = s.shard->qo_indptr;
  s.rows = std::int64_t{s.local.total_q()} * s.local.num_heads();
  const auto bytes = static_cast<std::size_t>(comm.world() * s.rows);
  s.out = detail::DeviceMemory(bytes * kDimCkv * 2, comm.device_id());
  s.lse = detail::DeviceMemory(bytes * 4, comm.device_id());
  return cp;
} catch (...) {
  detail::rethrow_as_error("plan_context_parallel");
}

void replan_context_parallel(ContextParallelPlan& plan, const Problem& full) try {
  ContextParallelPlan::State& s = plan.state();
  require(std::equal(full.qo_indptr.begin(), full.qo_indptr.end(), s.qo_indptr.begin(),
                     s.qo_indptr.end()),
          "problem.qo_indptr",
          "must equal the planned batch's (the all-gather's size is fixed at capture)");
  auto next = std::make_unique<ContextShard>();
  shard_context(full, s.comm->rank(), s.comm->world(), *next);
  replan(s.local, next->problem);  // a failed replan leaves the plan, and its shard, as they were
  s.shard = std::move(next);
} catch (...) {
  detail::rethrow_as_error("replan_context_parallel");
}

namespace detail {

void run_sharded(const Plan& local, int rank, int world, const ExchangeBuffers& x,
                 const RunArgs& args, const AllGather& all_gather) {
  const std::int64_t tq = local.total_q(), h = local.num_heads(), rows = x.rows;
  // No query tokens: nothing to exchange; run() still checks the arguments (of 0 rows).
  if (tq == 0) return run(local, args);
  const DeviceKind device = local.device();
  const int dev = local.state().device_id;
  check_tensor(args.out, "out", {DType::bf16}, {tq, h, kDimCkv}, device, dev);
  require(args.out.stride[0] == h * args.out.stride[1], "out.stride[0]",
          "the rows must be dense for the merge: expected ", h * args.out.stride[1], ", got ",
          args.out.stride[0]);
  if (args.lse.defined()) {
    check_tensor(args.lse, "lse", {DType::f32}, {tq, h}, device, dev);
    require(args.lse.stride[0] == h, "lse.stride[0]",
            "the rows must be dense for the merge: expected ", h, ", got ", args.lse.stride[0]);
  }

  // This rank's partials, straight into its slot of the world-major exchange buffers.
  RunArgs mine = args;
  mine.out = make_view(x.out + rank * rows * kDimCkv, DType::bf16, {tq, h, kDimCkv}, device, dev);
  mine.lse = make_view(x.lse + rank * rows, DType::f32, {tq, h}, device, dev);
  run(local, mine);
  all_gather(x);

  TensorView lse_out;
  if (args.lse.defined())
    lse_out = make_strided_view(args.lse.data, DType::f32, {rows}, {1}, device, dev);
  merge_states(make_strided_view(x.out, DType::bf16, {rows, world, kDimCkv},
                                 {kDimCkv, rows * kDimCkv, 1}, device, dev),
               make_strided_view(x.lse, DType::f32, {rows, world}, {1, rows}, device, dev),
               make_strided_view(args.out.data, DType::bf16, {rows, kDimCkv},
                                 {args.out.stride[1], 1}, device, dev),
               lse_out, args.stream);
}

}  // namespace detail

void run_context_parallel(const ContextParallelPlan& plan, const RunArgs& args) try {
  const ContextParallelPlan::State& s = plan.state();
  const detail::ExchangeBuffers x{s.out.as<std::uint16_t>(), s.lse.as<float>(), s.rows};
  // In place: each rank's send buffer is its own slot of the receive buffer.
  const auto nccl_all_gather = [&](const detail::ExchangeBuffers& b) {
    const detail::NcclApi& api = nccl();
    void* comm = s.comm->handle();
    const std::int64_t r = s.comm->rank();
    nccl_check(api.group_start(), "ncclGroupStart");
    const int gathered = api.all_gather(b.out + r * b.rows * kDimCkv, b.out,
                                        static_cast<std::size_t>(b.rows * kDimCkv),
                                        detail::kNcclBfloat16, comm, args.stream);
    const int gathered_lse =
        api.all_gather(b.lse + r * b.rows, b.lse, static_cast<std::size_t>(b.rows),
                       detail::kNcclFloat32, comm, args.stream);
    nccl_check(api.group_end(), "ncclGroupEnd");
    nccl_check(gathered, "ncclAllGather(out)");
    nccl_check(gathered_lse, "ncclAllGather(lse)");
  };
  detail::run_sharded(s.local, s.comm->rank(), s.comm->world(), x, args, nccl_all_gather);
} catch (...) {
  detail::rethrow_as_error("run_context_parallel");
}

}  // namespace fp8mla
