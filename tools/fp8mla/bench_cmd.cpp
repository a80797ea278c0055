// `fp8mla bench`: the GPU grid (bench/gpu_bench.cu beside this file) on a CUDA device; otherwise
// a CPU bench of the library's fast path against the float64 reference, per format.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "tools/fp8mla/strategies/strategies.h"
#include "tools/fp8mla/bench/gpu_bench.h"
#include "fp8mla/attention.h"
#include "fp8mla/error.h"
#include "src/core/backend.h"
#include "tools/fp8mla/args.h"
#include "tools/fp8mla/bench_plot.h"
#include "tools/fp8mla/commands.h"
#include "tools/fp8mla/cp_launch.h"
#include "tools/fp8mla/util.h"
#include "tools/fp8mla/workload.h"

namespace fp8mla::cli {
namespace {

struct BenchOptions {
  bool quick = false;
  std::vector<int> batches, heads, contexts, page_sizes, qo_lens;
  std::vector<std::string> formats;
  bool sparse = false;     // --sparse: the sparse top-k grid instead of the dense one
  std::vector<int> topks;  // --topk: its k values
  bool no_baselines = false;
  std::string json;
  std::string plot;  // --plot: the roofline, as SVG
  bool no_progress = false;
  std::string device = "auto";
  int min_chunk = 0;
  bool exact_scores = false;
  int max_tile_rows = 0;
  bool f16 = false;
  bool graph_plans = false;
  int cp = 0;         // --cp: GPUs of the context-parallel benchmark (0: the decode grid)
  int cp_rank = -1;   // set by --cp's launcher in each rank's command line
  std::string cp_id;  // the group's NCCL id, in hex
};

// The fast path against the float64 reference: fp32 accumulation and bf16 output rounding.
constexpr double kReferenceTol = 1e-2;

struct CpuCase {
  KvFormat format = KvFormat::fp8_e4m3;
  int batch = 0, heads = 0, context = 0, qo_len = 1, page_size = 0;
  double fast_s = 0, ref_s = 0, baseline_s = 0;
  std::int64_t tokens = 0, ref_tokens = 0;
  Comparison vs_ref;
};

// Median time of fn() over enough repetitions to fill ~budget_s (at least 3, after a warm-up).
template <class Fn>
double median_time(double budget_s, Fn&& fn) {
  Clock::time_point start = Clock::now();
  fn();  // warm-up: first-touch of outputs and workspaces
  const double first = seconds_since(start);
  const int reps = std::clamp(static_cast<int>(budget_s / std::max(first, 1e-6)), 3, 50);
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    start = Clock::now();
    fn();
    times.push_back(seconds_since(start));
  }
  std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
  return times[static_cast<std::size_t>(reps / 2)];
}

void run_cpu_case(CpuCase& c, bool baselines, double budget_s) {
  WorkloadConfig wc;
  wc.format = c.format;
  wc.page_size = c.page_size;
  wc.batch = c.batch;
  wc.mean_context = c.context;
  wc.ragged = false;  // as the peers' grid (docs/performance.md): one context for all
  wc.qo_len = c.qo_len;
  wc.pool_tokens =
      std::int64_t{c.batch} * ((c.context + c.page_size - 1) / c.page_size) * c.page_size;
  const Workload w = make_workload(wc);
  c.tokens = w.active_tokens;
  const float sm_scale = 0.0625f;

  const Plan fast = plan(
      make_problem(w, c.heads, sm_scale, c.format, w.num_pages, w.kv_indices, DeviceKind::cpu));
  const int total_q = c.batch * c.qo_len;
  Activations acts(total_q, c.heads, DeviceKind::cpu, 0);
  Rng rng(7);
  acts.draw(rng);
  Output out(total_q, c.heads, DeviceKind::cpu, 0);
  out.poison();
  RunArgs args;
  args.q_nope = acts.q_nope_view();
  args.q_pe = acts.q_pe_view();
  args.kv = w.cache().view();
  args.out = out.out_view();
  args.lse = out.lse_view();
  c.fast_s = median_time(budget_s, [&] { run(fast, args); });

  // The reference is one float64 thread: time it on request 0 only and compare its rows.
  Problem p = make_problem(w, c.heads, sm_scale, c.format, w.num_pages,
                           std::span(w.kv_indices).first(static_cast<std::size_t>(w.kv_indptr[1])),
                           DeviceKind::cpu);
  p.qo_indptr = std::span(w.qo_indptr).first(2);
  p.kv_indptr = std::span(w.kv_indptr).first(2);
  p.kv_len = std::span(w.kv_len).first(1);
  PlanOptions ref_options;
  ref_options.cpu_reference = true;
  const Plan ref = plan(p, ref_options);
  Output ref_out(c.qo_len, c.heads, DeviceKind::cpu, 0);
  ref_out.poison();
  RunArgs ref_args = args;
  ref_args.q_nope = make_view(acts.q_nope.data(), DType::bf16, {c.qo_len, c.heads, kDimCkv});
  ref_args.q_pe = make_view(acts.q_pe.data(), DType::bf16, {c.qo_len, c.heads, kDimKpe});
  ref_args.out = ref_out.out_view();
  ref_args.lse = ref_out.lse_view();
  const Clock::time_point start = Clock::now();
  run(ref, ref_args);
  c.ref_s = seconds_since(start);
  c.ref_tokens = w.kv_len[0];
  const std::vector<std::uint16_t> expected = ref_out.host_out();
  const std::vector<std::uint16_t> got = out.host_out();
  c.vs_ref = compare_bf16(std::span(got).first(expected.size()), expected);

  if (baselines) {
    // Gather-then-cast into a bf16 buffer, then the same fast path on bf16.
    Buffer gathered(static_cast<std::size_t>(w.active_pages) * c.page_size * 2 * kDimQk,
                    DeviceKind::cpu);
    const KvCacheView gv = bf16_cache_view(gathered, w.active_pages, c.page_size);
    std::vector<std::int32_t> identity(w.kv_indices.size());
    std::iota(identity.begin(), identity.end(), 0);
    const Plan bf16_plan = plan(make_problem(w, c.heads, sm_scale, KvFormat::bf16, w.active_pages,
                                             identity, DeviceKind::cpu));
    RunArgs bargs = args;
    bargs.kv = gv;
    const KvCacheView src = w.cache().view();
    c.baseline_s = median_time(budget_s, [&] {
      strategies::gather_cast_to_bf16(src, w.kv_indices.data(), w.active_pages, gv);
      run(bf16_plan, bargs);
    });
  }
}

int run_cpu_bench(const BenchOptions& o) {
  std::vector<int> batches = o.batches, heads = o.heads, contexts = o.contexts;
  std::vector<int> pages = o.page_sizes;
  if (batches.empty()) batches = o.quick ? std::vector<int>{4} : std::vector<int>{1, 16};
  if (heads.empty()) heads = o.quick ? std::vector<int>{8} : std::vector<int>{8, 128};
  if (contexts.empty()) contexts = {4096};
  if (pages.empty()) pages = o.quick ? std::vector<int>{64} : std::vector<int>{64, 1};
  const std::vector<int> qo_lens = o.qo_lens.empty() ? std::vector<int>{1} : o.qo_lens;
  std::vector<KvFormat> formats;
  for (const std::string& f : o.formats) formats.push_back(parse_format(f));
  if (formats.empty()) formats = {KvFormat::fp8_e4m3, KvFormat::fp8_e4m3_block, KvFormat::bf16};
  for (const int p : pages) {
    if ((p & (p - 1)) != 0) {
      throw UsageError("fp8mla bench: --page-size: expected powers of two in [1, 128], got " +
                       std::to_string(p));
    }
  }

  std::vector<CpuCase> cases;
  for (const KvFormat f : formats)
    for (const int b : batches)
      for (const int h : heads)
        for (const int ctx : contexts)
          for (const int qo : qo_lens)
            for (const int p : pages) {
              CpuCase c;
              c.format = f;
              c.batch = b;
              c.heads = h;
              c.context = ctx;
              c.qo_len = qo;
              c.page_size = p;
              cases.push_back(c);
            }

  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::printf("fp8mla bench (cpu, %u threads): the library's fast path vs its float64 reference\n",
              threads);
  std::printf(
      "  GB/s counts the format's KV bytes of every context token once (the FP8 floor's "
      "measure);\n  the reference runs on request 0 only (one thread)%s\n\n",
      o.no_baselines ? "" : "; gather+cast = gather the pages to bf16, then the fast path");
  std::printf("%-15s %4s %5s %7s %3s %4s %11s %8s %9s %8s %9s %9s\n", "format", "bs", "heads",
              "ctx", "qo", "page", "fast us", "GB/s", "ref GB/s", "fast/ref",
              o.no_baselines ? "" : "g+c us", "rel L2");
  Progress progress("fp8mla bench", static_cast<std::int64_t>(cases.size()), !o.no_progress);
  progress.update(0);
  bool ok = true;
  const double budget = o.quick ? 0.1 : 0.4;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    CpuCase& c = cases[i];
    run_cpu_case(c, !o.no_baselines, budget);
    progress.clear();
    const double tb = static_cast<double>(token_bytes(c.format));
    const double gbs = static_cast<double>(c.tokens) * tb / c.fast_s / 1e9;
    const double ref_gbs = static_cast<double>(c.ref_tokens) * tb / c.ref_s / 1e9;
    const bool case_ok = passes(c.vs_ref, kReferenceTol);
    ok = ok && case_ok;
    std::printf("%-15s %4d %5d %7d %3d %4d %11s %8s %9s %8s %9s %9s%s\n", format_name(c.format),
                c.batch, c.heads, c.context, c.qo_len, c.page_size,
                format_fixed(c.fast_s * 1e6, 1).c_str(), format_fixed(gbs, 2).c_str(),
                format_fixed(ref_gbs, 3).c_str(), format_fixed(gbs / ref_gbs, 1).c_str(),
                o.no_baselines ? "" : format_fixed(c.baseline_s * 1e6, 1).c_str(),
                format_sci(c.vs_ref.rel_l2).c_str(), case_ok ? "" : "  FAILED");
    std::fflush(stdout);
    progress.update(static_cast<std::int64_t>(i + 1));
  }
  progress.finish();
  std::printf("\n%s: fast path vs reference rel L2 within %s in every case\n", ok ? "OK" : "FAILED",
              format_sci(kReferenceTol).c_str());

