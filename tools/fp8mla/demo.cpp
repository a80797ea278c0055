// `fp8mla demo`: the story in one decode step.
//
// A GLM-5-shaped attention stack reads a paged FP8 latent pool. The bug this project exists for:
// the serving engine cast the whole pool to bf16 in every layer before attention ran (70 ms per
// step on an H200 at 495,040 tokens). The demo runs one step through every layer three ways on
// the same inputs: (1) cast the pool, then attend on bf16; (2) gather the active pages, casting
// on the way, then attend; (3) attend on the FP8 cache directly. It checks that the three agree
// (they read identical dequantized values) and prints bytes moved, time and speedup.
#include <unistd.h>

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
#include "tools/fp8mla/args.h"
#include "tools/fp8mla/commands.h"
#include "tools/fp8mla/demo_plot.h"
#include "tools/fp8mla/util.h"
#include "tools/fp8mla/workload.h"

namespace fp8mla::cli {
namespace {

// All three strategies read bit-identical dequantized values, so they differ only by
// accumulation order and the final bf16 rounding (~4e-3 relative per element at worst);
// 1e-2 leaves room for that and catches any real disagreement (a wrong page, scale or row is
// off by O(1)).
constexpr double kAgreeTol = 1e-2;
// The fast path against the float64 reference: fp32 accumulation plus bf16 output rounding.
constexpr double kReferenceTol = 1e-2;
// lse is float32 natural log; the paths differ by fp32 summation order only.
constexpr double kLseTol = 1e-3;

struct DemoOptions {
  std::string model = "glm-5";
  int layers = 0;  // 0 = the model's
  int batch = 0;   // 0 = the device's default
  int context = 0;
  int qo_len = 1;  // query tokens a request (> 1: MTP / speculative verify, causal)
  std::int64_t pool = 0;
  int page_size = 1;
  std::string format = "fp8_e4m3";
  std::string device = "auto";
  std::int64_t seed = 1;
  int show_layers = 4;
  std::string json;
  std::string plot;  // --plot: the three strategies per layer, as SVG
  bool no_progress = false;
};

// Defaults: the story's full pool, and a batch sized so that the whole run takes well under a
// minute on 2 CPU cores (~15 s: attention, not the cast, dominates on a CPU).
constexpr int kCpuBatch = 8, kCpuContext = 4096;
constexpr int kGpuBatch = 64, kGpuContext = 4096;

struct LayerResult {
  double cast_s = 0, cast_attend_s = 0;      // (1)
  double gather_s = 0, gather_attend_s = 0;  // (2)
  double native_s = 0;                       // (3)
  Comparison out1, out2, lse1, lse2;         // (1), (2) against (3)
  double total1() const { return cast_s + cast_attend_s; }
  double total2() const { return gather_s + gather_attend_s; }
};

// Times fn() between two device synchronisations (a CPU call is synchronous anyway).
template <class Fn>
double timed(DeviceKind device, int device_id, Fn&& fn) {
  synchronize(device, device_id);
  const Clock::time_point start = Clock::now();
  fn();
  synchronize(device, device_id);
  return seconds_since(start);
}

std::string ms(double seconds) {
  return format_fixed(seconds * 1e3, 2);
}
std::string speedup(double base, double t) {
  return format_fixed(base / t, 1) + "x";
}

// The story's pool, halved until the buffers it needs on the host (the FP8 pool, and on a CPU
// run its bf16 cast) fit in a quarter of this machine's memory.
std::int64_t fit_pool(KvFormat format, DeviceKind device) {
  const long pages = sysconf(_SC_PHYS_PAGES), page_bytes = sysconf(_SC_PAGE_SIZE);
  const double budget = pages > 0 && page_bytes > 0
                            ? static_cast<double>(pages) * static_cast<double>(page_bytes) / 4
                            : 1e9;
  const double per_token =
      static_cast<double>(token_bytes(format)) + (device == DeviceKind::cpu ? 2.0 * kDimQk : 0.0);
  std::int64_t pool = kStoryPoolTokens;
  while (pool > 65536 && static_cast<double>(pool) * per_token > budget) pool /= 2;
  return pool;
}

// float64 reference on the host copy of the pool for the first requests of layer 0 (up to ~16K
// tokens: the reference is one thread), compared with strategy (3)'s output for those rows.
Comparison check_reference(const Workload& w, const ModelPreset& model, int heads,
                           const Activations& acts, const std::vector<std::uint16_t>& native_out,
                           int* checked_requests) {
  int k = 0;
  std::int64_t tokens = 0;
  while (k < w.batch() && (k == 0 || tokens + w.kv_len[static_cast<std::size_t>(k)] <= 16384)) {
    tokens += w.kv_len[static_cast<std::size_t>(k)];
    ++k;
  }
  *checked_requests = k;
  Problem p =
      make_problem(w, heads, model.sm_scale, w.config.format, w.num_pages,
                   std::span(w.kv_indices)
                       .first(static_cast<std::size_t>(w.kv_indptr[static_cast<std::size_t>(k)])),
                   DeviceKind::cpu);
  p.qo_indptr = std::span(w.qo_indptr).first(static_cast<std::size_t>(k) + 1);
  p.kv_indptr = std::span(w.kv_indptr).first(static_cast<std::size_t>(k) + 1);
  p.kv_len = std::span(w.kv_len).first(static_cast<std::size_t>(k));
  PlanOptions options;
  options.cpu_reference = true;
  const Plan ref_plan = plan(p, options);

  const int rows = w.qo_indptr[static_cast<std::size_t>(k)];  // the k requests' query tokens
  Output ref(rows, heads, DeviceKind::cpu, 0);
  ref.poison();
  RunArgs args;
  auto* qn = const_cast<std::uint16_t*>(acts.host_q_nope.data());
  auto* qp = const_cast<std::uint16_t*>(acts.host_q_pe.data());
  args.q_nope = make_view(qn, DType::bf16, {rows, heads, kDimCkv});
  args.q_pe = make_view(qp, DType::bf16, {rows, heads, kDimKpe});
  args.kv = w.host_cache->view();
  args.out = ref.out_view();
  args.lse = ref.lse_view();
  run(ref_plan, args);
  const std::vector<std::uint16_t> ref_out = ref.host_out();
  return compare_bf16(std::span(native_out).first(ref_out.size()), ref_out);
}

}  // namespace

int run_demo(std::span<const std::string_view> argv) {
  DemoOptions o;
  std::vector<std::string> formats = {"fp8_e4m3", "fp8_e4m3_block", "bf16"};
  ArgParser ap("fp8mla demo",
               "Replays the story: one decode step of a GLM-5-shaped MLA stack over a paged FP8\n"
               "pool, done three ways on the same inputs: (1) cast the whole pool to bf16 and\n"
               "attend, (2) gather the active pages to bf16 and attend, (3) attend on the FP8\n"
               "cache directly. Checks that all three agree; prints bytes, time and speedup.");
  ap.add_choice("model", &o.model, model_names(), "attention shape preset: layers, heads per GPU at TP8, softmax scale");
  ap.add_int("layers", &o.layers, "layers in the step", 1, 1000);
  ap.set_default_text("layers", "the model's: 78 for glm-5, 61 for the others");
  ap.add_int("batch", &o.batch, "decode requests in the batch", 1, 4096);
  ap.set_default_text("batch", "8 on cpu, 64 on cuda");
  ap.add_int("context", &o.context, "mean context length in tokens (ragged: 0.25x..1.75x)", 1,
             1 << 20);
  ap.set_default_text("context", "4096");
  ap.add_int("qo-len", &o.qo_len,
             "query tokens a request, causal (MTP / speculative verify: 2 = one draft token)", 1,
             64);
  ap.add_int64("pool", &o.pool, "tokens in the FP8 pool", 1, std::int64_t{1} << 31);
  ap.set_default_text("pool", "495040, the story's; halved while it needs > 1/4 of the RAM");
  ap.add_int("page-size", &o.page_size, "tokens per page, a power of two", 1, 128);
  ap.add_choice("format", &o.format, formats,
                "pool format (bf16 runs the same steps on a bf16 pool, for reference)");
  ap.add_choice("device", &o.device, {"auto", "cpu", "cuda"},
                "where to run (auto: cuda when a device is visible)");
  ap.add_int64("seed", &o.seed, "random seed for contexts, pages and values", 0,
               std::int64_t{1} << 62);
  ap.add_int("show-layers", &o.show_layers, "layers printed before the mean row", 0, 1000);
  ap.add_string("json", &o.json, "FILE", "also write the results as JSON to FILE");
  ap.add_string("plot", &o.plot, "FILE.svg",
                "also draw the three strategies per layer (cast or gather stacked under its "
                "attention, native beside them) and the step's totals to FILE.svg");
  ap.add_flag("no-progress", &o.no_progress, "no progress bar on stderr");
  ap.set_epilog(
      "Exit status: 0 when the three strategies agree, 1 when they do not (or on an error),\n"
      "2 for a bad command line.\n\n"
      "examples:\n"
      "  fp8mla demo\n"
      "  fp8mla demo --model kimi-k2 --batch 16 --context 8192 --pool 262144\n"
      "  fp8mla demo --format fp8_e4m3_block --page-size 64 --json demo.json\n"
      "  fp8mla demo --layers 12 --plot demo.svg");
  if (!ap.parse(argv)) return 0;
  if ((o.page_size & (o.page_size - 1)) != 0) {
    throw UsageError("fp8mla demo: --page-size: expected a power of two in [1, 128], got " +
                     std::to_string(o.page_size) + " (see 'fp8mla demo --help')");
  }
  if (!o.json.empty()) require_writable("fp8mla demo", "--json", o.json);
  if (!o.plot.empty()) require_writable("fp8mla demo", "--plot", o.plot);
  if (o.device == "cuda") require_cuda_device();

  const ModelPreset& model = *find_model(o.model);
  const DeviceKind device = o.device == "cuda"  ? DeviceKind::cuda
                            : o.device == "cpu" ? DeviceKind::cpu
                            : cuda_available()  ? DeviceKind::cuda
                                                : DeviceKind::cpu;
  const bool gpu = device == DeviceKind::cuda;
  const int layers = o.layers > 0 ? o.layers : model.layers;
  const int heads = model.heads_per_gpu;
  WorkloadConfig wc;
  wc.format = parse_format(o.format);
  wc.page_size = o.page_size;
  wc.pool_tokens = o.pool > 0 ? o.pool : fit_pool(wc.format, device);
  wc.batch = o.batch > 0 ? o.batch : gpu ? kGpuBatch : kCpuBatch;
  wc.mean_context = o.context > 0 ? o.context : gpu ? kGpuContext : kCpuContext;
  wc.qo_len = o.qo_len;
  wc.seed = static_cast<std::uint64_t>(o.seed);
  wc.device = device;
  const std::int64_t tb = token_bytes(wc.format);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());

