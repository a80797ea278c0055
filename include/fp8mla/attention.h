// fp8mla: MLA attention over a paged latent cache: plan(), run(), merge_states().
//
// For request r with L_r cached tokens and H query heads, each query row q = [q_nope | q_pe]
// (512 + 64 values) computes
//     s_j = sm_scale * (q_nope . ckv_j + q_pe . kpe_j)        j over the tokens it sees
//     o   = sum_j softmax(s)_j * ckv_j                       (512 wide)
//     lse = log(sum_j exp(s_j))                              (natural log, float32)
// Dense: request r has qo_len_r = qo_indptr[r+1] - qo_indptr[r] query tokens; with `causal`,
// query token i sees cache tokens [0, L_r - qo_len_r + i], otherwise all L_r tokens.
// Sparse (DSA, topk > 0): query token t sees the `topk` global slots sparse_indices[t, :],
// skipping entries equal to -1.
// A row that sees no token (kv_len = 0, or all -1) gets o = 0 and lse = -inf.
//
// plan() runs on the host once per batch: it copies and validates every index and length and
// partitions the work (split-KV) for the target. run() only computes: on CUDA it launches
// kernels without allocating or synchronising, so it may be captured in a CUDA graph.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "fp8mla/cache.h"
#include "fp8mla/format.h"
#include "fp8mla/limits.h"
#include "fp8mla/tensor.h"

namespace fp8mla {

inline constexpr int kMaxHeads = 128;
inline constexpr int kMaxRowsPerTile = 64;  // rows = query tokens x heads handled by one tile
inline constexpr int kMaxPageSize = 128;

// The batch to plan. Spans are read during plan() only (plan copies what it keeps).
struct Problem {
  int num_heads = 0;           // H, 1..128 (heads on this GPU after tensor parallelism)
  int page_size = 1;           // power of two, 1..128
  std::int64_t num_pages = 0;  // pages in the pool (bound for kv_indices)
  KvFormat kv_format = KvFormat::fp8_e4m3;
  // Query and output element types, bf16 or f16 (FlashInfer's fp16 queries and outputs), on
  // every backend. The CPU backend multiplies f16 queries as given; on CUDA, f16 queries over a
  // bf16 cache run portable_f16_exact (fp16-exact products), and the other families round them
  // to bf16 as they load them (2^-9 relative at most, the precision of their bf16 products).
  DType q_dtype = DType::bf16;
  DType out_dtype = DType::bf16;
  bool causal = true;
  float sm_scale = 0.0f;  // in (0, kMaxSmScale] (1/sqrt(192) etc.; the caller folds YaRN in)

  // [batch + 1], 0-based, non-decreasing; batch may be 0 (qo_indptr = {0}: nothing to compute).
  std::span<const std::int32_t> qo_indptr;
  std::span<const std::int32_t> kv_indptr;   // [batch + 1] offsets into kv_indices (pages)
  std::span<const std::int32_t> kv_indices;  // [kv_indptr[batch]] page ids in [0, num_pages)
  std::span<const std::int32_t> kv_len;      // [batch] tokens, <= pages listed * page_size
  // Causal dense problems whose listed tokens are the start of a longer context (a
  // context-parallel shard; shard_context() sets it): [batch] the length each request's causal
  // mask counts from, >= kv_len[r]. Query token i of request r then sees the listed tokens
  // [0, causal_len[r] - qo_len + i]; a row that sees none gets o = 0, lse = -inf. Empty: kv_len.
  std::span<const std::int32_t> causal_len;
  // CUDA plans may take the page table where an engine builds it, on the GPU, instead of
  // kv_indices (give one of the two): i32 [kv_indptr[batch]], contiguous, on the plan's device.
  // plan() checks every entry there (a kernel and one small copy back) and copies the table into
  // the plan's own device buffer, so, like the spans, it is read during plan() only, on the
  // legacy default stream: work that writes it on another stream must be complete (the Python
  // layer synchronises torch's current stream). It saves the host round trip of the largest
  // index array (1M entries at 128 requests x 8K tokens on pages of 1 token).
  TensorView device_kv_indices;
  // A page table the plan borrows instead of copying (give it instead of kv_indices and
  // device_kv_indices): FlashInfer's graph mode, where the kernels read the caller's index buffer
  // when they run. i32 [>= kv_indptr[batch]], contiguous, in host memory for a CPU plan or on the
  // plan's device for a CUDA plan, owned by the caller, alive and unmoved while the plan is run.
  // plan() and replan() check its view only; every run() reads the page ids [0, kv_indptr[batch])
  // from it then, so the caller may rewrite them in place between plan and run (or before a CUDA
  // graph replay) and the run sees the new pages. Ids are not checked at plan time: the CPU
  // backend's run() throws invalid_argument naming borrowed_kv_indices[i] for an id outside
  // [0, num_pages) before it computes anything; the CUDA kernels read them as they are (keep them
  // inside the pool, as FlashInfer requires).
  TensorView borrowed_kv_indices;

