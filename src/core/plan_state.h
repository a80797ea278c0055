// Internal: what a Plan holds. Shared by the planner (src/core), the CPU backend (src/cpu) and
// the CUDA backend (src/cuda). Not installed.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "fp8mla/attention.h"

namespace fp8mla::detail {

// Device copies of the plan's arrays and the split-KV workspace (src/cuda/plan_buffers.cu).
struct CudaPlanBuffers;
void destroy_cuda_buffers(CudaPlanBuffers* buffers) noexcept;
struct CudaBuffersDeleter {
  void operator()(CudaPlanBuffers* b) const noexcept { destroy_cuda_buffers(b); }
};

struct PlanState {
  // What was planned (copied from the Problem).
  int num_heads = 0;
  int page_size = 1;
  std::int64_t num_pages = 0;
  KvFormat kv_format = KvFormat::fp8_e4m3;
  DType q_dtype = DType::bf16;    // q_nope / q_pe elements: bf16, or f16 (CPU only)
  DType out_dtype = DType::bf16;  // out elements: bf16, or f16 (CPU only)
  bool causal = true;
  float sm_scale = 0.0f;
  int topk = 0;
  DeviceKind device = DeviceKind::cpu;
  int device_id = 0;
  PlanOptions options;
  int sm_count = 0;     // resolved target width used by the partition
  int ctas_per_sm = 1;  // resolved tiles in flight per unit (options.ctas_per_sm or the kernel's)
  // Rows of the largest tile the kernel family is chosen for (graph: any within max_*).
  int kernel_rows = 1;
  int arch = 0;  // compute capability of the CUDA device (10 * major + minor); 0 on the CPU
  // The kernel family every run() launches: src/core/dispatch.h's choice, made once by plan().
  KernelFamily family = KernelFamily::cpu_fast;

  int batch = 0;
  int total_q = 0;
  std::vector<std::int32_t> qo_indptr;   // [batch + 1]
  std::vector<std::int32_t> kv_indptr;   // [batch + 1]
  std::vector<std::int32_t> kv_indices;  // [kv_indptr[batch]]; empty when borrowed
  // Problem::borrowed_kv_indices (the caller's buffer, read by every run()); undefined when the
  // plan copied its page table into kv_indices (and the device buffers).
  TensorView borrowed_kv_indices;
  std::vector<std::int32_t> kv_len;          // [batch]
  std::vector<std::int32_t> causal_len;      // [batch] or empty (Problem::causal_len)
  std::vector<std::int32_t> sparse_indices;  // [total_q * topk] (sparse only)

  // The partition. Tiles of one request are contiguous in `tiles`, in split order.
  std::vector<WorkTile> tiles;
  // Per request: number of kv splits (1 = tiles write `out` directly, split = -1) and, when
  // split, the first row of its partial block. Partial row of (split s, query token t, head h)
  // of request r = partial_offset[r] + (s * qo_len_r + t) * num_heads + h.
  std::vector<std::int32_t> num_splits;      // [batch]
  std::vector<std::int64_t> partial_offset;  // [batch]
  std::int64_t partial_rows = 0;
  std::int64_t longest_tile = 0;  // the most kv tokens a tile holds (DispatchKey::tiles)

  // Sizes the device buffers must hold (src/core/plan.cpp derives them). Graph mode: bounds for
  // any problem within options.max_* (so replan() never reallocates); the index arrays' bounds
  // are options.max_batch + 1, max_kv_indices and max_total_q * topk. Otherwise: the actual
  // tiles.size() and partial_rows.
  std::int64_t tile_capacity = 0;
  std::int64_t partial_rows_capacity = 0;

  // Held by run() across a CUDA run's launches (decode, then the split merge, both using the
  // workspace), so runs of one plan from several host threads on one stream do not interleave.
  std::unique_ptr<std::mutex> launch_mutex = std::make_unique<std::mutex>();

  // CUDA state (device copies + workspace); null for CPU plans.
  std::unique_ptr<CudaPlanBuffers, CudaBuffersDeleter> cuda;
  // plan() / replan() only, while cuda_upload_plan runs: the caller's page table on the device
  // (Problem::device_kv_indices), copied instead of kv_indices (then empty).
  TensorView device_kv_indices;
};

// The page table run() reads: the borrowed buffer, or the plan's own copy (host memory for CPU
// plans; CUDA plans read CudaPlanBuffers::kv_indices or the borrowed device buffer).
inline const std::int32_t* host_page_table(const PlanState& s) {
  return s.borrowed_kv_indices.defined()
             ? static_cast<const std::int32_t*>(s.borrowed_kv_indices.data)
             : s.kv_indices.data();
}

// The length request r's causal mask counts from: query token i sees tokens
// [0, causal_mask_len(s, r) - qo_len + i] of the kv_len[r] listed (Problem::causal_len).
inline std::int64_t causal_mask_len(const PlanState& s, int r) {
  return s.causal_len.empty() ? s.kv_len[r] : s.causal_len[r];
}

}  // namespace fp8mla::detail
