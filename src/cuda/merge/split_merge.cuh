// The split-KV merge: the partial (o, lse) rows of a split request's tiles into its output rows.
// Launched by run() as a programmatic dependent of the decode grid (launch_split_merge).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "src/cuda/decode_params.h"
#include "src/cuda/merge/nan_max.cuh"
#include "src/cuda/ops/epilogue.cuh"
#include "src/cuda/ops/sync.cuh"

namespace fp8mla::detail::merge {

constexpr int kMergeThreads = 256;
// Columns of the graph-mode merge's second form's units (split_merge_graph_kernel): 64 (8 units a
// row, 16 groups across the splits) ran 1.0-1.15x faster than 32 over 3-128 requests x 16 heads
// on an H100, with the grid at what the SMs hold.
constexpr int kGraphCols = 64;

// Which unit: the block's own (item blockIdx.x, columns blockIdx.y: read where used, so no
// register holds them), or one of the graph kernel's loop.
struct BlockUnit {
  __device__ int item() const { return static_cast<int>(blockIdx.x); }
  __device__ int col_block() const { return static_cast<int>(blockIdx.y); }
};
struct LoopUnit {
  int item_, col_block_;
  __device__ int item() const { return item_; }
  __device__ int col_block() const { return col_block_; }
};

// Combines the split partials of one output row (merge item unit.item()) in its kCols columns
// from unit.col_block() x kCols, with the shared arrays red [8], part [256] ([group][quad]) and
// wpart [groups]. Threads spread over splits as well as columns, so a long request's many splits
// are read with many loads in flight (one warp per row looping over hundreds of splits is
// latency bound). Few splits take whole rows per unit (kCols = 512): 16 units per row cost more
// than they save. (The arrays are the callers' own __shared__ arrays: gathered in one struct,
// they cost the one-unit kernels 4-6 registers.)
// kAhead > 0: a row of at most kAhead splits a thread group loads every lse and partial o at
// once, before the row max, so the merge waits for one L2 round trip after the decode grid
// instead of two (a batch of one request feels it); the same sums in the same order. It holds
// 5 kAhead registers more (40 against 32), so the launcher takes it only for merges of one wave.
template <int kCols, int kAhead, class Unit>
__device__ __forceinline__ void merge_unit(const MergeParams& p, Unit unit, float* red,
                                           float4* part, float* wpart) {
  constexpr int kMergeQuads = kCols / 4;                     // threads across the columns
  constexpr int kMergeGroups = kMergeThreads / kMergeQuads;  // threads across the splits
  // The plan's arrays first: they do not depend on the decode grid, so their loads overlap it.
  const MergeItem it = p.items[unit.item()];
  const int qo = p.qo_indptr[it.request + 1] - p.qo_indptr[it.request];
  const int n = p.num_splits[it.request];
  const std::int64_t base = p.partial_offset[it.request] + it.row;
  pdl_wait();               // the decode grid's partials (launched as its programmatic dependent)
  pdl_launch_dependents();  // as in ops::begin_after_previous_kernel
  const std::int64_t stride = static_cast<std::int64_t>(qo) * p.num_heads;
  const int tid = threadIdx.x, quad = tid % kMergeQuads, group = tid / kMergeQuads;

  float mx = -INFINITY;
  bool ahead = false;  // the same for the whole block
  float lse_a[kAhead > 0 ? kAhead : 1];
  float4 o_a[kAhead > 0 ? kAhead : 1];
  if constexpr (kAhead > 0) {
    ahead = n <= kAhead * kMergeGroups;
    if (ahead) {
#pragma unroll
      for (int a = 0; a < kAhead; ++a) {
        const int s = group + a * kMergeGroups;
        const std::int64_t row = base + s * stride;
        lse_a[a] = s < n ? p.partial_lse[row] : -INFINITY;
        // `col` (below) written out: declaring it before the max costs the kAhead = 0 kernels
        // 6 registers (38, not 32).
        o_a[a] = s < n ? *reinterpret_cast<const float4*>(p.partial_o + row * 512 +
                                                          unit.col_block() * kCols + 4 * quad)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
        mx = nan_max(mx, lse_a[a]);
      }
    }
  }
  if (!ahead)
    for (int s = tid; s < n; s += kMergeThreads) mx = nan_max(mx, p.partial_lse[base + s * stride]);
  for (int off = 16; off > 0; off /= 2) mx = nan_max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (tid % 32 == 0) red[tid / 32] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < kMergeThreads / 32; ++w) mx = nan_max(mx, red[w]);