  // Sparse mode when topk > 0: sparse_indices is [total_q, topk] global slots
  // (page * page_size + offset) in [0, num_pages * page_size) or -1. kv_indptr / kv_indices /
  // kv_len may then be empty (they are validated if given).
  int topk = 0;
  std::span<const std::int32_t> sparse_indices;

  DeviceKind device = DeviceKind::cpu;  // where run() will compute
  int device_id = 0;
};

// The kernel family that computes a plan. plan() chooses it once from one table
// (src/core/dispatch.h: device and compute capability, format, rows a tile, dense or sparse,
// page size, kpe_scale / ckv_scale ratio, exact scores, tile length), partitions the work for
// it, records it (Plan::kernel_family(), Plan::kernel_name()), and every run() of the plan
// launches it. PlanOptions::kernel_family forces one.
enum class KernelFamily : std::uint8_t {
  automatic,      // PlanOptions: the table chooses ("auto")
  cpu_fast,       // CPU: threaded float32 tiles
  cpu_reference,  // CPU: the float64 reference (PlanOptions::cpu_reference chooses it too)
  shared_tile,    // CUDA: bf16 tile in shared memory, mma.sync (block format, sparse bf16)
  fp8_exact,      // CUDA: fp8_e4m3 and block format <= 16 rows, fp16 products (exact_scores,
                  // any ratio)
  fp8_tma,        // CUDA: fp8_e4m3 <= 16 rows, fp8 tensor cores, tensor-map copies (pages >= 8)
  fp8_gather,     // CUDA: fp8_e4m3 (pages < 8, sparse) and block format <= 16 rows, fp8 tensor
                  // cores, per-token copies
  bf16_tma,       // CUDA: bf16 <= 16 rows, tensor-map copies
  bf16_gather,    // CUDA: bf16 <= 16 rows, per-token copies
  wide_rows,      // CUDA: fp8_e4m3 and bf16 17-64 rows, warp-specialized wgmma
  bf16_wide_rows,  // CUDA: bf16 17-64 rows on pages of >= 64 tokens
  // CUDA sm_80 and newer (every GPU from Ampere to Blackwell): cp.async copies, codes converted
  // into mma.sync operands, every format, rows and mode; fp16 products (bf16 for bf16 caches).
  // The family of every GPU but sm_90's; Hopper may force it.
  portable,
  // The portable family with fp8_e4m3 scores on fp8 tensor cores (mma.sync e4m3, q as two e4m3
  // terms): fp8_e4m3 caches, fast scores; chosen on sm_89 and sm_12x (native there); sm_90 and
  // sm_100 may force it for tiles of <= 16 rows (ptxas emulates the instruction there).
  portable_fp8,
  // The portable family's fp16-exact products for fp16 queries over a bf16 cache (q and P each
  // as two bf16 terms): chosen for such plans on every GPU from sm_80, Hopper included, so they
  // meet an fp16 tolerance; the other families round fp16 queries to bf16.
  portable_f16_exact,
};
// "auto", "cpu_fast", ..., "bf16_wide_rows" (the enumerators' names).
const char* kernel_family_name(KernelFamily f);
// Inverse of kernel_family_name; Error(invalid_argument) listing the names otherwise.
KernelFamily parse_kernel_family(std::string_view name);

struct PlanOptions {
  // Parallel units of the target: 0 = ask the CUDA device (its SM count) or, on the CPU, the
  // number of threads. The partition depends only on the Problem and these options, so equal
  // inputs give equal plans on any machine.
  int sm_count = 0;
  // Tiles the planner runs per unit and wave: 0 = the CUDA kernel's residency (occupancy API;
  // 1 on the CPU). The chunk size then fills whole waves (src/core/plan.cpp).
  int ctas_per_sm = 0;
  int min_chunk_tokens = 64;   // never split a request's context finer than this
  int num_threads = 0;         // CPU backend threads; 0 = std::thread::hardware_concurrency()
  bool cpu_reference = false;  // CPU: run the float64 reference instead of the fast path
  // CUDA, FP8 caches (fp8_e4m3 and the block format), tiles of <= 16 rows, dense and sparse: false
  // (default) computes the scores on fp8 tensor cores straight from the cache bytes, the fastest
  // path (the dispatch table's fp8_tma and fp8_gather rows); Hopper's fp8 accumulator keeps 13
  // mantissa bits, so scores carry ~2e-4 of their magnitude (output ~1e-3 relative at scores
  // ~50). true converts K to fp16 first (exact products, fp32 sums), slower where the cache read
  // bounds the time (docs/design/numerics.md has both paths' errors and costs).
  bool exact_scores = false;
  // Rows (query tokens x heads) a tile packs at most, in [0, kMaxRowsPerTile]. A smaller cap cuts
  // multi-token requests (MTP / speculative verify) into more tiles of fewer query tokens, each
  // reading the request's pages (mostly from L2 when they run side by side), so that their rows
  // run on a kernel family for <= 16 rows. A tile keeps at least one query token, so with more
  // heads than the cap it holds one token of up to 64 heads. 0 = the planner's choice
  // (src/core/dispatch.h, choose_max_tile_rows): 16 where the <= 16-row family computes scores
  // on fp8 tensor cores and the batch is too small to fill the GPU, else 64.
  int max_tile_rows = 0;
  // fp8_e4m3 caches on CUDA: the kpe_scale / ckv_scale ratio run() may pass (KvCacheView).
  // false (default): a power of two (one cache scale, as PagedLatentCache and SGLang's pools
  // keep, gives 1), which the fastest <= 16-row families fold exactly into q_pe; run() checks it
  // and throws invalid_argument naming kv.kpe_scale otherwise. true: any ratio; plan() then
  // chooses families that take any (fp8_exact for <= 16 rows).
  bool any_scale_ratio = false;
  // The kernel family to run: automatic (default) lets the dispatch table choose; another value
  // forces that family, and plan() throws invalid_argument naming options.kernel_family when it
  // cannot serve the problem (format, rows, page size, device, scale ratio, exact scores).
  KernelFamily kernel_family = KernelFamily::automatic;
  // CUDA graphs: device buffers get fixed capacities (max_* below, all > 0), so replan() can
  // rewrite them in place and a captured run() stays valid.
  bool cuda_graph = false;
  int max_batch = 0;
  int max_total_q = 0;
  std::int64_t max_kv_indices = 0;
  // Largest qo_len of any request a graph-mode plan will see (picks the kernel's row block at
  // capture time); 0 = max_total_q.
  int max_qo_len = 0;
};

// One unit of work: a (request, query-token block, head block, kv range) tile. Public so tests
// and tools can inspect the partition; kernels consume the same records.
struct WorkTile {
  std::int32_t request;
  std::int32_t q_begin;     // first query token of the tile, relative to the request
  std::int32_t q_count;     // query tokens in the tile
  std::int32_t head_begin;  // first head
  std::int32_t head_count;  // q_count * head_count <= kMaxRowsPerTile
  std::int32_t kv_begin;    // dense: token range [kv_begin, kv_end) of the request's context;
  std::int32_t kv_end;      // sparse: range of positions in the token's topk list
  std::int32_t split;       // chunk index when the request is split, -1 when it writes `out`
};

namespace detail {
struct PlanState;
}

class Plan {
 public:
  Plan();
  ~Plan();
  Plan(Plan&&) noexcept;
  Plan& operator=(Plan&&) noexcept;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  int batch() const;
  int total_q() const;
  int num_heads() const;
  int topk() const;
  KvFormat kv_format() const;
  DeviceKind device() const;
  std::span<const WorkTile> tiles() const;
  // Splits per request (1 = not split) and the number of partial (o, lse) rows in the workspace.
  std::span<const std::int32_t> num_splits() const;
  std::int64_t partial_rows() const;
  // The kernel family every run() of this plan launches (decided by plan(), kept by replan()),
  // and its name (kernel_family_name).
  KernelFamily kernel_family() const;
  const char* kernel_name() const;

