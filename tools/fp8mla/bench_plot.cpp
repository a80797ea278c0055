#include "tools/fp8mla/bench_plot.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "fp8mla/format.h"

namespace fp8mla::cli {

std::string roofline_series(const std::string& strategy, const std::string& format,
                            const std::string& kernel, bool sparse) {
  if (sparse) return "sparse " + (kernel.empty() ? format : kernel);
  if (strategy == "native") return "native " + (kernel.empty() ? format : kernel);
  return strategy + " " + format;
}

RooflineData roofline_from_gpu(const bench::GpuBenchSummary& run) {
  RooflineData d;
  d.title = "fp8mla bench: decode attention against the measured ceilings";
  d.device = run.device;
  d.read_gbs = run.read_gbs;
  d.copy_gbs = run.copy_gbs;
  d.matmul_tfs = run.matmul_tfs;
  d.note =
      "bytes: the format's KV bytes of every context token once, for the baselines too (they "
      "sit lower by the traffic they add)";
  bool any_sparse = false;
  for (const bench::GpuBenchCase& c : run.cases) {
    if (c.gbs <= 0 || c.tfs <= 0) continue;
    char label[200];
    if (c.topk > 0) {
      any_sparse = true;
      std::snprintf(label, sizeof label,
                    "sparse top-%d, bs %d, %d heads, qo %d, page %d, %s: %.1f us, %.0f GB/s, "
                    "%.1f TF/s",
                    c.topk, c.batch, c.heads, c.qo_len, c.page_size, format_name(c.format), c.us,
                    c.gbs, c.tfs);
    } else {
      std::snprintf(label, sizeof label,
                    "bs %d, %d heads, ctx %d, qo %d, page %d: %.1f us, %.0f GB/s, %.1f TF/s",
                    c.batch, c.heads, c.context, c.qo_len, c.page_size, c.us, c.gbs, c.tfs);
    }
    d.points.push_back({roofline_series(c.strategy, format_name(c.format), c.kernel, c.topk > 0),
                        c.tfs * 1e3 / c.gbs, c.tfs, label});
  }
  if (any_sparse) {
    d.note =
        "bytes: the format's KV bytes of every token read once (dense: every context token; "
        "sparse: every top-k slot not -1)";
  }
  return d;
}

double measure_cpu_read_gbs(unsigned threads) {
  threads = std::max(1u, threads);
  const std::size_t words = (std::size_t{256} << 20) / sizeof(std::uint64_t);
  std::vector<std::uint64_t> buf(words);
  for (std::size_t i = 0; i < words; ++i) buf[i] = i;
  std::vector<std::uint64_t> sums(threads);
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const std::size_t lo = words * t / threads, hi = words * (t + 1) / threads;
        std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        std::size_t i = lo;
        for (; i + 4 <= hi; i += 4) {
          s0 += buf[i];
          s1 += buf[i + 1];
          s2 += buf[i + 2];
          s3 += buf[i + 3];
        }
        for (; i < hi; ++i) s0 += buf[i];
        sums[t] = s0 + s1 + s2 + s3;
      });
    }
    for (std::thread& th : pool) th.join();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(words * sizeof(std::uint64_t)) / s / 1e9);
  }
  volatile std::uint64_t sink = 0;
  for (const std::uint64_t s : sums) sink = sink + s;  // keeps the loads
  return best;
}

}  // namespace fp8mla::cli
