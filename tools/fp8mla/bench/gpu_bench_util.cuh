// Shared by the GPU benchmarks (gpu_bench.cu: the decode grid; cp_bench.cu: context
// parallelism): CUDA-graph timing, the bandwidth ceilings, random pools and cache views.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fp8mla/attention.h"
#include "fp8mla/cache.h"
#include "fp8mla/format.h"
#include "src/cuda/cuda_check.h"

namespace fp8mla::bench {

// Median over `reps` replays of a graph holding `calls` calls; microseconds per call.
inline double time_graph(cudaStream_t s, cudaGraphExec_t exec, int calls, int reps) {
  cudaEvent_t a, b;
  FP8MLA_CUDA_CHECK(cudaEventCreate(&a));
  FP8MLA_CUDA_CHECK(cudaEventCreate(&b));
  FP8MLA_CUDA_CHECK(cudaGraphLaunch(exec, s));  // warm-up
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    FP8MLA_CUDA_CHECK(cudaEventRecord(a, s));
    FP8MLA_CUDA_CHECK(cudaGraphLaunch(exec, s));
    FP8MLA_CUDA_CHECK(cudaEventRecord(b, s));
    FP8MLA_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    FP8MLA_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  FP8MLA_CUDA_CHECK(cudaEventDestroy(a));
  FP8MLA_CUDA_CHECK(cudaEventDestroy(b));
  return 1e3 * t[reps / 2] / calls;
}

// Captures body's launches on s into an instantiated graph (the caller destroys it).
template <class Body>
cudaGraphExec_t capture_graph(cudaStream_t s, Body&& body) {
  cudaGraph_t g;
  cudaGraphExec_t exec;
  FP8MLA_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  FP8MLA_CUDA_CHECK(cudaStreamEndCapture(s, &g));
  FP8MLA_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  FP8MLA_CUDA_CHECK(cudaGraphDestroy(g));  // the executable graph holds what it needs
  return exec;
}

template <class Body>
double time_captured(cudaStream_t s, int calls, int reps, Body&& body) {
  cudaGraphExec_t exec = capture_graph(s, body);
  const double us = time_graph(s, exec, calls, reps);
  FP8MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return us;
}

// As time_captured, with as many replays as fill about budget_s seconds of device time (a first
// timed replay sets the pace), at least min_reps and at most max_reps.
template <class Body>
double time_captured_within(cudaStream_t s, int calls, double budget_s, int min_reps, int max_reps,
                            Body&& body) {
  cudaGraphExec_t exec = capture_graph(s, body);
  const double first_us = time_graph(s, exec, calls, 1);
  const double per_replay_s = std::max(first_us * calls * 1e-6, 1e-7);
  const int reps = std::clamp(static_cast<int>(budget_s / per_replay_s), min_reps, max_reps);
  const double us = time_graph(s, exec, calls, reps);
  FP8MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
  return us;
}

// Bandwidth ceilings over a device buffer of `bytes` (>= 2 GB for HBM figures): a copy kernel
// (read + write GB/s, over min(bytes / 2, 4 GB)) and a streaming read (over min(bytes, 8 GB)).
double measure_copy_gbs(cudaStream_t s, std::uint8_t* buf, std::size_t bytes);
double measure_read_gbs(cudaStream_t s, std::uint8_t* buf, std::size_t bytes);

// Random but well-formed tokens of format f (fp8 codes of magnitude 2^-4..2^3, no NaN; bf16
// values in (-2, 2); block scales 2^-2..2^1), deterministic in seed.
void fill_pool(cudaStream_t s, std::uint8_t* pool, std::int64_t tokens, KvFormat f,
               std::uint64_t seed);
// n bf16 values in (-2, 2), deterministic in seed.
void fill_bf16(cudaStream_t s, std::uint16_t* p, std::int64_t n, std::uint64_t seed);
// n fp16 values in (-2, 2) from the same hash (the queries of an fp16 model).
void fill_f16(cudaStream_t s, std::uint16_t* p, std::int64_t n, std::uint64_t seed);

// Relative L2 error of bf16 values `got` against `want` (same length), in float64; infinite when
// `want` is all zeros and `got` is not.
double rel_l2_bf16(std::span<const std::uint16_t> got, std::span<const std::uint16_t> want);

// The cache view of a dense [pages, ps, token] pool of format f at base (SGLang's layout: ckv
// and kpe as two views of one token), on the device (or, with DeviceKind::cpu, in host memory).
KvCacheView cache_view(std::uint8_t* base, KvFormat f, std::int64_t pages, int ps,
                       int device_id = 0, DeviceKind kind = DeviceKind::cuda);

// Copies the `n` tokens of `token_bytes` bytes (a multiple of 16) at the global slots
// slots[0, n) (device memory) of a dense pool to dst, one after another.
void gather_tokens(cudaStream_t s, const std::uint8_t* pool, std::int64_t token_bytes,
                   const std::int32_t* slots, std::int64_t n, std::uint8_t* dst);

// Reads the bytes of the `n` tokens of `token_bytes` bytes (a multiple of 16) at the global slots
// slots[0, n) (device memory; -1: no token) of a dense pool, 16 bytes a load, and writes nothing
// but (almost never) one word to sink: the sparse grid's gather ceiling, the same lists' bytes
// read with nothing else to do.
void read_tokens(cudaStream_t s, const std::uint8_t* pool, std::int64_t token_bytes,
                 const std::int32_t* slots, std::int64_t n, std::uint32_t* sink);

// The benches' batches: `bs` requests of `qo_len` query tokens and `ctx` tokens each (causal
// when qo_len > 1: MTP / speculative verify; qo_len <= ctx), sm_scale 1 / sqrt(192), and
// `regions` page tables over disjoint regions of the pool (region v: pages [v n, (v + 1) n),
// n = bs x pages a request, in a random order from `seed`), so that successive timed calls read
// different bytes.
struct UniformBatch {
  std::vector<std::int32_t> qo_indptr, kv_indptr, kv_len;
  std::vector<std::vector<std::int32_t>> regions;
  int qo_len;
  UniformBatch(int bs, int ctx, int ps, int regions, std::uint64_t seed, int qo_len = 1);
  // The Problem over page table `indices` (spans into this batch and `indices`).
  Problem problem(std::span<const std::int32_t> indices, int heads, int ps, std::int64_t num_pages,
                  KvFormat f, int device_id = 0) const;
};

}  // namespace fp8mla::bench