  const Clock::time_point setup_start = Clock::now();
  const Workload w = [&] {
    try {
      return make_workload(wc);
    } catch (const Error& e) {  // a pool too small for the batch: the command line's to fix
      if (e.argument() != "--pool") throw;
      throw UsageError(std::string("fp8mla demo: ") + e.what() + " (see 'fp8mla demo --help')");
    }
  }();
  const std::int64_t pool_tokens = w.num_pages * wc.page_size;
  const auto [min_len, max_len] = std::minmax_element(w.kv_len.begin(), w.kv_len.end());

  std::printf("fp8mla demo: one decode step of %s attention, three ways\n\n",
              std::string(model.display).c_str());
  std::printf(
      "  model    %s: %s, %d heads per GPU (TP8), q/k 576 = 512 + 64, v 512, "
      "sm_scale %g\n",
      std::string(model.display).c_str(), count_of(layers, "layer").c_str(), heads,
      static_cast<double>(model.sm_scale));
  if (gpu) {
    std::printf("  device   cuda:%d\n", wc.device_id);
  } else {
    std::printf("  device   cpu, %s (the library's fast path)\n", count_of(threads, "thread").c_str());
  }
  std::printf("  pool     %s tokens %s (%lld B/token, %s), page size %d\n",
              format_count(pool_tokens).c_str(), format_name(wc.format), static_cast<long long>(tb),
              format_bytes(static_cast<double>(pool_tokens * tb)).c_str(), wc.page_size);
  if (pool_tokens < kStoryPoolTokens) {
    std::printf(
        "           the story's pool is %s tokens: scaled to 1/%.1f (--pool %lld for full "
        "size)\n",
        format_count(kStoryPoolTokens).c_str(),
        static_cast<double>(kStoryPoolTokens) / static_cast<double>(pool_tokens),
        static_cast<long long>(kStoryPoolTokens));
  }
  if (layers > 1) {
    std::printf(
        "           one pool serves all %d layers to save memory (a model has one per "
        "layer);\n           every layer still casts or reads it as its own\n",
        layers);
  }
  std::printf(
      "  batch    %s, ragged contexts %s..%s tokens (mean %s, seed "
      "%lld):\n           %s in %s = %.1f%% of the pool\n",
      count_of(w.batch(), "decode request").c_str(), format_count(*min_len).c_str(),
      format_count(*max_len).c_str(), format_count(wc.mean_context).c_str(),
      static_cast<long long>(o.seed), count_of(w.active_tokens, "active token").c_str(),
      count_of(w.active_pages, "page").c_str(),
      100.0 * static_cast<double>(w.active_tokens) / static_cast<double>(pool_tokens));
  if (wc.qo_len > 1) {
    std::printf("  queries  %d query tokens a request (MTP / speculative verify, causal), ",
                wc.qo_len);
    std::printf("fresh random bf16\n           in every layer\n\n");
  } else {
    std::printf("  queries  fresh random bf16 queries in every layer\n\n");
  }
  std::printf("  (1) cast    cast the whole pool to bf16, then attend on the bf16 cache\n");
  std::printf("  (2) gather  gather the batch's pages into a bf16 buffer (casting), then attend\n");
  std::printf("  (3) native  fp8mla::run straight on the %s cache\n\n", format_name(wc.format));

