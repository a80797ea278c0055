// `fp8mla bench` on a CUDA device: ceilings, then the decode grid (gpu_bench.cu).
#pragma once

#include <string>
#include <vector>

#include "fp8mla/context_parallel.h"
#include "fp8mla/format.h"

namespace fp8mla::bench {

// Flops of causal MLA attention over `requests` requests of `qo` query tokens and `tokens` cached
// tokens in all: query token i of a request of L tokens sees L - qo + 1 + i of them, so a request
// has qo L - qo (qo - 1) / 2 score pairs, each 2 x 576 (scores) + 2 x 512 (P V) flops a head.
inline double causal_attention_flops(double tokens, int requests, int qo, int heads) {
  const double q = qo;
  return (q * tokens - requests * q * (q - 1) / 2) * heads * 2.0 * (576 + 512);
}

// The figures of a run, for `fp8mla bench --plot` (the same as its JSON).
struct GpuBenchCase {
  int batch = 0, heads = 0, context = 0, qo_len = 1, page_size = 0;
  int topk = 0;  // > 0: a sparse top-k row (--sparse; context is then 0)
  KvFormat format = KvFormat::fp8_e4m3;
  std::string strategy;  // native | cast_pool | gather_cast
  std::string kernel;    // native: the plan's kernel family (Plan::kernel_name)
  double us = 0, gbs = 0, tfs = 0;
};
struct GpuBenchSummary {
  std::string device;
  double copy_gbs = 0, read_gbs = 0, matmul_tfs = 0;  // measured ceilings (matmul 0: none)
  std::vector<GpuBenchCase> cases;
};

struct GpuBenchOptions {
  bool quick = false;        // ~1 minute: fewer cases and repetitions
  std::vector<int> batches;  // empty = the peers' grid (docs/performance.md)
  std::vector<int> heads;
  std::vector<int> contexts;
  std::vector<int> page_sizes;    // empty = {64, 1}
  std::vector<int> qo_lens;       // query tokens a request, <= every context; empty = {1}
  std::vector<KvFormat> formats;  // empty = {fp8_e4m3, fp8_e4m3_block, bf16}
  // The sparse top-k grid instead of the dense one (sparse_grid.h): topks, heads, batches,
  // qo_lens, page_sizes and formats are its axes then (empty: its defaults); contexts unused.
  bool sparse = false;
  std::vector<int> topks;
  bool baselines = true;          // also time cast-whole-pool and gather-then-cast
  std::string json_path;          // write results here when not empty
  bool progress = true;           // progress on stderr
  int min_chunk_tokens = 0;       // > 0: PlanOptions::min_chunk_tokens of every plan (split tuning)
  bool exact_scores = false;      // PlanOptions::exact_scores of every native plan
  int max_tile_rows = 0;          // PlanOptions::max_tile_rows of every plan (0: 64)
  bool f16 = false;               // dense, no baselines: fp16 queries and outputs ("native_f16")
  bool graph_plans = false;       // dense: native plans made as a CUDA-graph engine makes them
  GpuBenchSummary* summary = nullptr;  // filled with the run's figures when not null
};

// Runs the benchmark and prints a table. Returns 0, or throws fp8mla::Error (unsupported
// without CUDA or without a device).
int run_gpu_bench(const GpuBenchOptions& options);

// `fp8mla bench --cp N`: one rank of the context-parallel latency benchmark (cp_bench.cu;
// the command starts one process a GPU and hands each its rank and the group's NCCL id).
struct CpBenchOptions {
  int rank = 0, world = 1;
  NcclId id;
  bool quick = false;
  std::vector<int> heads;       // empty = {8}
  std::vector<int> contexts;    // empty = 131072, 262144, 524288, 1048576 (quick: 131072, 1048576)
  std::vector<int> page_sizes;  // empty = {64}
  std::vector<KvFormat> formats;  // empty = {fp8_e4m3}
  std::string json_path;          // rank 0 writes the results here when not empty
  bool progress = true;           // rank 0 shows progress on stderr
  int min_chunk_tokens = 0;       // > 0: PlanOptions::min_chunk_tokens of every plan
  bool exact_scores = false;      // PlanOptions::exact_scores of every plan
};

// Runs this rank's part; rank 0 prints the table. Returns 0, or 1 when a merged result missed
// the one-GPU result's tolerance. Throws fp8mla::Error (unsupported without CUDA, NCCL or
// enough devices).
int run_cp_bench(const CpBenchOptions& options);

}  // namespace fp8mla::bench
