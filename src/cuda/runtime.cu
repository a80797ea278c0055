// CUDA runtime glue: device queries, memory, and the device copy of a plan.
#include <cuda.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/cuda/cuda_check.h"
#include "src/cuda/merge/split_merge.h"
#include "src/cuda/plan_buffers.h"

namespace fp8mla::detail {

bool cuda_built() noexcept {
  return true;
}

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: clear the sticky error, report none
    return 0;
  }
  return n;
}

std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  if (e == cudaSuccess && n > 0) return {};
  if (e == cudaSuccess || e == cudaErrorNoDevice) return "the NVIDIA driver sees no CUDA device";
  const std::string runtime =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  if (e == cudaErrorInsufficientDriver)
    return "no NVIDIA driver is loaded, or it is older than this build's CUDA " + runtime +
           " runtime needs (nvidia-smi shows the driver and the CUDA version it supports)";
  return std::string("the CUDA runtime cannot use a device (") + cudaGetErrorName(e) + ": " +
         cudaGetErrorString(e) + ")";
}

namespace {
void require_visible(int device_id) {
  require(device_id >= 0 && device_id < cuda_device_count(), "device_id", device_id,
          " is not a visible CUDA device (", cuda_device_count(), " visible)");
}
}  // namespace

int cuda_sm_count(int device_id) {
  require_visible(device_id);
  int sms = 0;
  FP8MLA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_id));
  return sms;
}

int cuda_compute_capability(int device_id) {
  require_visible(device_id);
  int major = 0, minor = 0;
  FP8MLA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id));
  FP8MLA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_id));
  return 10 * major + minor;
}

void* cuda_malloc(std::size_t bytes, int device_id) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(device_id));
  void* p = nullptr;
  FP8MLA_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)));
  FP8MLA_CUDA_CHECK(cudaMemset(p, 0, std::max<std::size_t>(bytes, 16)));
  return p;
}

void cuda_free(void* ptr) noexcept {
  if (ptr != nullptr) (void)cudaFree(ptr);
}

void cuda_copy_to_host(void* dst, const void* src, std::size_t bytes) {
  FP8MLA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void cuda_copy_to_device(void* dst, const void* src, std::size_t bytes) {
  FP8MLA_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void cuda_synchronize(int device_id) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(device_id));
  FP8MLA_CUDA_CHECK(cudaDeviceSynchronize());
}

void cuda_set_device(int device_id) {
  require_visible(device_id);
  FP8MLA_CUDA_CHECK(cudaSetDevice(device_id));
}

int cuda_current_device() noexcept {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();  // ours: no device
    return -1;
  }
  return d;
}

void cuda_restore_device(int device_id) noexcept {
  int now = -1;
  if (device_id < 0 || cudaGetDevice(&now) != cudaSuccess || now == device_id) return;
  // The driver's primary-context query, found once through the runtime (no -lcuda).
  using GetDevice = CUresult (*)(CUdevice*, int);
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  static const auto [get_device, get_state] = [] {
    void* d = nullptr;
    void* s = nullptr;
    cudaDriverEntryPointQueryResult qd{}, qs{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &d, 12000, cudaEnableDefault, &qd) !=
            cudaSuccess ||
        cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &s, 12000, cudaEnableDefault,
                                         &qs) != cudaSuccess ||
        qd != cudaDriverEntryPointSuccess || qs != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      d = s = nullptr;
    }
    return std::pair{reinterpret_cast<GetDevice>(d), reinterpret_cast<GetState>(s)};
  }();
  CUdevice dev{};
  unsigned int flags = 0;
  int active = 0;
  if (get_device == nullptr || get_device(&dev, device_id) != CUDA_SUCCESS ||
      get_state(dev, &flags, &active) != CUDA_SUCCESS || active == 0)
    return;
  if (cudaSetDevice(device_id) != cudaSuccess) (void)cudaGetLastError();
}

namespace {
// Lowest index i with pages[i] outside [0, num_pages) into *first (left at ~0 when none).
__global__ void first_page_outside_kernel(const std::int32_t* pages, std::int64_t n,
                                          std::int64_t num_pages, unsigned long long* first) {
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int32_t page = pages[i];
    if (page < 0 || page >= num_pages) atomicMin(first, static_cast<unsigned long long>(i));
  }
}
}  // namespace