  // Buffers and plans: made once per step, shared by every layer (as a serving engine does).
  Buffer bf16_pool(static_cast<std::size_t>(pool_tokens) * 2 * kDimQk, device);
  Buffer bf16_gathered(static_cast<std::size_t>(w.active_pages) * wc.page_size * 2 * kDimQk,
                       device);
  Buffer gather_pages(w.kv_indices.size() * sizeof(std::int32_t), device);
  gather_pages.upload(bytes_of(w.kv_indices));
  const KvCacheView pool_view = w.cache().view();
  const KvCacheView bf16_pool_view = bf16_cache_view(bf16_pool, w.num_pages, wc.page_size);
  const KvCacheView gathered_view = bf16_cache_view(bf16_gathered, w.active_pages, wc.page_size);
  std::vector<std::int32_t> identity(w.kv_indices.size());
  std::iota(identity.begin(), identity.end(), 0);

  const Problem problem1 =
      make_problem(w, heads, model.sm_scale, KvFormat::bf16, w.num_pages, w.kv_indices, device);
  const Problem problem2 =
      make_problem(w, heads, model.sm_scale, KvFormat::bf16, w.active_pages, identity, device);
  const Problem problem3 =
      make_problem(w, heads, model.sm_scale, wc.format, w.num_pages, w.kv_indices, device);
  const Plan plan1 = plan(problem1), plan2 = plan(problem2), plan3 = plan(problem3);
  // plan()'s time a step, from a second round: a process's first plans also load the kernels'
  // modules and touch new memory, which a serving step does not pay again.
  const Clock::time_point plan_start = Clock::now();
  for (const Problem* problem : {&problem1, &problem2, &problem3}) (void)plan(*problem);
  const double plan_s = seconds_since(plan_start) / 3;

