// `fp8mla bench` on a CUDA device. Measures the ceilings first (device copy and streaming read of
// >= 2 GB, bf16 matmul through cuBLAS when it can be loaded), then the decode grid. Every timed
// call of a case reads its own region of a pool far larger than L2 (a CUDA graph replays one
// run() per region), so the figures are HBM figures.
#include <cublas_v2.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "tools/fp8mla/strategies/strategies_cuda.h"
#include "tools/fp8mla/bench/case_error.h"
#include "tools/fp8mla/bench/gpu_bench.h"
#include "tools/fp8mla/bench/gpu_bench_result.h"
#include "tools/fp8mla/bench/gpu_bench_util.cuh"
#include "tools/fp8mla/bench/sparse_bench.cuh"
#include "fp8mla/attention.h"
#include "src/core/backend.h"
#include "src/core/check.h"
#include "src/cuda/cuda_check.h"

namespace fp8mla::bench {
namespace {

using detail::msg;

Ceilings measure_ceilings(cudaStream_t s, std::uint8_t* big, std::size_t big_bytes) {
  Ceilings c;
  c.copy_gbs = measure_copy_gbs(s, big, big_bytes);
  c.read_gbs = measure_read_gbs(s, big, big_bytes);
  // bf16 matmul ceiling through cuBLAS, loaded at run time (absent: not measured).
  void* lib = dlopen("libcublas.so.13", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) lib = dlopen("libcublas.so", RTLD_NOW | RTLD_LOCAL);
  if (lib != nullptr) {
    auto create = reinterpret_cast<decltype(&cublasCreate_v2)>(dlsym(lib, "cublasCreate_v2"));
    auto set_stream =
        reinterpret_cast<decltype(&cublasSetStream_v2)>(dlsym(lib, "cublasSetStream_v2"));
    using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int,
                                      int, int, const void*, const void*, cudaDataType, int,
                                      const void*, cudaDataType, int, const void*, void*,
                                      cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
    auto gemm = reinterpret_cast<GemmEx>(dlsym(lib, "cublasGemmEx"));
    auto destroy = reinterpret_cast<decltype(&cublasDestroy_v2)>(dlsym(lib, "cublasDestroy_v2"));
    cublasHandle_t h = nullptr;
    if (create && set_stream && gemm && destroy && create(&h) == CUBLAS_STATUS_SUCCESS) {
      const int m = 8192;
      const std::size_t mat = std::size_t{2} * m * m;
      fill_bf16(s, reinterpret_cast<std::uint16_t*>(big), static_cast<std::int64_t>(3 * mat / 2),
                7);
      set_stream(h, s);
      const float one = 1.0f, zero = 0.0f;
      bool ok = true;
      const double us = time_captured(s, 1, 10, [&] {
        ok = gemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, m, m, &one, big, CUDA_R_16BF, m, big + mat,
                  CUDA_R_16BF, m, &zero, big + 2 * mat, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F,
                  CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
      });
      if (ok) c.matmul_tfs = 2.0 * m * double(m) * m / (us * 1e6);
      destroy(h);
    }
  }
  return c;
}

// One (batch, heads, context, query tokens a request, page size, format) case: native, and for
// fp8 the two baselines.
struct CaseRunner {
  cudaStream_t s;
  std::uint8_t* pool;
  std::size_t pool_bytes;
  std::uint8_t* scratch;  // bf16 caches of the baselines
  std::size_t scratch_bytes;
  const Ceilings& ceil;
  bool baselines;
  bool quick;
  int min_chunk_tokens;  // 0: the planner's default
  bool exact_scores;
  int max_tile_rows;
  bool f16;  // fp16 queries and outputs in the native plans (no baselines: they plan bf16)
  bool graph_plans;  // native plans with PlanOptions::cuda_graph, capacities = the case

