// `fp8mla bench --cp N`, one rank (tools/fp8mla starts one process a GPU): single-stream decode
// latency (batch 1) with the request's context spread over N GPUs by run_context_parallel,
// against the same request decoded on one GPU. Every rank fills the same random pool (same
// seed), so rank 0's one-GPU run checks the merged result. Each timed call reads its own region
// of the pool (a CUDA graph replays one call per region), so the figures are HBM figures.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tools/fp8mla/bench/gpu_bench.h"
#include "tools/fp8mla/bench/gpu_bench_util.cuh"
#include "fp8mla/attention.h"
#include "fp8mla/context_parallel.h"
#include "src/core/backend.h"
#include "src/core/check.h"

namespace fp8mla::bench {
namespace {

using detail::DeviceMemory;
using detail::msg;

// The GPU tests' bounds (tests/cuda/gpu_test_util.h): the merged result against one GPU's.
constexpr double kOutTol = 1e-2;
constexpr double kLseTol = 2e-3;

struct CpResult {
  KvFormat format;
  int heads, page_size, context;
  double one_us = 0, cp_us = 0, floor_us = 0;  // floor: this rank's share of bytes at read speed
  double rel_l2 = 0, lse_err = 0;
  bool ok() const { return rel_l2 <= kOutTol && lse_err <= kLseTol; }
};

template <class T>
std::vector<T> to_host(const T* p, std::size_t n) {
  std::vector<T> v(n);
  detail::cuda_copy_to_host(v.data(), p, n * sizeof(T));
  return v;
}

// The merged result (rows [rows, 2 rows) of out / lse) against the one-GPU result (rows
// [0, rows)): out's relative L2 error and lse's |got - want| / max(1, |want|).
void compare(const DeviceMemory& out, const DeviceMemory& lse, std::int64_t rows, CpResult& r) {
  const auto o16 = to_host(out.as<std::uint16_t>(), static_cast<std::size_t>(2 * rows * 512));
  const auto l32 = to_host(lse.as<float>(), static_cast<std::size_t>(2 * rows));
  const auto n = static_cast<std::size_t>(rows * 512);
  r.rel_l2 = rel_l2_bf16(std::span(o16).subspan(n, n), std::span(o16).first(n));
  for (std::int64_t i = 0; i < rows; ++i) {
    const double want = l32[i], got = l32[rows + i];
    const double err = std::abs(got - want) / std::max(1.0, std::abs(want));
    r.lse_err = std::isnan(err) ? INFINITY : std::max(r.lse_err, err);
  }
}

struct CpRunner {
  const CpBenchOptions& o;
  const NcclComm& comm;
  cudaStream_t s;
  double read_gbs;  // rank 0's (other ranks report nothing)