  const int total_q = w.qo_indptr.back();
  Activations acts(total_q, heads, device, wc.device_id);
  Output out1(total_q, heads, device, wc.device_id), out2(total_q, heads, device, wc.device_id),
      out3(total_q, heads, device, wc.device_id);
  auto args_for = [&](const KvCacheView& kv, const Output& out) {
    RunArgs a;
    a.q_nope = acts.q_nope_view();
    a.q_pe = acts.q_pe_view();
    a.kv = kv;
    a.out = out.out_view();
    a.lse = out.lse_view();
    return a;
  };
  const RunArgs args1 = args_for(bf16_pool_view, out1);
  const RunArgs args2 = args_for(gathered_view, out2);
  const RunArgs args3 = args_for(pool_view, out3);
  const double setup_s = seconds_since(setup_start);

  Rng qrng(wc.seed ^ 0x5eedc0ffee ^ 0x9e37u);
  std::vector<LayerResult> results(static_cast<std::size_t>(layers));
  Comparison ref_check;
  int ref_requests = 0;
  // One untimed pass of every strategy first: the first CUDA launches load modules and the
  // first CPU touches fault pages in, neither of which a serving step pays.
  acts.draw(qrng);
  strategies::cast_pool_to_bf16(pool_view, bf16_pool_view);
  run(plan1, args1);
  strategies::gather_cast_to_bf16(pool_view, static_cast<const std::int32_t*>(gather_pages.data()),
                                 w.active_pages, gathered_view);
  run(plan2, args2);
  run(plan3, args3);
  synchronize(device, wc.device_id);

