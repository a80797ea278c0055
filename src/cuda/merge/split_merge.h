// Internal: run()'s launch of the split-KV merge (src/cuda/merge/split_merge.cuh).
#pragma once

#include <cuda_runtime.h>

#include "src/core/plan_state.h"
#include "src/cuda/decode_params.h"
#include "src/cuda/plan_buffers.h"

namespace fp8mla::detail {

// The merge of `plan`'s split requests into p.out / p.lse, when it has any, on cfg's stream
// with cfg's attributes (the decode launch's: a programmatic dependent of it).
void launch_split_merge(const PlanState& plan, const CudaPlanBuffers& b, const DecodeParams& p,
                        cudaLaunchConfig_t cfg);

}  // namespace fp8mla::detail