  if (!o.json.empty()) {
    JsonWriter j;
    j.begin_object().value("command", "bench").value("device", "cpu").value("ok", ok);
    j.value("threads", static_cast<int>(threads)).begin_array("cases");
    for (const CpuCase& c : cases) {
      const double tb = static_cast<double>(token_bytes(c.format));
      j.begin_object().value("format", format_name(c.format)).value("batch", c.batch);
      j.value("heads", c.heads).value("context", c.context).value("qo_len", c.qo_len);
      j.value("page_size", c.page_size);
      j.value("fast_us", c.fast_s * 1e6);
      j.value("fast_gbps", static_cast<double>(c.tokens) * tb / c.fast_s / 1e9);
      j.value("reference_gbps", static_cast<double>(c.ref_tokens) * tb / c.ref_s / 1e9);
      if (!o.no_baselines) j.value("gather_cast_us", c.baseline_s * 1e6);
      j.value("rel_l2_vs_reference", c.vs_ref.rel_l2).end_object();
    }
    j.end_array().end_object();
    j.save(o.json);
  }
  if (!o.plot.empty()) {
    RooflineData d;
    d.title = "fp8mla bench (cpu, " + std::to_string(threads) + " threads): the fast path";
    d.device = "this CPU";
    d.read_gbs = measure_cpu_read_gbs(threads);
    d.note =
        "bytes: the format's KV bytes of every context token once; gather+cast counts the "
        "same bytes (it moves more)";
    for (const CpuCase& c : cases) {
      const double tb = static_cast<double>(token_bytes(c.format));
      const double bytes = static_cast<double>(c.tokens) * tb;
      const double flops =
          bench::causal_attention_flops(static_cast<double>(c.tokens), c.batch, c.qo_len, c.heads);
      const std::string label = "bs " + std::to_string(c.batch) + ", " + std::to_string(c.heads) +
                                " heads, ctx " + std::to_string(c.context) + ", page " +
                                std::to_string(c.page_size);
      d.points.push_back({roofline_series("native", format_name(c.format), ""), flops / bytes,
                          flops / c.fast_s / 1e12, label});
      if (c.baseline_s > 0) {
        d.points.push_back({roofline_series("gather_cast", format_name(c.format), ""),
                            flops / bytes, flops / c.baseline_s / 1e12, label});
      }
    }
    plot_roofline(d, o.plot);
  }
  return ok ? 0 : 1;
}

}  // namespace