  Progress progress("fp8mla demo: layers", layers, !o.no_progress);
  progress.update(0);
  const Clock::time_point run_start = Clock::now();
  for (int layer = 0; layer < layers; ++layer) {
    LayerResult& r = results[static_cast<std::size_t>(layer)];
    acts.draw(qrng);
    for (Output* out : {&out1, &out2, &out3}) out->poison();
    const int id = wc.device_id;
    // (3) first: it then never finds the pool warm from the other strategies' reads of it.
    r.native_s = timed(device, id, [&] { run(plan3, args3); });
    r.cast_s = timed(device, id, [&] { strategies::cast_pool_to_bf16(pool_view, bf16_pool_view); });
    r.cast_attend_s = timed(device, id, [&] { run(plan1, args1); });
    r.gather_s = timed(device, id, [&] {
      strategies::gather_cast_to_bf16(pool_view,
                                     static_cast<const std::int32_t*>(gather_pages.data()),
                                     w.active_pages, gathered_view);
    });
    r.gather_attend_s = timed(device, id, [&] { run(plan2, args2); });

    const std::vector<std::uint16_t> o3 = out3.host_out();
    const std::vector<float> l3 = out3.host_lse();
    r.out1 = compare_bf16(out1.host_out(), o3);
    r.out2 = compare_bf16(out2.host_out(), o3);
    r.lse1 = compare_f32(out1.host_lse(), l3);
    r.lse2 = compare_f32(out2.host_lse(), l3);
    if (layer == 0) ref_check = check_reference(w, model, heads, acts, o3, &ref_requests);
    progress.update(layer + 1);
  }
  progress.finish();
  const double run_s = seconds_since(run_start);

  // ---- report ----
  const bool ref_ok = passes(ref_check, kReferenceTol);
  std::printf(
      "check: float64 reference vs (3) on layer 0, requests 0..%d: rel L2 %s (tol %s) "
      "%s\n\n",
      ref_requests - 1, format_sci(ref_check.rel_l2).c_str(), format_sci(kReferenceTol).c_str(),
      ref_ok ? "ok" : "FAILED");
  std::printf("%s\n",
              " layer       (1) ms        (2) ms         (3) ms   (3) vs (1)  (3) vs (2)"
              "   rel L2 (1)  rel L2 (2)");
  LayerResult mean;
  double worst_out = 0.0, worst_lse = 0.0;
  bool agree = true;
  for (int layer = 0; layer < layers; ++layer) {
    const LayerResult& r = results[static_cast<std::size_t>(layer)];
    mean.cast_s += r.cast_s / layers;
    mean.cast_attend_s += r.cast_attend_s / layers;
    mean.gather_s += r.gather_s / layers;
    mean.gather_attend_s += r.gather_attend_s / layers;
    mean.native_s += r.native_s / layers;
    worst_out = std::max({worst_out, r.out1.rel_l2, r.out2.rel_l2});
    worst_lse = std::max({worst_lse, r.lse1.max_abs, r.lse2.max_abs});
    agree = agree && passes(r.out1, kAgreeTol) && passes(r.out2, kAgreeTol) &&
            r.lse1.nan_mismatch == 0 && r.lse2.nan_mismatch == 0 && r.lse1.max_abs <= kLseTol &&
            r.lse2.max_abs <= kLseTol;
    if (layer < o.show_layers || (layer == layers - 1 && layers > o.show_layers)) {
      if (layer == layers - 1 && layers > o.show_layers + 1) {
        std::printf("   ...  (%d more layers)\n", layers - o.show_layers - 1);
      }
      std::printf("%6d %12s %14s %14s %12s %11s %12s %11s\n", layer, ms(r.total1()).c_str(),
                  ms(r.total2()).c_str(), ms(r.native_s).c_str(),
                  speedup(r.total1(), r.native_s).c_str(), speedup(r.total2(), r.native_s).c_str(),
                  format_sci(r.out1.rel_l2).c_str(), format_sci(r.out2.rel_l2).c_str());
    }
  }
  std::printf("%6s %12s %14s %14s %12s %11s\n\n", "mean", ms(mean.total1()).c_str(),
              ms(mean.total2()).c_str(), ms(mean.native_s).c_str(),
              speedup(mean.total1(), mean.native_s).c_str(),
              speedup(mean.total2(), mean.native_s).c_str());

