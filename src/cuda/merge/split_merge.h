// Internal: run()'s launch of the split-KV merge (src/cuda/merge/split_merge.cuh).
#pragma once

#include <cuda_runtime.h>

#include "src/core/plan_state.h"
#include "src/cuda/decode_params.h"
#include "src/cuda/plan_buffers.h"

namespace fp8mla::detail {

// The most splits a request may have for the merge to take whole rows (a block a row, threads
// across the splits and the 512 columns); more take (row, 32-column) blocks, 16 a row.
inline constexpr int kWholeRowMaxSplits = 8;
// The graph-mode merge's (split_merge_graph_kernel) own bound: its grid walks the units, so whole
// rows pay off to more splits there.
inline constexpr int kGraphWholeRowMaxSplits = 16;

// The merge of `plan`'s split requests into p.out / p.lse, when it has any, on cfg's stream
// with cfg's attributes (the decode launch's: a programmatic dependent of it).
void launch_split_merge(const PlanState& plan, const CudaPlanBuffers& b, const DecodeParams& p,
                        cudaLaunchConfig_t cfg);

}  // namespace fp8mla::detail
