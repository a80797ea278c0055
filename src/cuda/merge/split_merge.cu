// run()'s split-KV merge launch (src/cuda/merge/split_merge.h).
#include <algorithm>
#include <cstdint>

#include "src/cuda/cuda_check.h"
#include "src/cuda/merge/split_merge.cuh"
#include "src/cuda/merge/split_merge.h"

namespace fp8mla::detail {

void launch_split_merge(const PlanState& plan, const CudaPlanBuffers& b, const DecodeParams& p,
                        cudaLaunchConfig_t cfg) {
  const std::int64_t merge_items = b.graph ? b.cap_merge : b.num_merge;
  if (merge_items > 0) {
    MergeParams m{};
    m.items = b.merge;
    m.num_items = b.counts + 1;
    m.qo_indptr = b.qo_indptr;
    m.num_splits = b.num_splits;
    m.partial_offset = b.partial_offset;
    m.num_heads = plan.num_heads;
    m.partial_o = b.partial_o;
    m.partial_lse = b.partial_lse;
    m.out = p.out;
    m.out_f16 = p.out_f16;
    m.out_stride[0] = p.out_stride[0];
    m.out_stride[1] = p.out_stride[1];
    m.lse = p.lse;
    m.lse_stride[0] = p.lse_stride[0];
    m.lse_stride[1] = p.lse_stride[1];
    cfg.blockDim = dim3(merge::kMergeThreads);
    cfg.dynamicSmemBytes = 0;
    if (b.graph && merge_items > 32) {
      // A graph's batches change at every replan: the form is read from the plan's counts, and
      // the grid is what the SMs hold at once, or the capacity's units when fewer.
      m.form = b.counts + 2;
      static const int per_sm = [] {
        int n = 0;
        FP8MLA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &n, merge::split_merge_graph_kernel, merge::kMergeThreads, 0));
        return std::max(n, 1);
      }();
      const std::int64_t units = merge_items * (kDimCkv / merge::kGraphCols);
      const std::int64_t resident = std::int64_t{per_sm} * plan.sm_count;
      cfg.gridDim = dim3(static_cast<unsigned>(std::min(units, resident)));
      FP8MLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, merge::split_merge_graph_kernel, m));
    } else if (b.graph || b.max_splits > kWholeRowMaxSplits) {
      // Up to 32 rows (bs 1 at <= 32 heads x query tokens) of up to 128 splits: the merge is one
      // wave at the ahead form's 6 blocks an SM, and a bs-1 call's latency is its round trips.
      // (A graph keeps the form it was captured with; either is right for any split count.)
      const bool ahead = merge_items <= 32 && b.max_splits <= 128;
      cfg.gridDim = dim3(static_cast<unsigned>(merge_items), kDimCkv / 32);
      FP8MLA_CUDA_CHECK(cudaLaunchKernelEx(
          &cfg, ahead ? merge::split_merge_kernel<32, 4> : merge::split_merge_kernel<32, 0>, m));
    } else {
      cfg.gridDim = dim3(static_cast<unsigned>(merge_items));
      FP8MLA_CUDA_CHECK(cudaLaunchKernelEx(&cfg, merge::split_merge_kernel<kDimCkv, 0>, m));
    }
  }
}

}  // namespace fp8mla::detail
