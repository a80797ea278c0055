#include "tools/fp8mla/audit/audit_report.h"

#include <algorithm>
#include <cstdio>

#include "tools/fp8mla/util.h"

namespace fp8mla::audit {
namespace {

using cli::format_bytes;
using cli::format_count;
using cli::format_fixed;

// Byte counts as whole numbers (-1: not recorded).
std::int64_t whole(double bytes) {
  return bytes < 0 ? -1 : static_cast<std::int64_t>(bytes + 0.5);
}

std::string ms(double us) {
  const double v = us / 1e3;
  return format_fixed(v, v < 10 ? 3 : v < 1000 ? 2 : 1);
}

std::string pct(double part, double total) {
  return total > 0 ? format_fixed(100 * part / total, 1) + "%" : "-";
}

// Means over the steps.
struct Means {
  double wall = 0, busy = 0;
  std::array<double, kCategories> by{};
};

Means means(const Timeline& t) {
  Means m;
  const double n = static_cast<double>(std::max<std::size_t>(t.steps.size(), 1));
  for (const Step& s : t.steps) {
    m.wall += s.wall() / n;
    m.busy += s.busy / n;
    for (int c = 0; c < kCategories; ++c)
      m.by[static_cast<std::size_t>(c)] += s.by_category[static_cast<std::size_t>(c)] / n;
  }
  return m;
}

int attention_calls(const Timeline& t) {
  std::vector<int> v;
  for (const Step& s : t.steps) v.push_back(s.attention_calls);
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::string verdict(const Audit& a) {
  const Timeline& t = a.timeline;
  const KvCastFinding& kv = a.kv;
  if (t.steps.empty()) return "nothing to audit: the trace has no CPU ops or GPU kernels";
  const Means m = means(t);
  if (kv.found) {
    const std::string what = kv.kind == "gather"
                                 ? "gathering the batch's KV pages and casting them to bf16"
                                 : "casting the whole KV pool to bf16";
    std::string v = "KV " + std::string(kv.kind == "gather" ? "gather-cast" : "pool cast") +
                    " found: " + format_fixed(100 * kv.share, 1) + "% of each decode step (" +
                    ms(kv.save_us_per_step) + " of " + ms(m.wall) + " ms) goes to " + what +
                    " before attention, " + std::to_string(kv.per_step) +
                    " times a step. Reading the FP8 cache natively (fp8mla) saves " +
                    ms(kv.save_us_per_step) + " ms";
    if (kv.save_bytes_per_step > 0) v += " and " + format_bytes(kv.save_bytes_per_step);
    return v + " a step.";
  }
  const double att = m.by[static_cast<int>(Category::attention)];
  const double cast = m.by[static_cast<int>(Category::cast_copy)];
  if (attention_calls(t) == 0) {
    return "no attention call recognised, so no KV cast can be placed: pass --attention NAME "
           "(part of your attention op's or kernel's name); casts/copies are " +
           pct(cast, m.wall) + " of a step";
  }
  return "no KV cast before attention: casts/copies are " + pct(cast, m.wall) + " of a step (" +
         ms(cast) + " ms), attention " + pct(att, m.wall) + " (" + ms(att) + " ms).";
}

void print_report(const Audit& a, int max_steps) {
  const Trace& tr = a.trace;
  const Timeline& t = a.timeline;
  const KvCastFinding& kv = a.kv;
  std::printf("fp8mla audit: %s\n\n", a.path.c_str());
  const double mbs =
      tr.read_seconds > 0 ? static_cast<double>(tr.json_bytes) / tr.read_seconds / 1e6 : 0;
  std::printf(
      "  read      %s%s, %s events (%s kept) in %.2f s (%.0f MB/s of JSON)\n",
      format_bytes(static_cast<double>(tr.file_bytes)).c_str(),
      tr.gzip ? (" gzip = " + format_bytes(static_cast<double>(tr.json_bytes)) + " of JSON").c_str()
              : " of JSON",
      format_count(tr.events_seen).c_str(),
      format_count(static_cast<std::int64_t>(tr.events.size())).c_str(), tr.read_seconds, mbs);
  if (t.gpu) {
    std::printf("  measured  on the GPU%s: kernels, memcpys and memsets (CPU ops only launch)\n",
                tr.device_name.empty() ? "" : (" (" + tr.device_name + ")").c_str());
  } else {
    std::printf(
        "  measured  on the CPU (no GPU kernels in the trace): each op's wall time, counted at\n"
        "            its outermost categorised op\n");
  }
  std::printf("  shapes    %s\n", tr.has_shapes() ? "recorded (record_shapes): bytes are known"
                                                  : "not recorded: times only (record_shapes=True "
                                                    "gives bytes)");
  std::printf("  steps     %zu, from %s; %d attention calls a step\n\n", t.steps.size(),
              t.step_source.c_str(), attention_calls(t));
  if (t.steps.empty()) {
    std::printf("verdict: %s\n", verdict(a).c_str());
    return;
  }

  std::printf(" %-16s %9s", "step", "time ms");
  for (const Category c : kAllCategories)
    std::printf(" %15s", std::string(category_label(c)).c_str());
  std::printf(" %15s\n", "KV cast");
  auto row = [&](const std::string& label, double wall, const std::array<double, kCategories>& by,
                 double kv_us) {
    std::printf(" %-16s %9s", label.substr(0, 16).c_str(), ms(wall).c_str());
    for (int c = 0; c < kCategories; ++c) {
      const double v = by[static_cast<std::size_t>(c)];
      std::printf(" %8s %6s", ms(v).c_str(), pct(v, wall).c_str());
    }
    std::printf(" %8s %6s\n", kv_us > 0 ? ms(kv_us).c_str() : "-",
                kv_us > 0 ? pct(kv_us, wall).c_str() : "");
  };
  const int n = static_cast<int>(t.steps.size());
  for (int i = 0; i < n; ++i) {
    if (i >= max_steps && i != n - 1) {
      if (i == max_steps) std::printf(" ... (%d more steps)\n", n - max_steps - 1);
      continue;
    }
    const Step& s = t.steps[static_cast<std::size_t>(i)];
    const KvCastStep& ks = kv.steps[static_cast<std::size_t>(i)];
    row(s.label, s.wall(), s.by_category, ks.cast_us + ks.gather_us);
  }
  const Means m = means(t);
  row("mean", m.wall, m.by, kv.found ? kv.save_us_per_step : 0);
  if (t.gpu) {
    std::printf(
        " (GPU time: a step spans its first kernel's start to its last kernel's end; busy "
        "%s ms = %s of it)\n",
        ms(m.busy).c_str(), pct(m.busy, m.wall).c_str());
  }
  std::printf("\n");

  if (kv.found) {
    std::printf(
        "KV cast before attention (%s)\n",
        kv.kind == "gather"
            ? "gather then cast: a gather picks the batch's pages, then they are cast"
            : "pool cast: nothing gathers before it, so it casts what it is given: the pool");
    std::printf("  op          %s%s%s\n", kv.name.c_str(),
                kv.op != kv.name ? (" (launched by " + kv.op + ")").c_str() : "",
                kv.fp8_source ? ", FP8 input" : "");
    std::printf("  each        %s ms", ms(kv.us_each).c_str());
    if (kv.bytes_each > 0) {
      std::printf(", %s moved", format_bytes(kv.bytes_each).c_str());
      if (kv.out_bytes_each > 0)
        std::printf(" (%s written)", format_bytes(kv.out_bytes_each).c_str());
      if (kv.kv_ratio > 0) std::printf(", %.2fx the bytes attention is handed", kv.kv_ratio);
    }
    std::printf("\n  per step    %d casts before %d attention calls: %s ms", kv.per_step,
                kv.attention_per_step, ms(kv.cast_us_per_step).c_str());
    if (kv.gather_us_per_step > 0)
      std::printf(" + %s ms of gathers", ms(kv.gather_us_per_step).c_str());
    std::printf(" = %s%% of the step (in %d of %zu steps)\n",
                format_fixed(100 * kv.share, 1).c_str(), kv.steps_with_pattern, t.steps.size());
    std::printf("  native FP8  attention reading the cache as stored needs no cast: saves %s ms",
                ms(kv.save_us_per_step).c_str());
    if (kv.save_bytes_per_step > 0)
      std::printf(" and %s", format_bytes(kv.save_bytes_per_step).c_str());
    std::printf(
        " a step\n              (the casts' own time and traffic; attention then also reads "
        "half the bytes it reads in bf16)\n\n");
  }
  std::printf("verdict: %s\n", verdict(a).c_str());
}

void write_report_json(const Audit& a, const std::string& path) {
  const Trace& tr = a.trace;
  const Timeline& t = a.timeline;
  const KvCastFinding& kv = a.kv;
  cli::JsonWriter j;
  j.begin_object().value("command", "audit").value("trace", a.path);
  j.value("file_bytes", tr.file_bytes).value("json_bytes", tr.json_bytes).value("gzip", tr.gzip);
  j.value("events", tr.events_seen)
      .value("events_kept", static_cast<std::int64_t>(tr.events.size()));
  j.value("read_seconds", tr.read_seconds);
  j.value("measured_on", t.gpu ? "gpu" : "cpu").value("gpu_name", tr.device_name);
  j.value("record_shapes", tr.has_shapes()).value("step_source", t.step_source);
  j.value("attention_calls_per_step", attention_calls(t));
  auto categories = [&](const std::array<double, kCategories>& by) {
    j.begin_object("ms");
    for (const Category c : kAllCategories)
      j.value(category_key(c), by[static_cast<std::size_t>(c)] / 1e3);
    j.end_object();
  };
  j.begin_array("steps");
  for (std::size_t i = 0; i < t.steps.size(); ++i) {
    const Step& s = t.steps[i];
    const KvCastStep& ks = kv.steps[i];
    j.begin_object().value("label", s.label);
    j.value("start_ms", (s.start - t.steps.front().start) / 1e3);  // from the first step's start
    j.value("wall_ms", s.wall() / 1e3).value("busy_ms", s.busy / 1e3);
    j.value("attention_calls", s.attention_calls);
    categories(s.by_category);
    j.value("kv_casts", ks.casts).value("kv_cast_ms", ks.cast_us / 1e3);
    j.value("kv_gather_ms", ks.gather_us / 1e3).value("kv_cast_bytes", whole(ks.bytes));
    j.value("kv_share", ks.share).end_object();
  }
  j.end_array();
  const Means m = means(t);
  j.begin_object("mean").value("wall_ms", m.wall / 1e3).value("busy_ms", m.busy / 1e3);
  categories(m.by);
  j.end_object();
  j.begin_object("kv_cast").value("found", kv.found);
  if (kv.found) {
    j.value("kind", kv.kind).value("name", kv.name).value("op", kv.op);
    j.value("fp8_source", kv.fp8_source).value("per_step", kv.per_step);
    j.value("attention_per_step", kv.attention_per_step);
    j.value("bytes_each", whole(kv.bytes_each)).value("out_bytes_each", whole(kv.out_bytes_each));
    j.value("kv_ratio", kv.kv_ratio).value("ms_each", kv.us_each / 1e3);
    j.value("cast_ms_per_step", kv.cast_us_per_step / 1e3);
    j.value("gather_ms_per_step", kv.gather_us_per_step / 1e3).value("share", kv.share);
    j.value("save_ms_per_step", kv.save_us_per_step / 1e3);
    j.value("save_bytes_per_step", whole(kv.save_bytes_per_step));
    j.value("steps_with_pattern", kv.steps_with_pattern);
  }
  j.end_object();
  j.value("verdict", verdict(a)).end_object();
  j.save(path);
}

}  // namespace fp8mla::audit