  // Bytes each strategy moves per layer (KV bytes only; q and o are the same for all three and
  // small): a cast reads the source token and writes a bf16 one, attention reads every token
  // of every request once.
  const double attend_bf16 = static_cast<double>(w.active_tokens) * 2 * kDimQk;
  const double bytes1 =
      static_cast<double>(pool_tokens) * static_cast<double>(tb + 2 * kDimQk) + attend_bf16;
  const double bytes2 =
      static_cast<double>(w.active_pages * wc.page_size) * static_cast<double>(tb + 2 * kDimQk) +
      attend_bf16;
  const double bytes3 = static_cast<double>(w.active_tokens * tb);
  const double step1 = mean.total1() * layers, step2 = mean.total2() * layers;
  const double step3 = mean.native_s * layers;
  std::printf("%-31s KV bytes moved    time ms     GB/s   speedup vs (1)\n",
              ("per step (" + count_of(layers, "layer") + ")").c_str());
  auto row = [&](const char* name, double bytes, double t, const std::string& note) {
    std::printf("  %-28s %14s %10s %8s %10s%s\n", name, format_bytes(bytes * layers).c_str(),
                format_fixed(t * 1e3, 1).c_str(), format_fixed(bytes * layers / t / 1e9, 1).c_str(),
                speedup(step1, t).c_str(), note.c_str());
  };
  row("(1) cast pool, attend bf16", bytes1, step1,
      "   (cast " + format_fixed(mean.cast_s * layers * 1e3, 1) + " ms)");
  row("(2) gather+cast, attend bf16", bytes2, step2,
      "   (gather " + format_fixed(mean.gather_s * layers * 1e3, 1) + " ms)");
  row("(3) native FP8", bytes3, step3, "");
  const double flops3 = bench::causal_attention_flops(static_cast<double>(w.active_tokens),
                                                      w.batch(), wc.qo_len, heads);
  if (gpu) {
    std::printf(
        "\n  decode attention is memory-bound on a GPU: (3) moves %.1fx fewer bytes than (1)"
        " and %.1fx fewer than (2)\n",
        bytes1 / bytes3, bytes2 / bytes3);
  } else {
    std::printf(
        "\n  on a GPU decode attention is memory-bound and time follows the bytes: (3) moves %.1fx"
        "\n  fewer than (1) and %.1fx fewer than (2). On this CPU attention itself is "
        "compute-bound\n  (%.1f GFLOP/s in (3)), so only the cast's own time shows in the "
        "speedup.\n",
        bytes1 / bytes3, bytes2 / bytes3, flops3 / mean.native_s / 1e9);
  }
  std::printf("\n  plan: %.3f ms per strategy, once per step for all layers (not in the times)\n",
              plan_s * 1e3);
  std::printf("  setup %.1f s, %s x 3 strategies %.1f s\n", setup_s,
              count_of(layers, "layer").c_str(), run_s);
  // The story's figure for the chosen model and format: its layers' casts of the whole pool at
  // the rate an engine's cast reached on an H200 (kStoryCastBytesPerSecond).
  const double story_cast =
      static_cast<double>(kStoryPoolTokens) * static_cast<double>(tb + 2 * kDimQk) * model.layers;
  std::printf(
      "  at the story's scale (a %s-token pool, %s's %s) (1)'s cast alone\n"
      "  moves %s a step: %s ms (%.2f ms a layer) at the %.2f TB/s an engine's bf16 cast\n"
      "  reached on an H200\n\n",
      format_count(kStoryPoolTokens).c_str(), std::string(model.display).c_str(),
      count_of(model.layers, "layer").c_str(), format_bytes(story_cast).c_str(),
      format_fixed(story_cast / kStoryCastBytesPerSecond * 1e3, 1).c_str(),
      story_cast / model.layers / kStoryCastBytesPerSecond * 1e3, kStoryCastBytesPerSecond / 1e12);