  std::vector<CaseResult> run(int bs, int heads, int ctx, int qo, int ps, KvFormat f) {
    const std::int64_t tb = token_bytes(f);
    const std::int64_t pool_pages = static_cast<std::int64_t>(pool_bytes / (tb * ps));
    const std::int64_t per_req = (ctx + ps - 1) / ps, per_call = per_req * bs;
    const int variants = static_cast<int>(std::clamp<std::int64_t>(pool_pages / per_call, 1, 16));
    if (pool_pages < per_call) throw Error(ErrorCode::invalid_argument, "bench", "pool too small");
    const UniformBatch batch(bs, ctx, ps, variants,
                             static_cast<std::uint64_t>(bs * 131 + heads * 17 + ctx + ps), qo);
    const std::vector<std::vector<std::int32_t>>& indices = batch.regions;
    auto make_plan = [&](std::span<const std::int32_t> idx, KvFormat fmt, std::int64_t pages,
                         bool graph = false) {
      PlanOptions po;
      if (min_chunk_tokens > 0) po.min_chunk_tokens = min_chunk_tokens;
      po.exact_scores = exact_scores;
      po.max_tile_rows = max_tile_rows;
      if (graph) {  // an engine's graph-mode plan, sized for this batch
        po.cuda_graph = true;
        po.max_batch = bs;
        po.max_total_q = bs * qo;
        po.max_qo_len = qo;
        po.max_kv_indices = static_cast<std::int64_t>(idx.size());
      }
      Problem pb = batch.problem(idx, heads, ps, pages, fmt);
      if (f16) pb.q_dtype = pb.out_dtype = DType::f16;
      return plan(pb, po);
    };
    std::vector<Plan> plans;
    for (int v = 0; v < variants; ++v)
      plans.push_back(make_plan(indices[v], f, pool_pages, graph_plans));

    // q [bs x qo, H, 576] and outputs live at the end of scratch.
    const std::int64_t total_q = std::int64_t{bs} * qo;
    const std::int64_t q_elems = total_q * heads * 576;
    const std::int64_t o_elems = total_q * heads * 512;
    auto* q = reinterpret_cast<std::uint16_t*>(scratch + scratch_bytes) - q_elems;
    auto* out = q - o_elems;
    auto* out_ref = out - o_elems;
    auto* lse = reinterpret_cast<float*>(out_ref) - total_q * heads - 64;
    std::uint8_t* bf16_area = scratch;
    const std::size_t bf16_bytes =
        static_cast<std::size_t>(reinterpret_cast<std::uint8_t*>(lse) - scratch) &
        ~std::size_t{255};
    const DType q_dtype = f16 ? DType::f16 : DType::bf16;
    if (f16) {
      fill_f16(s, q, q_elems, 3);
    } else {
      fill_bf16(s, q, q_elems, 3);
    }
    RunArgs args;
    args.q_nope = make_strided_view(q, q_dtype, {total_q, heads, 512}, {heads * 576, 576, 1},
                                    DeviceKind::cuda);
    args.q_pe = make_strided_view(q + 512, q_dtype, {total_q, heads, 64}, {heads * 576, 576, 1},
                                  DeviceKind::cuda);
    args.out = make_view(out, q_dtype, {total_q, heads, 512}, DeviceKind::cuda);
    args.lse = make_view(lse, DType::f32, {total_q, heads}, DeviceKind::cuda);
    args.kv = cache_view(pool, f, pool_pages, ps);
    args.stream = s;

    // Bytes: every context token once.
    const std::int64_t active = static_cast<std::int64_t>(bs) * ctx;
    const double bytes = static_cast<double>(active) * static_cast<double>(tb);
    const double flops = causal_attention_flops(static_cast<double>(active), bs, qo, heads);
    const int reps = quick ? 5 : 15;
    std::vector<CaseResult> results;
    auto record = [&](const std::string& strategy, double us) {
      CaseResult r;
      r.batch = bs;
      r.heads = heads;
      r.context = ctx;
      r.qo_len = qo;
      r.page_size = ps;
      r.format = f;
      r.strategy = strategy;
      r.us = us;
      if (strategy.starts_with("native")) r.kernel = plans.front().kernel_name();
      r.bytes = bytes;
      r.gbs = bytes / (us * 1e3);
      r.read_pct = 100.0 * r.gbs / ceil.read_gbs;
      r.tfs = flops / (us * 1e6);
      r.mm_pct = ceil.matmul_tfs > 0 ? 100.0 * r.tfs / ceil.matmul_tfs : 0;
      results.push_back(r);
    };
    record(f16 ? "native_f16" : "native", time_captured(s, variants, reps, [&] {
             for (int v = 0; v < variants; ++v) fp8mla::run(plans[v], args);
           }));
    if (!baselines || f == KvFormat::bf16) return results;

    // Baselines on region 0: (1) cast a story-sized pool (>= 495,040 tokens and >= the active
    // pages) to bf16, then bf16 attention; (2) gather the active pages, cast, bf16 attention.
    const std::int64_t cast_pages = std::min<std::int64_t>(
        pool_pages, std::max<std::int64_t>(per_call, (495040 + ps - 1) / ps));
    if (static_cast<std::size_t>(cast_pages * ps * 1152) > bf16_bytes) return results;
    KvCacheView src = cache_view(pool, f, cast_pages, ps);
    KvCacheView dst = cache_view(bf16_area, KvFormat::bf16, cast_pages, ps);
    Plan cast_plan = make_plan(indices[0], KvFormat::bf16, cast_pages);
    RunArgs bargs = args;
    bargs.kv = dst;
    bargs.out = make_view(out_ref, DType::bf16, {total_q, heads, 512}, DeviceKind::cuda);
    record("cast_pool", time_captured(s, 1, reps, [&] {
             strategies::cuda_cast_pool_to_bf16(src, dst, s);
             fp8mla::run(cast_plan, bargs);
           }));
    std::vector<std::int32_t> identity(static_cast<std::size_t>(per_call));
    std::iota(identity.begin(), identity.end(), 0);
    Plan gather_plan = make_plan(identity, KvFormat::bf16, per_call);
    const detail::DeviceMemory pages_buf(static_cast<std::size_t>(per_call) * 4, 0);
    auto* d_pages = pages_buf.as<std::int32_t>();
    detail::cuda_copy_to_device(d_pages, indices[0].data(), static_cast<std::size_t>(per_call) * 4);
    KvCacheView gdst = cache_view(bf16_area, KvFormat::bf16, per_call, ps);
    bargs.kv = gdst;
    record("gather_cast", time_captured(s, 1, reps, [&] {
             strategies::cuda_gather_cast_to_bf16(cache_view(pool, f, pool_pages, ps), d_pages,
                                                 per_call, gdst, s);
             fp8mla::run(gather_plan, bargs);
           }));
    // Same inputs, same answers: native (region 0) against gather-then-cast.
    fp8mla::run(plans[0], args);
    FP8MLA_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<std::uint16_t> a(static_cast<std::size_t>(o_elems)), b(a.size());
    detail::cuda_copy_to_host(a.data(), out, a.size() * 2);
    detail::cuda_copy_to_host(b.data(), out_ref, b.size() * 2);
    const double rel = rel_l2_bf16(a, b);
    for (CaseResult& r : results) {
      r.check = rel;
      r.check_against = "gather_cast";
    }
    return results;
  }
};

// plan()'s host time (median of 7) for batches a server plans once a step, fp8, 16 heads: with
// the page table on the host (checked there and uploaded) and on the device
// (Problem::device_kv_indices: checked and copied there); a fresh plan (which allocates its
// device buffers), a graph-mode replan (which rewrites them once the device is idle) and the
// stream-ordered replan an engine runs each step (staged copies on a stream, median of 301): with
// the page table on the host, and borrowed (Problem::borrowed_kv_indices, on the device: the
// SGLang plugin's form, which copies no page table).
struct PlanTime {
  int batch, context, page_size;
  double plan_host_us, plan_device_us, replan_host_us, replan_device_us, replan_stream_us,
      replan_stream_borrowed_us;
};

std::vector<PlanTime> measure_plan_times() {
  std::vector<PlanTime> times;
  for (const auto& [bs, ctx, ps] :
       {std::tuple{128, 8192, 1}, {128, 8192, 64}, {64, 4096, 64}, {1, 131072, 1}}) {
    const UniformBatch batch(bs, ctx, ps, 1, 7);
    const std::vector<std::int32_t>& pages = batch.regions[0];
    const auto n = static_cast<std::int64_t>(pages.size());
    const detail::DeviceMemory table_buf(pages.size() * 4, 0);
    auto* table = table_buf.as<std::int32_t>();
    detail::cuda_copy_to_device(table, pages.data(), pages.size() * 4);
    const Problem host = batch.problem(pages, 16, ps, n, KvFormat::fp8_e4m3);
    Problem device = host;
    device.kv_indices = {};
    device.device_kv_indices = make_view(table, DType::i32, {n}, DeviceKind::cuda);
    Problem borrowed = device;
    borrowed.device_kv_indices = {};
    borrowed.borrowed_kv_indices = device.device_kv_indices;
    auto median_us = [](auto&& fn, int calls = 7) {
      std::vector<double> us;
      for (int i = 0; i < calls; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        fn();
        us.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count());
      }
      std::nth_element(us.begin(), us.begin() + calls / 2, us.end());
      return us[calls / 2];
    };
    PlanOptions graph;
    graph.cuda_graph = true;
    graph.max_batch = graph.max_total_q = bs;
    graph.max_kv_indices = n;
    Plan g = plan(host, graph);
    Plan on_stream = plan(host, graph);
    Plan on_stream_borrowed = plan(borrowed, graph);
    cudaStream_t s;
    FP8MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    times.push_back({bs, ctx, ps, median_us([&] { (void)plan(host); }),
                     median_us([&] { (void)plan(device); }), median_us([&] { replan(g, host); }),
                     median_us([&] { replan(g, device); }),
                     median_us([&] { replan(on_stream, host, s); }, 301),
                     median_us([&] { replan(on_stream_borrowed, borrowed, s); }, 301)});
    FP8MLA_CUDA_CHECK(cudaStreamSynchronize(s));
    FP8MLA_CUDA_CHECK(cudaStreamDestroy(s));
  }
  return times;
}

// A JSON number, or null for what JSON has no number for (NaN, infinities).
std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream o;
  o << v;
  return o.str();
}

