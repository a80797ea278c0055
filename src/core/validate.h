// Internal: validation of a Problem and its PlanOptions, shared by plan(), replan() and
// shard_context(). Every value the planner later indexes with is checked here, in 64-bit
// arithmetic, together with the bounds of include/fp8mla/limits.h.
#pragma once

#include <cstdint>

#include "fp8mla/attention.h"

namespace fp8mla::detail {

// Graph mode: the longest request the captured kernels are built for (max_qo_len, or
// max_total_q when it is 0).
inline std::int64_t graph_max_qo_len(const PlanOptions& o) {
  return o.max_qo_len > 0 ? o.max_qo_len : o.max_total_q;
}

// The options' ranges (sm_count, ctas_per_sm, num_threads, max_tile_rows, graph capacities).
void validate_options(const PlanOptions& o);

// num_heads, page_size, num_pages, formats, dtypes, sm_scale, topk, device.
void validate_scalars(const Problem& p);

// The index arrays: qo_indptr (batch + 1 >= 1 entries from 0, non-decreasing, rows within
// kMaxRows), kv_indptr (from 0, non-decreasing, ending at kv_indices.size()), kv_len (>= 0,
// within the pages listed), causal qo_len <= kv_len, causal_len, sparse_indices, and a graph
// plan's capacities. `page_ids`: also check that every kv_indices entry is a page of the pool
// (shard_context() skips it: the full table may name other ranks' pages).
void validate_arrays(const Problem& p, const PlanOptions& o, bool page_ids = true);

// The ids of a page table on the device (Problem::device_kv_indices), checked there: call it
// last, once the host-side checks have passed (a kernel and a small copy back).
void validate_device_page_ids(const Problem& p);

// The resolved parallel width of a plan: sm_count x ctas_per_sm <= kMaxWaveTiles.
void validate_wave(std::int64_t sm_count, std::int64_t ctas_per_sm);

}  // namespace fp8mla::detail