  const bool ok = agree && ref_ok;
  if (ok) {
    std::printf(
        "OK: the three strategies agree (max rel L2 vs (3) %s, tol %s; max |lse diff| %s, "
        "tol %s)\n",
        format_sci(worst_out).c_str(), format_sci(kAgreeTol).c_str(), format_sci(worst_lse).c_str(),
        format_sci(kLseTol).c_str());
  } else {
    std::printf(
        "FAILED: the strategies disagree (max rel L2 vs (3) %s, tol %s; max |lse diff| "
        "%s, tol %s; reference rel L2 %s)\n",
        format_sci(worst_out).c_str(), format_sci(kAgreeTol).c_str(), format_sci(worst_lse).c_str(),
        format_sci(kLseTol).c_str(), format_sci(ref_check.rel_l2).c_str());
  }

  if (!o.json.empty()) {
    JsonWriter j;
    j.begin_object();
    j.value("command", "demo").value("ok", ok).value("model", model_key(model));
    j.value("layers", layers).value("heads", heads).value("sm_scale", double{model.sm_scale});
    j.value("device", device_name(device)).value("format", format_name(wc.format));
    j.value("pool_tokens", pool_tokens).value("page_size", wc.page_size);
    j.value("batch", w.batch()).value("mean_context", wc.mean_context);
    j.value("qo_len", wc.qo_len);
    j.value("active_tokens", w.active_tokens).value("seed", o.seed);
    j.begin_object("tolerances")
        .value("rel_l2", kAgreeTol)
        .value("reference_rel_l2", kReferenceTol);
    j.value("lse_abs", kLseTol).end_object();
    j.begin_object("reference").value("requests", ref_requests).value("rel_l2", ref_check.rel_l2);
    j.end_object();
    j.begin_object("bytes_per_layer").value("cast", bytes1).value("gather", bytes2);
    j.value("native", bytes3).end_object();
    j.begin_object("step_ms").value("cast", step1 * 1e3).value("gather", step2 * 1e3);
    j.value("native", step3 * 1e3).value("plan_per_strategy", plan_s * 1e3).end_object();
    j.begin_array("per_layer");
    for (const LayerResult& r : results) {
      j.begin_object()
          .value("cast_ms", r.cast_s * 1e3)
          .value("cast_attend_ms", r.cast_attend_s * 1e3);
      j.value("gather_ms", r.gather_s * 1e3).value("gather_attend_ms", r.gather_attend_s * 1e3);
      j.value("native_ms", r.native_s * 1e3).value("rel_l2_cast", r.out1.rel_l2);
      j.value("rel_l2_gather", r.out2.rel_l2).value("lse_abs_cast", r.lse1.max_abs);
      j.value("lse_abs_gather", r.lse2.max_abs).end_object();
    }
    j.end_array().end_object();
    j.save(o.json);
  }
  if (!o.plot.empty()) {
    DemoPlotData d;
    d.model = std::string(model.display);
    d.device = gpu ? "cuda:" + std::to_string(wc.device_id)
                   : "cpu (" + std::to_string(threads) + " threads)";
    d.format = format_name(wc.format);
    d.pool_tokens = pool_tokens;
    d.active_tokens = w.active_tokens;
    d.batch = w.batch();
    d.page_size = wc.page_size;
    d.bytes_cast = bytes1;
    d.bytes_gather = bytes2;
    d.bytes_native = bytes3;
    for (const LayerResult& r : results) {
      d.layers.push_back({r.cast_s * 1e3, r.cast_attend_s * 1e3, r.gather_s * 1e3,
                          r.gather_attend_s * 1e3, r.native_s * 1e3});
    }
    plot_demo(d, o.plot);
  }
  return ok ? 0 : 1;
}

}  // namespace fp8mla::cli
