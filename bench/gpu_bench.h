// `fp8mla bench` on a CUDA device: ceilings, then the decode grid (bench/gpu_bench.cu).
#pragma once

#include <string>
#include <vector>

#include "fp8mla/format.h"

namespace fp8mla::bench {

struct GpuBenchOptions {
  bool quick = false;        // ~1 minute: fewer cases and repetitions
  std::vector<int> batches;  // empty = the ANCHORS.md grid
  std::vector<int> heads;
  std::vector<int> contexts;
  std::vector<int> page_sizes;    // empty = {64, 1}
  std::vector<KvFormat> formats;  // empty = {fp8_e4m3, bf16}
  bool baselines = true;          // also time cast-whole-pool and gather-then-cast
  std::string json_path;          // write results here when not empty
  bool progress = true;           // progress on stderr
  int min_chunk_tokens = 0;       // > 0: PlanOptions::min_chunk_tokens of every plan (split tuning)
  bool exact_scores = false;      // PlanOptions::exact_scores of every native plan
};

// Runs the benchmark and prints a table. Returns 0, or throws fp8mla::Error (unsupported
// without CUDA or without a device).
int run_gpu_bench(const GpuBenchOptions& options);

}  // namespace fp8mla::bench