void write_json(const std::string& path, const Ceilings& c, const std::vector<CaseResult>& rs,
                const std::vector<PlanTime>& plans) {
  std::ofstream f(path);
  if (!f) throw Error(ErrorCode::invalid_argument, "--json", "cannot write " + path);
  f << "{\n  \"device\": \"" <<
      [] {
        cudaDeviceProp p{};
        (void)cudaGetDeviceProperties(&p, 0);
        return std::string(p.name);
      }()
    << "\",\n";
  f << "  \"ceilings\": {\"copy_gbs\": " << c.copy_gbs << ", \"read_gbs\": " << c.read_gbs
    << ", \"matmul_bf16_tfs\": " << c.matmul_tfs << "},\n  \"cases\": [\n";
  for (std::size_t i = 0; i < rs.size(); ++i) {
    const CaseResult& r = rs[i];
    f << "    {\"batch\": " << r.batch << ", \"heads\": " << r.heads
      << ", \"context\": " << r.context << ", \"qo_len\": " << r.qo_len
      << ", \"page_size\": " << r.page_size << ", \"format\": \"" << format_name(r.format)
      << "\", \"strategy\": \"" << r.strategy << "\", \"us\": " << r.us << ", \"gbs\": " << r.gbs
      << ", \"read_pct\": " << r.read_pct << ", \"tfs\": " << r.tfs
      << ", \"matmul_pct\": " << r.mm_pct << ", \"check_rel_l2\": " << json_number(r.check)
      << ", \"check_against\": \"" << r.check_against << "\", \"kernel\": \"" << r.kernel
      << "\", \"bytes\": " << r.bytes << ", \"sparse\": " << (r.topk > 0 ? "true" : "false")
      << ", \"topk\": " << r.topk;
    if (r.topk > 0) {
      f << ", \"valid_per_row\": " << r.valid_per_row << ", \"pool_tokens\": " << r.pool_tokens
        << ", \"gather_gbs\": " << r.gather_gbs;
    }
    f << "}" << (i + 1 < rs.size() ? "," : "") << "\n";
  }
  f << "  ],\n  \"plan_host_us\": [\n";
  for (std::size_t i = 0; i < plans.size(); ++i) {
    const PlanTime& p = plans[i];
    f << "    {\"batch\": " << p.batch << ", \"context\": " << p.context
      << ", \"page_size\": " << p.page_size << ", \"plan_host_page_table\": " << p.plan_host_us
      << ", \"plan_device_page_table\": " << p.plan_device_us
      << ", \"graph_replan_host_page_table\": " << p.replan_host_us
      << ", \"graph_replan_device_page_table\": " << p.replan_device_us
      << ", \"stream_replan_host_page_table\": " << p.replan_stream_us
      << ", \"stream_replan_borrowed_page_table\": " << p.replan_stream_borrowed_us << "}"
      << (i + 1 < plans.size() ? "," : "") << "\n";
  }
  f << "  ]\n}\n";
}

