// CUDA runtime glue: device queries, memory, and the device copy of a plan.
#include <cuda.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/cuda/cuda_util.cuh"
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
  for (void* p : {static_cast<void*>(b->tiles), static_cast<void*>(b->counts),
                  static_cast<void*>(b->qo_indptr), static_cast<void*>(b->num_splits),
                  static_cast<void*>(b->partial_offset), static_cast<void*>(b->kv_indices),
                  static_cast<void*>(b->sparse), static_cast<void*>(b->merge),
                  static_cast<void*>(b->partial_o), static_cast<void*>(b->partial_lse)}) {
    cuda_free(p);
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

}  // namespace

void cuda_upload_plan(PlanState& plan) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(plan.device_id));
  const PlanOptions& o = plan.options;
  std::vector<MergeItem> merge;
  for (int r = 0; r < plan.batch; ++r) {
    if (plan.num_splits[r] <= 1) continue;
    const int rows = (plan.qo_indptr[r + 1] - plan.qo_indptr[r]) * plan.num_heads;
    for (int row = 0; row < rows; ++row) merge.push_back({r, row});
  }
  int max_rows = 1;
  for (const WorkTile& t : plan.tiles) max_rows = std::max(max_rows, t.q_count * t.head_count);

  if (!plan.cuda) {
    auto b = std::unique_ptr<CudaPlanBuffers, CudaBuffersDeleter>(new CudaPlanBuffers);
    b->device_id = plan.device_id;
    b->graph = o.cuda_graph;
    if (o.cuda_graph) {
      // The planner's bounds for any problem within max_* (derived in plan.cpp).
      b->cap_batch = o.max_batch;
      b->cap_tiles = plan.tile_capacity;
      b->cap_kv_indices = o.max_kv_indices;
      b->cap_sparse = static_cast<std::int64_t>(o.max_total_q) * std::max(plan.topk, 0);
      b->cap_partial_rows = plan.partial_rows_capacity;
      b->cap_merge = static_cast<std::int64_t>(o.max_total_q) * plan.num_heads;
    } else {
      b->cap_batch = plan.batch;
      b->cap_tiles = static_cast<std::int64_t>(plan.tiles.size());
      b->cap_kv_indices = plan.kv_indptr.empty() ? 0 : plan.kv_indptr.back();
      b->cap_sparse = static_cast<std::int64_t>(plan.sparse_indices.size());
      b->cap_partial_rows = plan.partial_rows;
      b->cap_merge = static_cast<std::int64_t>(merge.size());
    }
    // The planner's bound (kernel_rows, the one its residency came from) covers every tile.
    b->row_tiles = row_tiles_for(std::max(plan.kernel_rows, max_rows));
    b->tiles = alloc<DeviceTile>(b->cap_tiles, b->device_id);
    b->counts = alloc<std::int32_t>(2, b->device_id);
    b->qo_indptr = alloc<std::int32_t>(b->cap_batch + 1, b->device_id);
    b->num_splits = alloc<std::int32_t>(b->cap_batch, b->device_id);
    b->partial_offset = alloc<std::int64_t>(b->cap_batch, b->device_id);
    b->kv_indices = alloc<std::int32_t>(b->cap_kv_indices, b->device_id);
    b->sparse = alloc<std::int32_t>(b->cap_sparse, b->device_id);
    b->merge = alloc<MergeItem>(b->cap_merge, b->device_id);
    b->partial_o = alloc<float>(b->cap_partial_rows * kDimCkv, b->device_id);
    b->partial_lse = alloc<float>(b->cap_partial_rows, b->device_id);
    plan.cuda = std::move(b);
  } else {
    // replan(): a run of this plan may still be in flight on any stream (also one that does not
    // wait for the legacy stream, which the copies below take), reading the tiles and page
    // table they rewrite. Wait for the device first, as a serving step's replan waits for the
    // step before it.
    FP8MLA_CUDA_CHECK(cudaDeviceSynchronize());
  }
  CudaPlanBuffers& b = *plan.cuda;
  if (row_tiles_for(max_rows) > b.row_tiles) {
    throw Error(ErrorCode::invalid_argument, "problem.qo_indptr",
                msg("tiles of ", max_rows, " rows exceed the ", 16 * b.row_tiles,
                    " rows the graph-mode plan was made for (raise options.max_qo_len)"));
  }
  if (plan.partial_rows > b.cap_partial_rows) {
    throw Error(
        ErrorCode::invalid_argument, "problem",
        msg(plan.partial_rows, " split-KV partial rows exceed the capacity ", b.cap_partial_rows));
  }
  std::vector<DeviceTile> tiles;
  tiles.reserve(plan.tiles.size());
  const bool sparse = plan.topk > 0;
  for (const WorkTile& t : plan.tiles) {
    const int r = t.request;
    // The kernels read DeviceTile::kv_len for the causal mask only (kv_end bounds the tokens).
    tiles.push_back({t, plan.qo_indptr[r] + t.q_begin, plan.qo_indptr[r + 1] - plan.qo_indptr[r],
                     sparse ? 0 : static_cast<std::int32_t>(causal_mask_len(plan, r)),
                     sparse ? 0 : plan.kv_indptr[r], plan.partial_offset[r]});
  }
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
  b.num_tiles = static_cast<std::int32_t>(plan.tiles.size());
  b.num_merge = static_cast<std::int32_t>(merge.size());
  b.max_splits = plan.num_splits.empty()
                     ? 1
                     : *std::max_element(plan.num_splits.begin(), plan.num_splits.end());
  const std::vector<std::int32_t> counts = {b.num_tiles, b.num_merge};
  upload(b.counts, counts, 2, "counts");
  // cudaMemcpy from pageable memory (and the device-to-device copy) may return before the DMA
  // lands; run() may be on a stream that does not wait for the legacy one, so wait here.
  FP8MLA_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

}  // namespace fp8mla::detail