PageOutside cuda_find_page_outside(const TensorView& pages, std::int64_t num_pages) {
  cuda_set_device(pages.device_id);
  const std::int64_t n = pages.shape[0];
  const DeviceMemory word(sizeof(unsigned long long), pages.device_id);
  auto* first = word.as<unsigned long long>();
  PageOutside found{-1, 0};
  FP8MLA_CUDA_CHECK(cudaMemset(first, 0xff, sizeof(unsigned long long)));
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 1024));
  first_page_outside_kernel<<<blocks, 256>>>(static_cast<const std::int32_t*>(pages.data), n,
                                             num_pages, first);
  FP8MLA_CUDA_CHECK_LAUNCH("first_page_outside_kernel");
  unsigned long long index = 0;
  FP8MLA_CUDA_CHECK(cudaMemcpy(&index, first, sizeof index, cudaMemcpyDeviceToHost));
  if (index != ~0ull) {
    found.index = static_cast<std::int64_t>(index);
    FP8MLA_CUDA_CHECK(cudaMemcpy(&found.page, static_cast<const std::int32_t*>(pages.data) + index,
                                 sizeof found.page, cudaMemcpyDeviceToHost));
  }
  return found;
}

void destroy_cuda_buffers(CudaPlanBuffers* b) noexcept {
  if (b == nullptr) return;
  for (void* p : {static_cast<void*>(b->arena), static_cast<void*>(b->partial_o),
                  static_cast<void*>(b->partial_lse)}) {
    cuda_free(p);
  }
  for (int slot = 0; slot < 2; ++slot) {
    // A stream-ordered replan's copies may still read the slot: let them finish first.
    if (b->staged[slot] != nullptr) {
      (void)cudaEventSynchronize(b->staged[slot]);
      (void)cudaEventDestroy(b->staged[slot]);
    }
    if (b->staging[slot] != nullptr) (void)cudaFreeHost(b->staging[slot]);
  }
  delete b;
}