// The dense grid (batch x heads x context x query tokens x page size x format), appended to all.
void run_dense_grid(cudaStream_t s, std::uint8_t* pool, std::size_t pool_bytes,
                    std::uint8_t* scratch, std::size_t scratch_bytes, const Ceilings& ceil,
                    const GpuBenchOptions& o, std::vector<CaseResult>& all) {
  struct Shape {
    int bs, heads, ctx;
  };
  std::vector<Shape> shapes;
  const std::vector<int> heads = o.heads.empty() ? std::vector<int>{8, 16, 128} : o.heads;
  if (!o.batches.empty() || !o.contexts.empty()) {
    for (int b : o.batches.empty() ? std::vector<int>{1, 16, 64, 128} : o.batches)
      for (int h : heads)
        for (int c : o.contexts.empty() ? std::vector<int>{4096} : o.contexts)
          shapes.push_back({b, h, c});
  } else {
    for (int h : heads) {
      for (int c : o.quick ? std::vector<int>{4096, 131072} : std::vector<int>{4096, 32768, 131072})
        shapes.push_back({1, h, c});
      if (!o.quick) shapes.push_back({16, h, 4096});
      shapes.push_back({64, h, 4096});
      shapes.push_back({128, h, 8192});
    }
  }
  const std::vector<int> pss = o.page_sizes.empty() ? std::vector<int>{64, 1} : o.page_sizes;
  const std::vector<int> qos = o.qo_lens.empty() ? std::vector<int>{1} : o.qo_lens;
  const std::vector<KvFormat> fmts =
      o.formats.empty()
          ? std::vector<KvFormat>{KvFormat::fp8_e4m3, KvFormat::fp8_e4m3_block, KvFormat::bf16}
          : o.formats;
  CaseRunner runner{s,           pool,    pool_bytes,         scratch,        scratch_bytes,   ceil,
                    o.baselines, o.quick, o.min_chunk_tokens, o.exact_scores, o.max_tile_rows,
                    o.f16,       o.graph_plans};
  int done = 0;
  const int total = static_cast<int>(shapes.size() * qos.size() * pss.size() * fmts.size());
  KvFormat filled = KvFormat::bf16;
  bool any = false;
  for (KvFormat f : fmts) {
    const std::int64_t tokens = static_cast<std::int64_t>(pool_bytes / token_bytes(f));
    if (!any || filled != f) {
      fill_pool(s, pool, tokens, f, 12345);
      filled = f;
      any = true;
    }
    for (int ps : pss)
      for (const Shape& sh : shapes)
        for (int qo : qos) {
          const std::string label = msg("bs=", sh.bs, " heads=", sh.heads, " ctx=", sh.ctx,
                                        " qo=", qo, " page=", ps, " ", format_name(f));
          if (o.progress) std::fprintf(stderr, "[%d/%d] %s\n", ++done, total, label.c_str());
          for (CaseResult& r : run_named_case(
                   label, [&] { return runner.run(sh.bs, sh.heads, sh.ctx, qo, ps, f); }))
            all.push_back(r);
        }
  }
  // qo: query tokens a request (1: decode; more: causal MTP / speculative verify).
  std::printf("\n%-4s %-5s %-7s %-3s %-4s %-9s %-12s %9s %8s %7s %8s %7s %9s\n", "bs", "heads",
              "ctx", "qo", "page", "format", "strategy", "us", "GB/s", "%read", "TF/s", "%mm",
              "check");
  for (const CaseResult& r : all) {
    std::printf("%-4d %-5d %-7d %-3d %-4d %-9s %-12s %9.1f %8.0f %6.1f%% %8.1f %6.1f%% %9s\n",
                r.batch, r.heads, r.context, r.qo_len, r.page_size, table_format(r.format),
                r.strategy.c_str(), r.us, r.gbs, r.read_pct, r.tfs, r.mm_pct,
                r.check < 0 ? "-" : msg(r.check).substr(0, 8).c_str());
  }
}

}  // namespace

