// What `fp8mla bench --plot` draws, from a run's figures: the GPU grid with the ceilings it
// measured, or the CPU bench with a streaming-read ceiling measured here.
#pragma once

#include "tools/fp8mla/bench/gpu_bench.h"
#include "tools/fp8mla/roofline_plot.h"

namespace fp8mla::cli {

// One series per strategy and format ("native fp8_e4m3", "gather_cast bf16", ...), or per
// kernel family when the run names them ("native fp8_tma"); sparse top-k rows (--sparse) are
// series of their own per kernel family ("sparse shared_tile").
RooflineData roofline_from_gpu(const bench::GpuBenchSummary& run);

// The series name of a case (shared with `fp8mla plot`, which reads the same from JSON).
std::string roofline_series(const std::string& strategy, const std::string& format,
                            const std::string& kernel, bool sparse = false);

// Streaming read bandwidth of this machine with `threads` threads (best of a few passes over
// 256 MB), GB/s: the memory roof of the CPU bench.
double measure_cpu_read_gbs(unsigned threads);

}  // namespace fp8mla::cli
