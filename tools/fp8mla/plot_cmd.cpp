// `fp8mla plot RESULTS.json --out FILE.svg`: draws a saved run again, from the JSON that
// `fp8mla bench --json` (GPU or CPU) or `fp8mla demo --json` wrote, without running anything,
// e.g. a GPU run's roofline on a laptop.
#include <cstdio>
#include <string>

#include "fp8mla/error.h"
#include "tools/fp8mla/args.h"
#include "tools/fp8mla/bench_plot.h"
#include "tools/fp8mla/commands.h"
#include "tools/fp8mla/demo_plot.h"
#include "tools/fp8mla/roofline_plot.h"

#if FP8MLA_HAVE_SIMDJSON
#include <simdjson.h>
#endif

namespace fp8mla::cli {

#if FP8MLA_HAVE_SIMDJSON
namespace {

namespace dom = simdjson::dom;

double number(dom::element e, const char* key, double fallback = 0) {
  double v = fallback;
  if (e[key].get_double().get(v) != simdjson::SUCCESS) {
    std::int64_t i = 0;
    if (e[key].get_int64().get(i) == simdjson::SUCCESS) v = static_cast<double>(i);
  }
  return v;
}

std::string text(dom::element e, const char* key) {
  std::string_view v;
  return e[key].get_string().get(v) == simdjson::SUCCESS ? std::string(v) : std::string();
}

RooflineData gpu_bench(dom::element doc) {
  bench::GpuBenchSummary run;
  run.device = text(doc, "device");
  dom::element ceilings;
  if (doc["ceilings"].get(ceilings) == simdjson::SUCCESS) {
    run.read_gbs = number(ceilings, "read_gbs");
    run.copy_gbs = number(ceilings, "copy_gbs");
    run.matmul_tfs = number(ceilings, "matmul_bf16_tfs");
  }
  dom::array cases;
  if (doc["cases"].get_array().get(cases) == simdjson::SUCCESS) {
    for (dom::element c : cases) {
      bench::GpuBenchCase k;
      k.batch = static_cast<int>(number(c, "batch"));
      k.heads = static_cast<int>(number(c, "heads"));
      k.context = static_cast<int>(number(c, "context"));
      k.qo_len = static_cast<int>(number(c, "qo_len", 1));
      k.page_size = static_cast<int>(number(c, "page_size"));
      k.topk = static_cast<int>(number(c, "topk"));  // absent in dense-only runs: 0
      k.format = parse_format(text(c, "format"));
      k.strategy = text(c, "strategy");
      k.kernel = text(c, "kernel");
      k.us = number(c, "us");
      k.gbs = number(c, "gbs");
      k.tfs = number(c, "tfs");
      run.cases.push_back(k);
    }
  }
  return roofline_from_gpu(run);
}

RooflineData cpu_bench(dom::element doc) {
  RooflineData d;
  d.title = "fp8mla bench (cpu): the fast path";
  d.note =
      "bytes: the format's KV bytes of every context token once (a saved CPU run: no "
      "ceiling was measured)";
  dom::array cases;
  if (doc["cases"].get_array().get(cases) == simdjson::SUCCESS) {
    for (dom::element c : cases) {
      const double heads = number(c, "heads"), batch = number(c, "batch");
      const double qo = number(c, "qo_len", 1), ctx = number(c, "context");
      const std::string fmt = text(c, "format");
      const double tb = static_cast<double>(token_bytes(parse_format(fmt)));
      const double tokens = batch * ctx;
      const double flops = bench::causal_attention_flops(
          tokens, static_cast<int>(batch), static_cast<int>(qo), static_cast<int>(heads));
      const double us = number(c, "fast_us");
      const std::string label = "bs " + std::to_string(static_cast<int>(batch)) + ", ctx " +
                                std::to_string(static_cast<int>(ctx));
      if (us > 0) {
        d.points.push_back(
            {roofline_series("native", fmt, ""), flops / (tokens * tb), flops / (us * 1e6), label});
      }
      const double g = number(c, "gather_cast_us");
      if (g > 0) {
        d.points.push_back({roofline_series("gather_cast", fmt, ""), flops / (tokens * tb),
                            flops / (g * 1e6), label});
      }
    }
  }
  return d;
}

DemoPlotData demo(dom::element doc) {
  DemoPlotData d;
  d.model = text(doc, "model");
  d.device = text(doc, "device");
  d.format = text(doc, "format");
  d.pool_tokens = static_cast<std::int64_t>(number(doc, "pool_tokens"));
  d.batch = static_cast<int>(number(doc, "batch"));
  d.active_tokens = static_cast<std::int64_t>(number(doc, "active_tokens"));
  d.page_size = static_cast<int>(number(doc, "page_size"));
  dom::element bytes;
  if (doc["bytes_per_layer"].get(bytes) == simdjson::SUCCESS) {
    d.bytes_cast = number(bytes, "cast");
    d.bytes_gather = number(bytes, "gather");
    d.bytes_native = number(bytes, "native");
  }
  dom::array layers;
  if (doc["per_layer"].get_array().get(layers) == simdjson::SUCCESS) {
    for (dom::element l : layers) {
      d.layers.push_back({number(l, "cast_ms"), number(l, "cast_attend_ms"), number(l, "gather_ms"),
                          number(l, "gather_attend_ms"), number(l, "native_ms")});
    }
  }
  return d;
}

}  // namespace
#endif

int run_plot(std::span<const std::string_view> argv) {
  std::string json, out;
  ArgParser ap("fp8mla plot",
               "Draws a saved run again, from the JSON of 'fp8mla bench --json' (the GPU grid's\n"
               "roofline, or the CPU bench's) or 'fp8mla demo --json' (the three strategies per\n"
               "layer), without running anything.");
  ap.add_positional("RESULTS.json", &json, "the JSON a bench or demo run wrote");
  ap.add_string("out", &out, "FILE.svg", "where to write the picture (required)");
  ap.set_epilog(
      "examples:\n"
      "  fp8mla plot bench/results/h200_bench.json --out roofline.svg\n"
      "  fp8mla demo --json demo.json && fp8mla plot demo.json --out demo.svg");
  if (!ap.parse(argv)) return 0;
  if (out.empty()) throw UsageError("fp8mla plot: --out: required (see 'fp8mla plot --help')");
#if FP8MLA_HAVE_SIMDJSON
  dom::parser parser;
  dom::element doc;
  if (const auto err = parser.load(json).get(doc); err != simdjson::SUCCESS) {
    throw Error(ErrorCode::invalid_argument, "RESULTS.json",
                json + ": " + simdjson::error_message(err));
  }
  const std::string command = text(doc, "command");
  dom::element ceilings;
  if (command == "demo") {
    plot_demo(demo(doc), out);
  } else if (doc["ceilings"].get(ceilings) == simdjson::SUCCESS) {
    plot_roofline(gpu_bench(doc), out);
  } else if (command == "bench") {
    plot_roofline(cpu_bench(doc), out);
  } else {
    throw Error(ErrorCode::invalid_argument, "RESULTS.json",
                json + ": neither a bench nor a demo result (no \"command\" or \"ceilings\")");
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
#else
  throw Error(ErrorCode::unsupported, "plot",
              "this build of fp8mla reads no JSON: it was configured without simdjson "
              "(Debian/Ubuntu: apt-get install libsimdjson-dev, then re-run cmake); "
              "bench --plot and demo --plot draw without it");
#endif
}

}  // namespace fp8mla::cli