namespace {

template <class T>
T* alloc(std::int64_t n, int device_id) {
  return static_cast<T*>(
      cuda_malloc(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(T), device_id));
}

void require_fits(std::int64_t entries, std::int64_t cap, const char* what) {
  if (entries > cap) {
    throw Error(ErrorCode::invalid_argument, what,
                msg(entries, " entries exceed the graph-mode capacity ", cap,
                    " fixed when the plan was made"));
  }
}

template <class T>
void upload(T* dst, const std::vector<T>& src, std::int64_t cap, const char* what) {
  require_fits(static_cast<std::int64_t>(src.size()), cap, what);
  if (!src.empty()) cuda_copy_to_device(dst, src.data(), src.size() * sizeof(T));
}

// The sizes of what a plan's device buffers hold, counted on the host from the PlanState before
// anything is written (a graph-mode replan checks them against its capacities first, then writes
// the arrays straight into its staging slot).
struct HostSizes {
  std::int64_t tiles = 0;
  std::int64_t merge = 0;              // rows of split requests: every row of each
  std::int32_t counts[3] = {0, 0, 0};  // tiles, merge rows, the graph merge's form
  std::int32_t max_splits = 1;         // the most splits of any request
  int max_rows = 1;                    // the most rows of any tile
};

HostSizes host_sizes(const PlanState& plan) {
  HostSizes z;
  z.tiles = static_cast<std::int64_t>(plan.tiles.size());
  for (int r = 0; r < plan.batch; ++r) {
    z.max_splits = std::max(z.max_splits, plan.num_splits[r]);
    if (plan.num_splits[r] > 1) {
      z.merge +=
          static_cast<std::int64_t>(plan.qo_indptr[r + 1] - plan.qo_indptr[r]) * plan.num_heads;
    }
  }
  for (const WorkTile& t : plan.tiles) z.max_rows = std::max(z.max_rows, t.q_count * t.head_count);
  // counts: tiles, merge rows, and the graph merge's form (split_merge_graph_kernel).
  z.counts[0] = static_cast<std::int32_t>(z.tiles);
  z.counts[1] = static_cast<std::int32_t>(z.merge);
  z.counts[2] = z.max_splits > kGraphWholeRowMaxSplits ? 1 : 0;
  return z;
}

// The kernels' tile records, [plan.tiles.size()] at `out`.
void write_tiles(const PlanState& plan, DeviceTile* out) {
  const bool sparse = plan.topk > 0;
  for (const WorkTile& t : plan.tiles) {
    const int r = t.request;
    // The kernels read DeviceTile::kv_len for the causal mask only (kv_end bounds the tokens).
    *out++ = {t,
              plan.qo_indptr[r] + t.q_begin,
              plan.qo_indptr[r + 1] - plan.qo_indptr[r],
              sparse ? 0 : static_cast<std::int32_t>(causal_mask_len(plan, r)),
              sparse ? 0 : plan.kv_indptr[r],
              plan.partial_offset[r]};
  }
}

// The merge rows, [HostSizes::merge] at `out`: (request, row) for every row of a split request.
void write_merge(const PlanState& plan, MergeItem* out) {
  for (int r = 0; r < plan.batch; ++r) {
    if (plan.num_splits[r] <= 1) continue;
    const int rows = (plan.qo_indptr[r + 1] - plan.qo_indptr[r]) * plan.num_heads;
    for (int row = 0; row < rows; ++row) *out++ = {r, row};
  }
}

// The new problem within what the buffers (and a captured kernel) were made for.
void require_fits_buffers(const PlanState& plan, const CudaPlanBuffers& b, const HostSizes& z) {
  if (row_tiles_for(z.max_rows) > b.row_tiles) {
    throw Error(ErrorCode::invalid_argument, "problem.qo_indptr",
                msg("tiles of ", z.max_rows, " rows exceed the ", 16 * b.row_tiles,
                    " rows the graph-mode plan was made for (raise options.max_qo_len)"));
  }
  if (plan.partial_rows > b.cap_partial_rows) {
    throw Error(
        ErrorCode::invalid_argument, "problem",
        msg(plan.partial_rows, " split-KV partial rows exceed the capacity ", b.cap_partial_rows));
  }
  require_fits(z.tiles, b.cap_tiles, "tiles");
  require_fits(static_cast<std::int64_t>(plan.qo_indptr.size()), b.cap_batch + 1, "qo_indptr");
  require_fits(static_cast<std::int64_t>(plan.kv_indices.size()), b.cap_kv_indices, "kv_indices");
  require_fits(static_cast<std::int64_t>(plan.sparse_indices.size()), b.cap_sparse,
               "sparse_indices");
  require_fits(z.merge, b.cap_merge, "merge rows");
}

// Host-side facts run() reads (grid sizes, the merge layout) after an upload.
void set_live_sizes(CudaPlanBuffers& b, const HostSizes& z) {
  b.num_tiles = z.counts[0];
  b.num_merge = z.counts[1];
  b.max_splits = z.max_splits;
}

// Byte offsets of the plan's arrays in its arena (and in each staging slot, laid out alike):
// the small per-request arrays first, then the tiles and the merge rows, so a replan's first copy
// covers them up to the live merge rows; the sparse lists and page table after, each copied live.
// The page table is last, so a plan that borrows its page table stages up to kv_indices only.
// Each array starts on a 64-byte boundary.
struct ArenaLayout {
  std::size_t counts = 0, qo_indptr = 0, num_splits = 0, partial_offset = 0, tiles = 0, merge = 0,
              sparse = 0, kv_indices = 0, bytes = 0;
};

ArenaLayout arena_layout(const CudaPlanBuffers& b) {
  ArenaLayout l;
  std::size_t at = 0;
  auto place = [&](std::int64_t n, std::size_t element) {
    const std::size_t offset = at;
    at += (static_cast<std::size_t>(std::max<std::int64_t>(n, 0)) * element + 63) / 64 * 64;
    return offset;
  };
  l.counts = place(3, sizeof(std::int32_t));
  l.qo_indptr = place(b.cap_batch + 1, sizeof(std::int32_t));
  l.num_splits = place(b.cap_batch, sizeof(std::int32_t));
  l.partial_offset = place(b.cap_batch, sizeof(std::int64_t));
  l.tiles = place(b.cap_tiles, sizeof(DeviceTile));
  l.merge = place(b.cap_merge, sizeof(MergeItem));
  l.sparse = place(b.cap_sparse, sizeof(std::int32_t));
  l.kv_indices = place(b.cap_kv_indices, sizeof(std::int32_t));
  l.bytes = std::max<std::size_t>(at, 64);
  return l;
}

// The arena and the arrays in it (cuda_malloc zero-fills it).
void allocate_arena(CudaPlanBuffers& b) {
  const ArenaLayout l = arena_layout(b);
  b.arena = static_cast<std::uint8_t*>(cuda_malloc(l.bytes, b.device_id));
  b.counts = reinterpret_cast<std::int32_t*>(b.arena + l.counts);
  b.qo_indptr = reinterpret_cast<std::int32_t*>(b.arena + l.qo_indptr);
  b.num_splits = reinterpret_cast<std::int32_t*>(b.arena + l.num_splits);
  b.partial_offset = reinterpret_cast<std::int64_t*>(b.arena + l.partial_offset);
  b.tiles = reinterpret_cast<DeviceTile*>(b.arena + l.tiles);
  b.merge = reinterpret_cast<MergeItem*>(b.arena + l.merge);
  b.sparse = reinterpret_cast<std::int32_t*>(b.arena + l.sparse);
  b.kv_indices = reinterpret_cast<std::int32_t*>(b.arena + l.kv_indices);
}

// Graph mode: the pinned staging slots and their events (made once, with the buffers).
void allocate_staging(CudaPlanBuffers& b, bool borrowed_pages) {
  b.staging_pages = !borrowed_pages;
  const ArenaLayout l = arena_layout(b);
  b.staging_bytes = std::max<std::size_t>(b.staging_pages ? l.bytes : l.kv_indices, 64);
  for (int slot = 0; slot < 2; ++slot) {
    void* host = nullptr;
    FP8MLA_CUDA_CHECK(cudaMallocHost(&host, b.staging_bytes));
    // A replan copies the capacities' slack between live arrays too: zeros, not junk.
    std::memset(host, 0, b.staging_bytes);
    b.staging[slot] = static_cast<std::uint8_t*>(host);
    FP8MLA_CUDA_CHECK(cudaEventCreateWithFlags(&b.staged[slot], cudaEventDisableTiming));
  }
}

}  // namespace