int run_bench(std::span<const std::string_view> argv) {
  BenchOptions o;
  ArgParser ap("fp8mla bench",
               "Benchmarks MLA decode. With a CUDA device: measures the device's copy / read /\n"
               "matmul ceilings, then the peers' grid (batch x heads x context x page size x\n"
               "format, plus the cast-pool and gather-then-cast baselines) in CUDA graphs, each\n"
               "call reading a different region of a pool far larger than L2; with --sparse,\n"
               "the sparse top-k grid instead. Without one: the CPU fast path against the\n"
               "float64 reference, per format.");
  ap.add_flag("quick", &o.quick, "a short run (about a minute): fewer cases and repetitions");
  ap.add_int_list("batch", &o.batches, "batch sizes", 1, 4096);
  ap.set_default_text("batch", "gpu: 1,16,64,128; cpu: 1,16 (quick: 4)");
  ap.add_int_list("heads", &o.heads, "query heads per request", 1, kMaxHeads);
  ap.set_default_text("heads", "gpu: 8,16,128; --sparse: 8,16,64,128; cpu: 8,128 (quick: 8)");
  ap.add_int_list("context", &o.contexts, "context lengths in tokens", 1, 1 << 24);
  ap.set_default_text("context", "gpu: 4096,32768,131072 at bs 1, 4096/8192 otherwise; cpu: 4096");
  ap.add_int_list("page-size", &o.page_sizes, "page sizes (powers of two)", 1, kMaxPageSize);
  ap.set_default_text("page-size", "64,1 (cpu quick: 64); --sparse: 1,64 (quick: 64)");
  ap.add_int_list("qo-len", &o.qo_lens,
                  "query tokens a request, causal (MTP / speculative verify: 2-8; larger for "
                  "chunked prefill); none above the shortest context",
                  1, 4096);
  ap.set_default_text("qo-len", "1 (decode); --sparse: 1,2 (MTP)");
  ap.add_choice_list("format", &o.formats, {"fp8_e4m3", "fp8_e4m3_block", "bf16"}, "KV formats");
  ap.set_default_text("format", "all three; --sparse: fp8_e4m3_block,fp8_e4m3");
  ap.add_flag("sparse", &o.sparse,
              "cuda: the sparse top-k grid (DeepSeek sparse attention) instead of the dense one: "
              "each query token reads its own --topk slots, drawn over the whole pool (>= 1M "
              "tokens; k / 20 of them -1), batch x heads x qo-len x page size x format; "
              "--quick: 5 (k, heads, batch) cases at qo 1 and 2, pages of 64");
  ap.add_int_list("topk", &o.topks, "--sparse: slots each query token reads", 1, 1 << 16);
  ap.set_default_text("topk", "2048,512");
  ap.add_flag("no-baselines", &o.no_baselines, "skip the cast-pool / gather-then-cast baselines");
  ap.add_string("json", &o.json, "FILE", "also write the results as JSON to FILE");
  ap.add_string("plot", &o.plot, "FILE.svg",
                "also draw the roofline to FILE.svg: each case's achieved TF/s at its flops per "
                "KV byte, against the measured ceilings (GPU: read, copy, bf16 matmul; CPU: a "
                "streaming read measured here), one series per strategy and format");
  ap.add_flag("no-progress", &o.no_progress, "no progress bar on stderr");
  ap.add_choice("device", &o.device, {"auto", "cpu", "cuda"},
                "what to benchmark (auto: cuda when a device is visible)");
  ap.add_int("min-chunk", &o.min_chunk,
             "cuda: split no request finer than this many tokens (PlanOptions::min_chunk_tokens; "
             "0: the planner's default)",
             0, 1 << 24);
  ap.add_flag("exact-scores", &o.exact_scores,
              "cuda: PlanOptions::exact_scores (fp8_e4m3 scores off the fp8 tensor cores)");
  ap.add_flag("f16", &o.f16,
              "cuda, the dense grid without baselines: fp16 queries and outputs (an fp16 model's "
              "plans: Problem::q_dtype and out_dtype f16) instead of bf16");
  ap.add_flag("graph-plans", &o.graph_plans,
              "cuda, the dense grid: native plans made as an engine's CUDA-graph plans are "
              "(PlanOptions::cuda_graph, capacities = the case), whose kernels and merge are "
              "fixed at capture");
  ap.add_int("max-tile-rows", &o.max_tile_rows,
             "cuda: rows (heads x query tokens) a tile packs at most (PlanOptions::max_tile_rows; "
             "0: the planner's choice); 16 puts multi-token rows of <= 16 heads on the <= 16-row "
             "kernels",
             0, kMaxRowsPerTile);
  ap.add_int("cp", &o.cp,
             "cuda: context parallelism instead of the grid: one request (batch 1) decoded with "
             "its context spread over this many GPUs (one process a GPU, NCCL), against one GPU; "
             "defaults then: --context 131072,262144,524288,1048576 --heads 8 --page-size 64 "
             "--format fp8_e4m3",
             0, 8);
  ap.add_int("cp-rank", &o.cp_rank, "internal: the rank of a process --cp started", -1, 7);
  ap.add_string("cp-id", &o.cp_id, "HEX", "internal: the NCCL id --cp's launcher made");
  ap.hide("cp-rank");  // --cp's launcher passes them to the processes it starts
  ap.hide("cp-id");
  ap.set_epilog(
      "examples:\n  fp8mla bench --quick\n"
      "  fp8mla bench --batch 1,64 --heads 8 --context 4096 --format fp8_e4m3\n"
      "  fp8mla bench --sparse --topk 2048 --heads 8,64 --batch 128 --json sparse.json\n"
      "  fp8mla bench --cp 2 --quick");
  if (!ap.parse(argv)) return 0;
  if (!o.json.empty() && o.cp_rank < 0) require_writable("fp8mla bench", "--json", o.json);
  if (!o.plot.empty() && o.cp_rank < 0) require_writable("fp8mla bench", "--plot", o.plot);
  if (o.device == "cuda") require_cuda_device();

  if (!o.sparse && ap.given("topk")) throw UsageError("fp8mla bench: --topk: only with --sparse");
  if (o.sparse) {
    if (o.cp > 0 || o.cp_rank >= 0)
      throw UsageError("fp8mla bench: --sparse: not with --cp (it times one dense request)");
    if (ap.given("context")) {
      throw UsageError(
          "fp8mla bench: --context: not with --sparse (a query token reads its --topk slots, "
          "drawn over the whole pool)");
    }
    if (o.no_baselines)
      throw UsageError("fp8mla bench: --no-baselines: --sparse runs no baselines");
    if (o.device == "cpu")
      throw UsageError("fp8mla bench: --device cpu: --sparse runs on a CUDA device");
  }

  if (o.f16) {
    if (o.sparse || o.cp > 0 || o.cp_rank >= 0 || !o.no_baselines || o.device == "cpu") {
      throw UsageError(
          "fp8mla bench: --f16: the dense CUDA grid with --no-baselines only (the baselines plan "
          "bf16 queries)");
    }
  }

  if (o.graph_plans && (o.sparse || o.cp > 0 || o.cp_rank >= 0 || o.device == "cpu")) {
    throw UsageError("fp8mla bench: --graph-plans: the dense CUDA grid only");
  }

  if (o.cp > 0 || o.cp_rank >= 0) {
    if (o.cp < 1) throw UsageError("fp8mla bench: --cp-rank: only with --cp");
    if (ap.given("batch"))
      throw UsageError("fp8mla bench: --batch: not with --cp (it times one request, batch 1)");
    for (const char* name : {"qo-len", "max-tile-rows"}) {
      if (ap.given(name)) {
        throw UsageError(std::string("fp8mla bench: --") + name +
                         ": not with --cp (it times one query token)");
      }
    }
    if (o.no_baselines) throw UsageError("fp8mla bench: --no-baselines: --cp runs no baselines");
    if (!o.plot.empty())
      throw UsageError("fp8mla bench: --plot: not with --cp (it draws the grid)");
    if (o.device == "cpu") throw UsageError("fp8mla bench: --device cpu: --cp runs on CUDA GPUs");
    if (o.cp_rank < 0) return launch_ranks(o.cp, argv);
    if (o.cp_rank >= o.cp)
      throw UsageError("fp8mla bench: --cp-rank: expected 0.." + std::to_string(o.cp - 1));
    bench::CpBenchOptions c;
    c.rank = o.cp_rank;
    c.world = o.cp;
    c.id = id_from_hex(o.cp_id);
    c.quick = o.quick;
    c.heads = o.heads;
    c.contexts = o.contexts;
    c.page_sizes = o.page_sizes;
    for (const std::string& f : o.formats) c.formats.push_back(parse_format(f));
    c.json_path = o.json;
    c.progress = !o.no_progress;
    c.min_chunk_tokens = o.min_chunk;
    c.exact_scores = o.exact_scores;
    return bench::run_cp_bench(c);
  }

  // Causal query tokens need as many cache tokens (the default contexts are all >= 4096).
  const int shortest = o.contexts.empty() ? 4096 : *std::ranges::min_element(o.contexts);
  for (const int qo : o.qo_lens) {
    if (!o.sparse && qo > shortest) {
      throw UsageError("fp8mla bench: --qo-len: " + std::to_string(qo) +
                       " is more than the shortest --context, " + std::to_string(shortest));
    }
  }
  const bool gpu = o.device == "cuda" || (o.device == "auto" && cuda_available());
  if ((o.sparse || o.f16 || o.graph_plans) && !gpu) {
    const std::string why = detail::cuda_unavailable_reason();
    const char* flag = o.sparse ? "--sparse" : o.f16 ? "--f16" : "--graph-plans";
    const char* grid = o.sparse ? "the sparse top-k grid"
                       : o.f16  ? "the fp16 grid"
                                : "the graph-mode plans' grid";
    throw Error(ErrorCode::unsupported, flag,
                std::string(grid) + " runs on a CUDA device: " +
                    (why.empty() ? std::string("none is visible") : why));
  }
  if (gpu) {
    bench::GpuBenchOptions g;
    g.quick = o.quick;
    g.batches = o.batches;
    g.heads = o.heads;
    g.contexts = o.contexts;
    g.page_sizes = o.page_sizes;
    g.qo_lens = o.qo_lens;
    for (const std::string& f : o.formats) g.formats.push_back(parse_format(f));
    g.sparse = o.sparse;
    g.topks = o.topks;
    g.baselines = !o.no_baselines;
    g.json_path = o.json;
    g.progress = !o.no_progress;
    g.min_chunk_tokens = o.min_chunk;
    g.exact_scores = o.exact_scores;
    g.max_tile_rows = o.max_tile_rows;
    g.f16 = o.f16;
    g.graph_plans = o.graph_plans;
    bench::GpuBenchSummary summary;
    if (!o.plot.empty()) g.summary = &summary;
    const int rc = bench::run_gpu_bench(g);
    if (!o.plot.empty()) plot_roofline(roofline_from_gpu(summary), o.plot);
    return rc;
  }
  if (o.device == "auto") {
    std::printf("note: the GPU grid needs a CUDA device (%s); running the CPU bench instead\n\n",
                detail::cuda_built() ? "this build has the CUDA backend but sees no device"
                                     : "this build has no CUDA backend: -DFP8MLA_CUDA=ON");
  }
  return run_cpu_bench(o);
}

}  // namespace fp8mla::cli
