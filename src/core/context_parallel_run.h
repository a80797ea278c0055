// Internal: run_context_parallel()'s body with the all-gather as a parameter. The library passes
// NCCL's (src/core/context_parallel.cpp); the CPU tests pass an in-memory one between threads,
// so the slot layout, the views and the merge are tested where no GPU is.
#pragma once

#include <cstdint>
#include <functional>

#include "fp8mla/attention.h"

namespace fp8mla::detail {

// One rank's exchange buffers: out [world, rows, 512] bf16 and lse [world, rows] f32, rows =
// total_q x H, on the local plan's device.
struct ExchangeBuffers {
  std::uint16_t* out;
  float* lse;
  std::int64_t rows;
};

// Makes every rank's slot (out + r rows x 512, lse + r rows) of `x` hold rank r's partials, on
// every rank, given this rank's own slot filled (in place, as ncclAllGather does).
using AllGather = std::function<void(const ExchangeBuffers& x)>;

// Checks out / lse against the local plan (shape, dtype, device, dense rows), runs `local` (this
// rank's shard) into slot `rank` of `x`, calls all_gather(x), and merges the `world` partials
// of each row into args.out / args.lse (lse optional).
void run_sharded(const Plan& local, int rank, int world, const ExchangeBuffers& x,
                 const RunArgs& args, const AllGather& all_gather);

}  // namespace fp8mla::detail