void cuda_upload_plan(PlanState& plan) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(plan.device_id));
  const PlanOptions& o = plan.options;
  const HostSizes z = host_sizes(plan);
  const bool borrowed = plan.borrowed_kv_indices.defined();

  if (!plan.cuda) {
    auto b = std::unique_ptr<CudaPlanBuffers, CudaBuffersDeleter>(new CudaPlanBuffers);
    b->device_id = plan.device_id;
    b->graph = o.cuda_graph;
    if (o.cuda_graph) {
      // The planner's bounds for any problem within max_* (derived in plan.cpp).
      b->cap_batch = o.max_batch;
      b->cap_tiles = plan.tile_capacity;
      b->cap_kv_indices = borrowed ? 0 : o.max_kv_indices;
      b->cap_sparse = static_cast<std::int64_t>(o.max_total_q) * std::max(plan.topk, 0);
      b->cap_partial_rows = plan.partial_rows_capacity;
      b->cap_merge = static_cast<std::int64_t>(o.max_total_q) * plan.num_heads;
    } else {
      b->cap_batch = plan.batch;
      b->cap_tiles = static_cast<std::int64_t>(plan.tiles.size());
      b->cap_kv_indices = borrowed || plan.kv_indptr.empty() ? 0 : plan.kv_indptr.back();
      b->cap_sparse = static_cast<std::int64_t>(plan.sparse_indices.size());
      b->cap_partial_rows = plan.partial_rows;
      b->cap_merge = z.merge;
    }
    // The planner's bound (kernel_rows, the one its residency came from) covers every tile.
    b->row_tiles = row_tiles_for(std::max(plan.kernel_rows, z.max_rows));
    allocate_arena(*b);
    b->partial_o = alloc<float>(b->cap_partial_rows * kDimCkv, b->device_id);
    b->partial_lse = alloc<float>(b->cap_partial_rows, b->device_id);
    if (o.cuda_graph) allocate_staging(*b, borrowed);
    plan.cuda = std::move(b);
  } else {
    // replan(): a run of this plan may still be in flight on any stream (also one that does not
    // wait for the legacy stream, which the copies below take), reading the tiles and page
    // table they rewrite. Wait for the device first, as a serving step's replan waits for the
    // step before it.
    FP8MLA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  CudaPlanBuffers& b = *plan.cuda;
  require_fits_buffers(plan, b, z);
  std::vector<DeviceTile> tiles(static_cast<std::size_t>(z.tiles));
  write_tiles(plan, tiles.data());
  std::vector<MergeItem> merge(static_cast<std::size_t>(z.merge));
  write_merge(plan, merge.data());
  upload(b.tiles, tiles, b.cap_tiles, "tiles");
  upload(b.qo_indptr, plan.qo_indptr, b.cap_batch + 1, "qo_indptr");
  upload(b.num_splits, plan.num_splits, b.cap_batch, "num_splits");
  upload(b.partial_offset, plan.partial_offset, b.cap_batch, "partial_offset");
  if (plan.device_kv_indices.defined()) {  // the caller's table on the device: copied there
    const std::int64_t n = plan.device_kv_indices.shape[0];
    require_fits(n, b.cap_kv_indices, "device_kv_indices");
    FP8MLA_CUDA_CHECK(cudaMemcpyAsync(b.kv_indices, plan.device_kv_indices.data,
                                      static_cast<std::size_t>(n) * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToDevice, cudaStreamLegacy));
  } else {
    upload(b.kv_indices, plan.kv_indices, b.cap_kv_indices, "kv_indices");
  }
  upload(b.sparse, plan.sparse_indices, b.cap_sparse, "sparse_indices");
  upload(b.merge, merge, b.cap_merge, "merge rows");
  cuda_copy_to_device(b.counts, z.counts, sizeof z.counts);
  set_live_sizes(b, z);
  // cudaMemcpy from pageable memory (and the device-to-device copy) may return before the DMA
  // lands; run() may be on a stream that does not wait for the legacy one, so wait here.
  FP8MLA_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void cuda_upload_plan_async(PlanState& plan, void* stream) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(plan.device_id));
  if (!plan.cuda || !plan.cuda->graph || plan.cuda->staging[0] == nullptr) {
    throw Error(ErrorCode::internal, "plan",
                "the stream-ordered replan needs a graph-mode plan's staging buffers");
  }
  CudaPlanBuffers& b = *plan.cuda;
  const HostSizes z = host_sizes(plan);
  require_fits_buffers(plan, b, z);
  if (b.staging_pages == plan.borrowed_kv_indices.defined()) {
    throw Error(ErrorCode::internal, "plan", "the page table's source changed since plan()");
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const int slot = b.next_slot;
  // The copies of the replan two calls back read this slot; usually they finished long ago.
  if (b.staged_pending[slot]) FP8MLA_CUDA_CHECK(cudaEventSynchronize(b.staged[slot]));
  b.staged_pending[slot] = false;
  std::uint8_t* base = b.staging[slot];
  const ArenaLayout l = arena_layout(b);
  auto bytes_of = [](const auto& v) { return v.size() * sizeof(v[0]); };
  auto fill = [&](std::size_t offset, const auto& v) {  // into the slot, as the arena lays it out
    if (!v.empty()) std::memcpy(base + offset, v.data(), bytes_of(v));
  };
  auto copy = [&](std::size_t offset, std::size_t bytes) {  // slot -> arena, stream-ordered
    if (bytes == 0) return;
    FP8MLA_CUDA_CHECK(cudaMemcpyAsync(b.arena + offset, base + offset, bytes,
                                      cudaMemcpyHostToDevice, s));
  };
  // The tiles and merge rows are written straight into the slot (their counts are within the
  // capacities: checked above). One copy for counts ... partial_offset, the live tiles and the live
  // merge rows (the capacities' slack between them carries stale slot bytes, which no kernel
  // reads: each reads below the live sizes), then the live sparse lists and page table: one to
  // three copies a replan. Each cudaMemcpyAsync costs ~2-3 us of host time, more than the slack's
  // bytes cost the copy engine.
  std::memcpy(base + l.counts, z.counts, sizeof z.counts);
  fill(l.qo_indptr, plan.qo_indptr);
  fill(l.num_splits, plan.num_splits);
  fill(l.partial_offset, plan.partial_offset);
  write_tiles(plan, reinterpret_cast<DeviceTile*>(base + l.tiles));
  write_merge(plan, reinterpret_cast<MergeItem*>(base + l.merge));
  copy(0, z.merge > 0 ? l.merge + static_cast<std::size_t>(z.merge) * sizeof(MergeItem)
                      : l.tiles + static_cast<std::size_t>(z.tiles) * sizeof(DeviceTile));
  fill(l.sparse, plan.sparse_indices);
  copy(l.sparse, bytes_of(plan.sparse_indices));
  if (b.staging_pages) {
    fill(l.kv_indices, plan.kv_indices);
    copy(l.kv_indices, bytes_of(plan.kv_indices));
  }
  FP8MLA_CUDA_CHECK(cudaEventRecord(b.staged[slot], s));
  b.staged_pending[slot] = true;
  b.next_slot = 1 - slot;
  set_live_sizes(b, z);
}

}  // namespace fp8mla::detail