  CpResult run(KvFormat f, int heads, int ps, int ctx) const {
    const int dev = comm.device_id(), regions = o.quick ? 2 : 4, reps = o.quick ? 5 : 15;
    const bool lead = comm.rank() == 0;
    const std::int64_t tb = token_bytes(f), per_req = (ctx + ps - 1) / ps;
    const std::int64_t pages = regions * per_req;
    DeviceMemory pool(static_cast<std::size_t>(pages * ps * tb), dev);
    fill_pool(s, pool.as<std::uint8_t>(), pages * ps, f, 2024);
    const std::int64_t rows = heads;
    DeviceMemory q(static_cast<std::size_t>(rows * 576 * 2), dev);
    DeviceMemory out(static_cast<std::size_t>(2 * rows * 512 * 2), dev);  // one GPU | N GPUs
    DeviceMemory lse(static_cast<std::size_t>(2 * rows * 4), dev);
    fill_bf16(s, q.as<std::uint16_t>(), rows * 576, 5);

    const UniformBatch batch(1, ctx, ps, regions,
                             static_cast<std::uint64_t>(ctx + 7 * ps + 131 * heads));
    auto problem = [&](int v) {
      return batch.problem(batch.regions[static_cast<std::size_t>(v)], heads, ps, pages, f, dev);
    };
    const DeviceKind cuda = DeviceKind::cuda;
    auto* q16 = q.as<std::uint16_t>();
    RunArgs one_args;
    one_args.q_nope =
        make_strided_view(q16, DType::bf16, {1, heads, 512}, {heads * 576, 576, 1}, cuda, dev);
    one_args.q_pe =
        make_strided_view(q16 + 512, DType::bf16, {1, heads, 64}, {heads * 576, 576, 1}, cuda, dev);
    one_args.kv = cache_view(pool.as<std::uint8_t>(), f, pages, ps, dev);
    one_args.out = make_view(out.as<std::uint16_t>(), DType::bf16, {1, heads, 512}, cuda, dev);
    one_args.lse = make_view(lse.as<float>(), DType::f32, {1, heads}, cuda, dev);
    one_args.stream = s;
    RunArgs cp_args = one_args;
    cp_args.out =
        make_view(out.as<std::uint16_t>() + rows * 512, DType::bf16, {1, heads, 512}, cuda, dev);
    cp_args.lse = make_view(lse.as<float>() + rows, DType::f32, {1, heads}, cuda, dev);

    PlanOptions po;
    if (o.min_chunk_tokens > 0) po.min_chunk_tokens = o.min_chunk_tokens;
    po.exact_scores = o.exact_scores;
    std::vector<ContextParallelPlan> cps;
    for (int v = 0; v < regions; ++v) cps.push_back(plan_context_parallel(problem(v), comm, po));
    CpResult r{f, heads, ps, ctx};
    std::vector<Plan> ones;  // rank 0's, on its GPU alone
    if (lead)
      for (int v = 0; v < regions; ++v) ones.push_back(plan(problem(v), po));

    // First, outside capture (NCCL connects its ranks at their first collective): region 0
    // merged over the ranks against region 0 on one GPU.
    run_context_parallel(cps[0], cp_args);
    if (lead) fp8mla::run(ones[0], one_args);
    FP8MLA_CUDA_CHECK(cudaStreamSynchronize(s));
    if (lead) compare(out, lse, rows, r);

    // One GPU: rank 0 alone (no collective, so the other ranks need not follow).
    if (lead)
      r.one_us = time_captured(s, regions, reps, [&] {
        for (int v = 0; v < regions; ++v) fp8mla::run(ones[v], one_args);
      });
    // Every rank replays the same graph as often, so the all-gathers pair up.
    r.cp_us = time_captured(s, regions, reps, [&] {
      for (int v = 0; v < regions; ++v) run_context_parallel(cps[v], cp_args);
    });
    const double share = static_cast<double>((per_req + comm.world() - 1) / comm.world()) * ps;
    if (lead)
      r.floor_us = std::min<double>(share, ctx) * static_cast<double>(tb) / (read_gbs * 1e3);
    return r;
  }
};

void write_cp_json(const std::string& path, int world, double read_gbs,
                   const std::vector<CpResult>& rs) {
  std::ofstream f(path);
  if (!f) throw Error(ErrorCode::invalid_argument, "--json", "cannot write " + path);
  f << "{\n  \"command\": \"bench --cp\", \"world\": " << world << ", \"read_gbs\": " << read_gbs
    << ",\n  \"cases\": [\n";
  for (std::size_t i = 0; i < rs.size(); ++i) {
    const CpResult& r = rs[i];
    f << "    {\"format\": \"" << format_name(r.format) << "\", \"heads\": " << r.heads
      << ", \"page_size\": " << r.page_size << ", \"context\": " << r.context
      << ", \"one_gpu_us\": " << r.one_us << ", \"cp_us\": " << r.cp_us
      << ", \"cp_floor_us\": " << r.floor_us << ", \"rel_l2_vs_one_gpu\": " << r.rel_l2
      << ", \"lse_err_vs_one_gpu\": " << r.lse_err << "}" << (i + 1 < rs.size() ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
}

}  // namespace

int run_cp_bench(const CpBenchOptions& o) {
  FP8MLA_CUDA_CHECK(cudaSetDevice(o.rank));  // this rank's GPU, for the stream and buffers below
  const NcclComm comm(o.id, o.rank, o.world, o.rank);
  const bool lead = o.rank == 0;
  cudaStream_t s;
  FP8MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  double read_gbs = 0;  // rank 0's GPU: only rank 0 reports
  if (lead) {
    std::size_t free_b = 0, total_b = 0;
    FP8MLA_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const std::size_t bytes = std::min<std::size_t>(std::size_t{8} << 30, free_b / 4);
    DeviceMemory buf(bytes, comm.device_id());
    read_gbs = measure_read_gbs(s, buf.as<std::uint8_t>(), bytes);
  }
  const std::vector<int> heads = o.heads.empty() ? std::vector<int>{8} : o.heads;
  const std::vector<int> contexts = !o.contexts.empty() ? o.contexts
                                    : o.quick           ? std::vector<int>{131072, 1048576}
                                              : std::vector<int>{131072, 262144, 524288, 1048576};
  const std::vector<int> pss = o.page_sizes.empty() ? std::vector<int>{64} : o.page_sizes;
  const std::vector<KvFormat> fmts =
      o.formats.empty() ? std::vector<KvFormat>{KvFormat::fp8_e4m3} : o.formats;
  if (lead) {
    std::printf(
        "fp8mla bench --cp %d: one request (batch 1) decoded with its context over %d GPUs "
        "(run_context_parallel: local decode, NCCL all-gather of (out, lse), merge) against one "
        "GPU\nceiling: streaming read %.0f GB/s (rank 0's GPU); floor = a rank's share of the "
        "context's bytes at that rate\n\n",
        o.world, o.world, read_gbs);
    std::printf("%-9s %5s %4s %8s %10s %10s %8s %9s %7s %9s %9s\n", "format", "heads", "page",
                "ctx", "1 GPU us", msg("cp x", o.world, " us").c_str(), "speedup", "floor us",
                "%floor", "rel L2", "lse err");
  }
  const CpRunner runner{o, comm, s, read_gbs};
  std::vector<CpResult> all;
  bool ok = true;
  const int total = static_cast<int>(fmts.size() * pss.size() * heads.size() * contexts.size());
  int done = 0;
  for (KvFormat f : fmts)
    for (int ps : pss)
      for (int h : heads)
        for (int ctx : contexts) {
          if (lead && o.progress)
            std::fprintf(stderr, "[%d/%d] heads=%d ctx=%d page=%d %s\n", ++done, total, h, ctx, ps,
                         format_name(f));
          const CpResult r = runner.run(f, h, ps, ctx);
          all.push_back(r);
          if (!lead) continue;
          ok = ok && r.ok();
          std::printf("%-9s %5d %4d %8d %10.1f %10.1f %7.2fx %9.1f %6.1f%% %9.2e %9.2e%s\n",
                      f == KvFormat::fp8_e4m3 ? "fp8" : format_name(f), h, ps, ctx, r.one_us,
                      r.cp_us, r.one_us / r.cp_us, r.floor_us, 100.0 * r.floor_us / r.cp_us,
                      r.rel_l2, r.lse_err, r.ok() ? "" : "  FAILED");
          std::fflush(stdout);
        }
  FP8MLA_CUDA_CHECK(cudaStreamDestroy(s));
  if (!lead) return 0;
  std::printf("\n%s: the %d-GPU result within rel L2 %.0e (lse %.0e) of one GPU's in every case\n",
              ok ? "OK" : "FAILED", o.world, kOutTol, kLseTol);
  if (!o.json_path.empty()) write_cp_json(o.json_path, o.world, read_gbs, all);
  return ok ? 0 : 1;
}

}  // namespace fp8mla::bench