int run_gpu_bench(const GpuBenchOptions& o) {
  const std::string why = detail::cuda_unavailable_reason();
  if (!why.empty()) throw Error(ErrorCode::unsupported, "--device cuda", why);
  FP8MLA_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t s;
  FP8MLA_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // One pool buffer (16 GB, or a quarter of free memory) plus scratch for the bf16 baselines.
  std::size_t free_b = 0, total_b = 0;
  FP8MLA_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const std::size_t pool_bytes = std::min<std::size_t>(std::size_t{16} << 30, free_b / 4);
  const std::size_t scratch_bytes = std::min<std::size_t>(std::size_t{8} << 30, free_b / 8);
  const detail::DeviceMemory pool_buf(pool_bytes, 0), scratch_buf(scratch_bytes, 0);
  auto* pool = pool_buf.as<std::uint8_t>();
  auto* scratch = scratch_buf.as<std::uint8_t>();

  const Ceilings ceil = measure_ceilings(s, pool, pool_bytes);
  std::printf(
      "ceilings: device copy %.0f GB/s (read+write), streaming read %.0f GB/s, bf16 matmul %s\n",
      ceil.copy_gbs, ceil.read_gbs,
      ceil.matmul_tfs > 0 ? msg(static_cast<int>(ceil.matmul_tfs), " TF/s").c_str()
                          : "not measured (libcublas not found)");
  if (o.min_chunk_tokens > 0) std::printf("plans: min_chunk_tokens %d\n", o.min_chunk_tokens);
  if (o.exact_scores) std::printf("plans: exact_scores\n");
  if (o.max_tile_rows > 0) std::printf("plans: max_tile_rows %d\n", o.max_tile_rows);
  if (o.f16) std::printf("plans: fp16 queries and outputs\n");
  if (o.graph_plans) std::printf("plans: graph mode (PlanOptions::cuda_graph, capacities = the case)\n");

  std::vector<CaseResult> all;
  bool ok = true;
  if (o.sparse) {
    ok = run_sparse_grid({s, pool, pool_bytes, scratch, scratch_bytes, ceil}, o, all);
  } else {
    run_dense_grid(s, pool, pool_bytes, scratch, scratch_bytes, ceil, o, all);
  }
  const std::vector<PlanTime> plans = o.sparse ? std::vector<PlanTime>{} : measure_plan_times();
  if (!plans.empty()) {
    std::printf(
        "\nplan() on the host, us (fp8, 16 heads; once a step, for every layer), page table on\n"
        "the host / on the device: a fresh plan (allocates its device buffers), a graph-mode "
        "replan; and the\nstream-ordered replan an engine runs each step, page table on the host / "
        "borrowed on the device\n");
  }
  for (const PlanTime& p : plans) {
    std::printf(
        "  bs %d, ctx %d, page %d: plan %.0f / %.0f, replan %.0f / %.0f, on a stream %.1f / %.1f\n",
        p.batch, p.context, p.page_size, p.plan_host_us, p.plan_device_us, p.replan_host_us,
        p.replan_device_us, p.replan_stream_us, p.replan_stream_borrowed_us);
  }
  if (!o.json_path.empty()) write_json(o.json_path, ceil, all, plans);
  if (o.summary != nullptr) {
    cudaDeviceProp prop{};
    (void)cudaGetDeviceProperties(&prop, 0);
    o.summary->device = prop.name;
    o.summary->copy_gbs = ceil.copy_gbs;
    o.summary->read_gbs = ceil.read_gbs;
    o.summary->matmul_tfs = ceil.matmul_tfs;
    for (const CaseResult& r : all) {
      GpuBenchCase c;
      c.batch = r.batch;
      c.heads = r.heads;
      c.context = r.context;
      c.qo_len = r.qo_len;
      c.page_size = r.page_size;
      c.topk = r.topk;
      c.format = r.format;
      c.strategy = r.strategy;
      c.kernel = r.kernel;
      c.us = r.us;
      c.gbs = r.gbs;
      c.tfs = r.tfs;
      o.summary->cases.push_back(c);
    }
  }
  FP8MLA_CUDA_CHECK(cudaStreamDestroy(s));
  return ok ? 0 : 1;
}

}  // namespace fp8mla::bench
