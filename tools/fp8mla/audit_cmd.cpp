// `fp8mla audit TRACE`: reads a PyTorch profiler trace of a serving engine's decode and says
// where each step's time goes, and whether the KV cache is cast to bf16 before attention.
#include <cstdio>
#include <string>
#include <vector>

#include "fp8mla/error.h"
#include "tools/fp8mla/args.h"
#include "tools/fp8mla/audit/audit_plot.h"
#include "tools/fp8mla/audit/audit_report.h"
#include "tools/fp8mla/audit/trace_error.h"
#include "tools/fp8mla/audit/trace_reader.h"
#include "tools/fp8mla/commands.h"

namespace fp8mla::cli {
namespace {

std::vector<std::string> split_names(const std::string& text) {
  std::vector<std::string> out;
  for (const std::string_view part : split_commas(text))
    if (!part.empty()) out.emplace_back(part);
  return out;
}

std::string base_name(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

}  // namespace

int run_audit(std::span<const std::string_view> argv) {
  std::string trace_path, json, plot, attention, cast;
  int max_steps = 12;
  bool fail_on_cast = false;
  ArgParser ap("fp8mla audit",
               "Reads a PyTorch profiler trace (Chrome trace JSON from torch.profiler, gzipped or\n"
               "not; SGLang's and vLLM's profilers write these) and reports the decode steps it\n"
               "finds, each step's time by category (attention, dtype casts and copies, GEMMs,\n"
               "communication, other), and whether the KV cache is cast to bf16 before attention\n"
               "in every layer: its bytes, its share of the step and what reading the FP8 cache\n"
               "natively would save. Measures GPU time when the trace has kernels, CPU time\n"
               "otherwise; bytes need record_shapes=True, times do not.");
  ap.add_positional("TRACE", &trace_path,
                    "the trace file (.json or .json.gz; gzip is recognised by its content)");
  ap.add_string("json", &json, "FILE", "also write the report as JSON to FILE");
  ap.add_string("plot", &plot, "FILE.svg",
                "also draw the steps as stacked bars by category, the KV cast hatched red, and "
                "the median step as a timeline, to FILE.svg");
  ap.add_string("attention", &attention, "NAME,...",
                "more name fragments (case-insensitive) that mark an op or kernel as attention, "
                "for kernels the built-in list does not know");
  ap.add_string("cast", &cast, "NAME,...",
                "more name fragments that mark an op or kernel as a dtype cast or copy");
  ap.add_int("steps", &max_steps, "step rows printed before the mean row", 1, 1 << 20);
  ap.add_flag("fail-on-cast", &fail_on_cast, "exit with status 3 when a KV cast is found (for CI)");
  ap.set_epilog(
      "Exit status: 0 (3 with --fail-on-cast when a KV cast is found), 1 when the trace cannot\n"
      "be read (the message names the byte offset), 2 for a bad command line.\n\n"
      "Record a trace: torch.profiler.profile(activities=[CPU, CUDA], record_shapes=True) around\n"
      "a few decode steps with prof.step() after each (SGLang: SGLANG_TORCH_PROFILER_DIR and\n"
      "/start_profile; vLLM: --profiler-config with torch_profiler_record_shapes; "
      "docs/audit.md).\n\n"
      "examples:\n"
      "  fp8mla audit trace.json.gz\n"
      "  fp8mla audit trace.json.gz --plot steps.svg --json audit.json\n"
      "  fp8mla audit trace.json.gz --attention my_mla_kernel");
  if (!ap.parse(argv)) return 0;

  audit::CategoryRules rules;
  rules.attention = split_names(attention);
  rules.cast = split_names(cast);
  audit::Audit a;
  a.path = trace_path;
  try {
    a.trace = audit::read_trace(trace_path);
  } catch (const audit::TraceError& e) {
    std::fprintf(stderr, "fp8mla audit: %s\n", e.what());
    return 1;
  }
  a.timeline = audit::build_timeline(a.trace, rules);
  a.kv = audit::find_kv_cast(a.trace, a.timeline);
  audit::print_report(a, max_steps);
  if (!json.empty()) audit::write_report_json(a, json);
  if (!plot.empty()) {
    audit::plot_audit(a.trace, a.timeline, a.kv, "fp8mla audit: " + base_name(trace_path),
                      audit::verdict(a), plot);
  }
  return fail_on_cast && a.kv.found ? 3 : 0;
}

}  // namespace fp8mla::cli
