// Internal: the device side of a CUDA plan (allocated by cuda_upload_plan in runtime.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "src/cuda/decode_params.h"

namespace fp8mla::detail {

struct CudaPlanBuffers {
  int device_id = 0;
  bool graph = false;
  // Capacities (elements) of the arrays below; fixed for a graph-mode plan.
  std::int64_t cap_tiles = 0, cap_batch = 0, cap_kv_indices = 0, cap_sparse = 0;
  std::int64_t cap_partial_rows = 0, cap_merge = 0;
  int row_tiles = 1;  // 16-row m-tiles of the kernel instantiation (1, 2 or 4)
  // Live sizes (host copies of counts[0], counts[1]).
  std::int32_t num_tiles = 0, num_merge = 0;
  std::int32_t max_splits = 1;  // most splits of any request (picks the merge layout)

  // counts ... kv_indices lie in one allocation, `arena`, as arena_layout (runtime.cu) places them,
  // so a stream-ordered replan copies the small arrays and the live tiles in one copy.
  std::uint8_t* arena = nullptr;
  DeviceTile* tiles = nullptr;             // [cap_tiles]
  std::int32_t* counts = nullptr;          // [3]: num_tiles, num_merge items, merge form
  std::int32_t* qo_indptr = nullptr;       // [cap_batch + 1]
  std::int32_t* num_splits = nullptr;      // [cap_batch]
  std::int64_t* partial_offset = nullptr;  // [cap_batch]
  std::int32_t* kv_indices = nullptr;      // [cap_kv_indices]
  std::int32_t* sparse = nullptr;          // [cap_sparse]
  MergeItem* merge = nullptr;              // [cap_merge]
  float* partial_o = nullptr;              // [cap_partial_rows, 512]
  float* partial_lse = nullptr;            // [cap_partial_rows]

  // Graph mode: pinned host staging for the stream-ordered replan (cuda_upload_plan_async), two
  // slots laid out as the arena, of staging_bytes each, used in turn; staged[i] is recorded on
  // the stream after slot i's copies, and a replan waits for it only before refilling that slot.
  std::uint8_t* staging[2] = {nullptr, nullptr};
  cudaEvent_t staged[2] = {nullptr, nullptr};
  bool staged_pending[2] = {false, false};
  int next_slot = 0;
  std::size_t staging_bytes = 0;
  bool staging_pages = false;  // the slots hold a page table (false when the plan borrows one)
};

// 16-row m-tiles of the kernel that runs tiles of up to `rows` rows.
inline int row_tiles_for(int rows) {
  return rows <= 16 ? 1 : rows <= 32 ? 2 : 4;
}

}  // namespace fp8mla::detail