  const int col = unit.col_block() * kCols + 4 * quad;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.0f;
  if (ahead && mx != -INFINITY) {
#pragma unroll
    for (int a = 0; a < kAhead; ++a) {
      if (group + a * kMergeGroups >= n) break;
      const float w = __expf(lse_a[a] - mx);
      const float4 x = o_a[a];
      wsum += w;
      acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
    }
  } else if (mx != -INFINITY) {
#pragma unroll 4
    for (int s = group; s < n; s += kMergeGroups) {
      const std::int64_t row = base + s * stride;
      const float w = __expf(p.partial_lse[row] - mx);
      const float4 x = *reinterpret_cast<const float4*>(p.partial_o + row * 512 + col);
      wsum += w;
      acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
    }
  }
  part[group * kMergeQuads + quad] = acc;
  if (quad == 0) wpart[group] = wsum;
  __syncthreads();
  if (tid >= kMergeQuads) return;  // (a unit of the graph kernel's loop: to its barrier)
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float total = 0.0f;
  for (int g = 0; g < kMergeGroups; ++g) {
    const float4 v = part[g * kMergeQuads + tid];
    o.x += v.x, o.y += v.y, o.z += v.z, o.w += v.w;
    total += wpart[g];
  }
  // total == 0: nothing seen (o = 0, lse = -inf); NaN: a NaN reached the row, and stays NaN.
  const float inv = total > 0.0f ? 1.0f / total : total == 0.0f ? 0.0f : NAN;
  const std::int64_t token = p.qo_indptr[it.request] + it.row / p.num_heads;
  const std::int64_t head = it.row % p.num_heads;
  __nv_bfloat16* dst = p.out + token * p.out_stride[0] + head * p.out_stride[1] + col;
  ops::store_out2(dst, p.out_f16, o.x * inv, o.y * inv);
  ops::store_out2(dst + 2, p.out_f16, o.z * inv, o.w * inv);
  if (p.lse != nullptr && unit.col_block() == 0 && tid == 0) {
    p.lse[token * p.lse_stride[0] + head * p.lse_stride[1]] = total > 0.0f    ? mx + logf(total)
                                                              : total == 0.0f ? -INFINITY
                                                                              : NAN;
  }
}

// One unit a block: (item blockIdx.x, columns blockIdx.y x kCols); blocks past the live items
// return (a graph's grid covers the capacity).
template <int kCols, int kAhead>
__global__ void __launch_bounds__(kMergeThreads) split_merge_kernel(const MergeParams p) {
  if (static_cast<int>(blockIdx.x) >= *p.num_items) return;
  __shared__ float red[kMergeThreads / 32];
  __shared__ float4 part[kMergeThreads];  // [group][quad]
  __shared__ float wpart[kMergeThreads / (kCols / 4)];
  merge_unit<kCols, kAhead>(p, BlockUnit{}, red, part, wpart);
}

// The graph-mode merge: its grid is fixed at capture, its form read at each run from the plan's
// counts (MergeParams::form, written by every replan): whole rows when no request has more than
// kGraphWholeRowMaxSplits splits, else (row, kGraphCols-column) units. The blocks walk the units
// in strides of the grid, which is what the SMs hold at once, so a batch of many rows runs that
// many blocks rather than one for every (row, 32 columns) of the capacity: at 64 requests x 16
// heads that was 16,384 blocks, ~15 waves of short blocks after the decode (docs/design/merge.md).
__global__ void __launch_bounds__(kMergeThreads) split_merge_graph_kernel(const MergeParams p) {
  __shared__ float red[kMergeThreads / 32];
  __shared__ float4 part[kMergeThreads];                     // [group][quad]
  __shared__ float wpart[kMergeThreads / (kGraphCols / 4)];  // the second form's groups
  const int rows = *p.num_items;
  // The barriers: the next unit rewrites the shared arrays.
  if (*p.form == 0) {
    for (int u = blockIdx.x; u < rows; u += gridDim.x) {
      merge_unit<512, 0>(p, LoopUnit{u, 0}, red, part, wpart);
      __syncthreads();
    }
  } else {
    constexpr int kParts = 512 / kGraphCols;  // units a row
    for (int u = blockIdx.x; u < rows * kParts; u += gridDim.x) {
      merge_unit<kGraphCols, 0>(p, LoopUnit{u / kParts, u % kParts}, red, part, wpart);
      __syncthreads();
    }
  }
}

}  // namespace fp8mla::detail::merge
