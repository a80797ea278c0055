// `fp8mla bench --sparse` on a CUDA device: the sparse top-k grid (sparse_grid.h), timed as the
// dense grid is (gpu_bench.cu) on the same pool, against the same ceilings.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tools/fp8mla/bench/gpu_bench.h"
#include "tools/fp8mla/bench/gpu_bench_result.h"

namespace fp8mla::bench {

// The device memory of a run: the pool (far larger than L2) and scratch (indices, queries,
// outputs), with the stream and the ceilings measured on them.
struct BenchMemory {
  cudaStream_t s;
  std::uint8_t* pool;
  std::size_t pool_bytes;
  std::uint8_t* scratch;
  std::size_t scratch_bytes;
  const Ceilings& ceil;
};

// Runs the grid of o (o.sparse), appends a row a case to `all` and prints the table. Returns
// false when a case missed the float64 reference (rel L2 > 1e-2) or left output unwritten.
bool run_sparse_grid(const BenchMemory& m, const GpuBenchOptions& o, std::vector<CaseResult>& all);

}  // namespace fp8mla::bench