  detail::PlanState& state() const;  // for the backends

 private:
  friend Plan plan(const Problem&, const PlanOptions&);
  std::unique_ptr<detail::PlanState> state_;
};

// Validates `problem` and builds the plan. Errors (all invalid_argument unless noted), each naming
// the argument, index and bound: num_heads outside 1..128; page_size not a power of two in 1..128;
// num_pages outside [1, 2^31 - 1]; q_dtype / out_dtype other than bf16 or f16; sm_scale not finite
// or outside (0, kMaxSmScale]; qo_indptr empty, kv_indptr of the wrong length, either not starting
// at 0 or decreasing; kv_indptr[batch] != kv_indices.size(); kv_indices (or device_kv_indices: also
// its dtype, shape, device, and given with kv_indices) outside the pool; borrowed_kv_indices of
// another dtype or device, not contiguous, shorter than kv_indptr[batch], or given with another
// page table; kv_len < 0 or > pages listed * page_size; causal with qo_len > kv_len (kv_len = 0
// with qo_len > 0 is allowed: those rows get o = 0, lse = -inf); sparse indices outside the pool
// and not -1; topk < 0 or sparse_indices of the wrong size; the bounds of fp8mla/limits.h (total_q
// x num_heads rows, options.sm_count, ctas_per_sm, their product, num_threads, total_q x topk,
// graph capacities); a cuda_graph plan whose problem exceeds max_*; unsupported (code unsupported)
// for DeviceKind::cuda without CUDA; out_of_memory when an allocation fails.
Plan plan(const Problem& problem, const PlanOptions& options = {});

// Graph mode: re-plan `p` (made with cuda_graph = true) for a new batch in place, keeping its
// device buffers, so a CUDA graph that captured run(p, ...) replays on the new batch. Same
// errors as plan(), plus invalid_argument if p is not a graph-mode plan or num_heads, format,
// page size, topk, device, q_dtype, out_dtype or the borrowed page table's buffer (whether one is
// borrowed, and its address: a captured run reads that buffer) differ from the original.
// Synchronous on the host (call it
// outside capture, like FlashInfer's plan). On CUDA it first waits until the device is idle: a
// run of `p` still queued or running, on any stream, reads the buffers it rewrites. A captured
// run() keeps the cache view it was captured with (pointers, strides and, for the TMA kernels,
// tensor maps bounded by that num_pages): the new problem's pages must lie in that pool.
void replan(Plan& p, const Problem& problem);

// Stream-ordered replan() for a CUDA graph-mode plan, as engines plan step N+1 while step N runs:
// the same checks and result, but the plan's device buffers are rewritten by copies enqueued on
// `stream` (a cudaStream_t) from pinned host staging the plan owns, and the host does not wait for
// the device. Every run() of `p` (and any graph that captured one) must be on `stream` or ordered
// after it by the caller. It allocates nothing; the host waits only when the staging slot it
// fills is still being copied from by the replan two calls back (the stream is then two steps
// behind). Page tables: kv_indices (checked on the host) or borrowed_kv_indices (the same buffer
// the plan was made with, read at run time); device_kv_indices is refused (checking it needs a
// host round trip). A CPU plan ignores `stream` and replans as replan(p, problem) does.
void replan(Plan& p, const Problem& problem, void* stream);

struct RunArgs {
  TensorView q_nope;  // bf16 [total_q, H, 512], innermost stride 1
  TensorView q_pe;    // bf16 [total_q, H, 64],  innermost stride 1
  KvCacheView kv;     // format and page size as planned; num_pages as planned
  TensorView out;     // bf16 [total_q, H, 512], written completely (and nothing else)
  TensorView lse;     // optional f32 [total_q, H] (natural log)
  // Sparse only, optional: i32 [total_q, topk] indices that replace the planned ones (DSA
  // picks new ones every layer). They are not validated on the host (that would need a sync):
  // a kernel treats any entry outside [0, num_pages * page_size) like -1.
  TensorView sparse_indices;
  void* stream = nullptr;  // cudaStream_t for CUDA plans
};

// Computes attention for the planned batch with the plan's kernel family. Checks (host side,
// cheap) that every tensor's dtype, shape, innermost stride and device match the plan and the
// cache view ("plan/run mismatch" errors name the tensor and both values), also for a plan of
// no query tokens (its q and out have 0 rows, any strides), that out and lse have no two
// elements at one address, that sm_scale x kv scale x log2(e) is a finite float, and, for an
// fp8_e4m3 CUDA plan made without PlanOptions::any_scale_ratio, that kv.kpe_scale /
// kv.ckv_scale is a power of two (invalid_argument naming kv.kpe_scale).
// Shared plans: run() only reads a plan, so runs of one plan may be called from several threads
// at once. CPU plans: each run keeps its own split-KV workspace, so concurrent runs (into
// different outputs) are safe and give the single-threaded result. CUDA plans: the split-KV
// workspace is the plan's device buffer, so its runs must be ordered on the device: runs on one
// stream are (also from several host threads: a run's launches are not interleaved with
// another's), runs on several streams must be ordered by events (unordered streams are not
// detected: give each stream its own plan). replan() needs the plan to itself (no run in flight
// on any thread).
// CUDA: the kernels are launched as programmatic dependents (PDL) of the kernel before them on
// `stream`, so their launch overlaps its end when it triggers early; they read q, the cache and
// sparse indices, and write, only after waiting for it (griddepcontrol.wait), so stream order holds
// as for plain launches, and they trigger their own dependents only after that wait. The library's
// CUDA calls (plan, replan, run, merge_states, a CUDA cache, context parallelism) select their
// device inside and give the calling thread its current device back on return, unless that device
// has no active context (setting it would create one, ~0.5 GB, on a GPU the process never used;
// torch's device guard makes the same choice).
void run(const Plan& p, const RunArgs& args);

// Combines partial attention states of the same rows (split-KV, context parallelism):
//   v:     f32|bf16 [rows, num_states, D]   partial outputs, each normalised by its own sum
//   s:     f32      [rows, num_states]      their lse (natural log); -inf marks an empty state
//   v_out: f32|bf16 [rows, D]
//   s_out: optional f32 [rows]
// Output per row: weights w_i = exp(s_i - max s), v_out = sum w_i v_i / sum w_i, s_out =
// max s + log(sum w_i). All-empty rows, and rows of num_states = 0, give v_out = 0,
// s_out = -inf (never NaN). Strides are free (a states-major [num_states, rows, D] buffer is
// passed as a permuted view); v_out and s_out may not have two elements at one address. All
// tensors on one device; CUDA runs on `stream`. Bounds (fp8mla/limits.h): rows <= kMaxRows,
// num_states <= kMaxMergeStates, D <= kMaxMergeDim, rows x num_states x D <= kMaxMergeValues.
void merge_states(const TensorView& v, const TensorView& s, const TensorView& v_out,
                  const TensorView& s_out, void* stream = nullptr);

// Library build facts.
bool cuda_available();  // built with CUDA and a device is visible
const char* version();

}  // namespace fp8mla
