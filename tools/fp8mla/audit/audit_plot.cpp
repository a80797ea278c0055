#include "tools/fp8mla/audit/audit_plot.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <unordered_set>

#include "tools/fp8mla/svg/chart.h"
#include "tools/fp8mla/svg/palette.h"

namespace fp8mla::audit {
namespace {

namespace pal = svg::palette;

const char* color_of(Category c) {
  switch (c) {
    case Category::attention:
      return pal::kAttention;
    case Category::cast_copy:
      return pal::kCast;
    case Category::gemm:
      return pal::kGemm;
    case Category::communication:
      return pal::kComm;
    case Category::other:
      break;
  }
  return pal::kOther;
}

std::string fixed(double v, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string ms_text(double us) {
  const double ms = us / 1e3;
  return fixed(ms, ms < 1 ? 3 : ms < 100 ? 2 : 1) + " ms";
}

// A bar's segments, bottom up.
struct Segment {
  std::string label;
  double us;
  std::string fill;
  bool kv = false;
};

std::vector<Segment> segments(const Step& step, const KvCastStep& kv, bool gpu) {
  double kv_cast = 0, kv_gather = 0;
  std::unordered_set<std::size_t> marked(kv.items.begin(), kv.items.end());
  for (const std::size_t i : kv.items) {
    const WorkItem& w = step.items[i];
    if (w.category == Category::cast_copy) {
      kv_cast += w.dur;
    } else {
      kv_gather += w.dur;
    }
  }
  std::vector<Segment> s;
  s.push_back({"KV cast", kv_cast, pal::kKvCast, true});
  if (kv_gather > 0) s.push_back({"KV gather", kv_gather, pal::kGather, false});
  const auto cat = [&](Category c) { return step.by_category[static_cast<int>(c)]; };
  s.push_back(
      {"other casts/copies", std::max(0.0, cat(Category::cast_copy) - kv_cast), pal::kCast});
  s.push_back({"attention", cat(Category::attention), pal::kAttention});
  s.push_back({"GEMM", cat(Category::gemm), pal::kGemm});
  s.push_back({"comm", cat(Category::communication), pal::kComm});
  s.push_back({"other", std::max(0.0, cat(Category::other) - kv_gather), pal::kOther});
  if (gpu) s.push_back({"GPU idle", std::max(0.0, step.wall() - step.busy), pal::kIdle});
  return s;
}

// At most `n` steps, evenly spread over the trace.
std::vector<std::size_t> pick_steps(std::size_t total, std::size_t n) {
  std::vector<std::size_t> out;
  if (total <= n) {
    for (std::size_t i = 0; i < total; ++i) out.push_back(i);
    return out;
  }
  for (std::size_t k = 0; k < n; ++k) out.push_back(k * (total - 1) / (n - 1));
  return out;
}

}  // namespace

void plot_audit(const Trace& trace, const Timeline& timeline, const KvCastFinding& kv,
                const std::string& title, const std::string& verdict, const std::string& path) {
  constexpr double kWidth = 960, kHeight = 640;
  svg::Svg doc(kWidth, kHeight, title);
  svg::TextStyle head;
  head.size = 16;
  head.bold = true;
  doc.text({24, 28}, title, head);
  svg::TextStyle sub;
  sub.size = 12;
  sub.fill = kv.found ? pal::kKvCast : "#333";
  // The verdict, wrapped on two lines at most.
  std::string first = verdict, second;
  const std::size_t max_chars = static_cast<std::size_t>((kWidth - 48) / (0.6 * sub.size));
  if (first.size() > max_chars) {
    std::size_t cut = first.rfind(' ', max_chars);
    if (cut == std::string::npos) cut = max_chars;
    second = first.substr(cut + 1);
    first.resize(cut);
    if (second.size() > max_chars) second = second.substr(0, max_chars - 3) + "...";
  }
  doc.text({24, 48}, first, sub);
  if (!second.empty()) doc.text({24, 64}, second, sub);

  // ---- stacked bars, one per step ----
  const std::vector<std::size_t> shown = pick_steps(timeline.steps.size(), 16);
  const svg::Area bars{86, 96, kWidth - 86 - 24, 260};
  double top = 0;
  for (const std::size_t s : shown) top = std::max(top, timeline.steps[s].wall());
  const svg::Scale y =
      svg::Scale::linear(0, std::max(top, 1.0) / 1e3 * 1.12, bars.bottom(), bars.y);
  svg::draw_axes(doc, bars, nullptr, y, "",
                 timeline.gpu ? "GPU time a step (ms)" : "time a step (ms)");
  const double slot = bars.w / static_cast<double>(std::max<std::size_t>(shown.size(), 1));
  const double bar_w = std::min(56.0, slot * 0.62);
  const std::string hatch = doc.hatch("kv", "#7f1010", pal::kKvCast);
  for (std::size_t k = 0; k < shown.size(); ++k) {
    const Step& step = timeline.steps[shown[k]];
    const KvCastStep& ks = kv.steps[shown[k]];
    const double cx = bars.x + slot * (static_cast<double>(k) + 0.5);
    double acc = 0;
    for (const Segment& seg : segments(step, ks, timeline.gpu)) {
      if (seg.us <= 0) continue;
      const double y0 = y(acc / 1e3), y1 = y((acc + seg.us) / 1e3);
      const bool gather = seg.fill == pal::kGather;
      svg::Style st{seg.kv ? hatch : seg.fill, seg.kv || gather ? "#400" : "", 1.2, 1, ""};
      if (seg.fill == pal::kIdle) st.stroke = "#ccc";
      doc.rect(cx - bar_w / 2, y1, bar_w, y0 - y1, st,
               step.label + ": " + seg.label + " " + ms_text(seg.us) + " (" +
                   fixed(100 * seg.us / std::max(step.wall(), 1e-9), 1) + "%)");
      acc += seg.us;
    }
    svg::TextStyle t;
    t.size = 10.5;
    t.anchor = svg::Anchor::middle;
    t.fill = "#333";
    doc.text({cx, y(step.wall() / 1e3) - 5}, ms_text(step.wall()), t);
    if (ks.casts > 0 && ks.share > 0.08) {
      t.fill = "white";
      t.bold = true;
      const double mid = y(ks.cast_us / 2e3);
      doc.text({cx, mid + 4}, fixed(100 * ks.share, 0) + "%", t);
    }
    t.fill = "#333";
    t.bold = false;
    std::string label = step.label;
    if (label.rfind("ProfilerStep", 0) == 0) label = "step " + label.substr(label.find('#'));
    doc.text({cx, bars.bottom() + 16}, label, t);
  }

  // ---- one step as a timeline: the median step by time ----
  std::vector<std::size_t> by_time(timeline.steps.size());
  for (std::size_t i = 0; i < by_time.size(); ++i) by_time[i] = i;
  std::sort(by_time.begin(), by_time.end(), [&](std::size_t a, std::size_t b) {
    return timeline.steps[a].wall() < timeline.steps[b].wall();
  });
  const svg::Area line{86, 420, kWidth - 86 - 24, 120};
  if (!by_time.empty()) {
    const std::size_t si = by_time[by_time.size() / 2];
    const Step& step = timeline.steps[si];
    const KvCastStep& ks = kv.steps[si];
    std::unordered_set<std::size_t> marked(ks.items.begin(), ks.items.end());
    std::vector<std::uint32_t> lanes;
    for (const WorkItem& w : step.items)
      if (std::find(lanes.begin(), lanes.end(), w.lane) == lanes.end()) lanes.push_back(w.lane);
    if (lanes.size() > 4) lanes.resize(4);
    const double lane_h = line.h / static_cast<double>(std::max<std::size_t>(lanes.size(), 1));
    const svg::Scale x =
        svg::Scale::linear(0, std::max(step.wall(), 1.0) / 1e3, line.x, line.right());
    svg::TextStyle cap;
    cap.size = 12;
    cap.bold = true;
    doc.text({line.x, line.y - 10},
             "one step as a timeline (" + step.label +
                 ", the median step): " + (timeline.gpu ? "GPU streams" : "CPU threads"),
             cap);
    doc.rect(line.x, line.y, line.w, line.h, {"#fafafa", "#ddd", 1, 1, ""});
    for (const double v : x.ticks(8)) {
      const double px = x(v);
      doc.line({px, line.bottom()}, {px, line.bottom() + 4}, {"", "#555", 1, 1, ""});
      svg::TextStyle t;
      t.size = 11;
      t.anchor = svg::Anchor::middle;
      t.fill = "#444";
      doc.text({px, line.bottom() + 17}, svg::tick_label(v), t);
    }
    svg::TextStyle xl;
    xl.size = 12;
    xl.anchor = svg::Anchor::middle;
    doc.text({line.x + line.w / 2, line.bottom() + 34}, "ms from the step's start", xl);
    for (std::size_t li = 0; li < lanes.size(); ++li) {
      svg::TextStyle t;
      t.size = 10;
      t.anchor = svg::Anchor::end;
      t.fill = "#555";
      const Lane& lane = trace.lanes[lanes[li]];
      const std::string name = (lane.gpu ? "stream " : "thread ") + std::to_string(lane.tid);
      doc.text({line.x - 6, line.y + lane_h * (static_cast<double>(li) + 0.5) + 3},
               name.size() > 14 ? name.substr(0, 14) : name, t);
    }
    for (std::size_t i = 0; i < step.items.size(); ++i) {
      const WorkItem& w = step.items[i];
      const auto lane_it = std::find(lanes.begin(), lanes.end(), w.lane);
      if (lane_it == lanes.end()) continue;
      const double li = static_cast<double>(lane_it - lanes.begin());
      const bool is_kv = marked.count(i) > 0;
      const double x0 = x((w.start - step.start) / 1e3);
      const double x1 = std::max(x((w.end() - step.start) / 1e3), x0 + 0.6);
      svg::Style st{
          is_kv ? (w.category == Category::cast_copy ? hatch : pal::kGather) : color_of(w.category),
          is_kv ? "#400" : "", 0.8, 1, ""};
      doc.rect(x0, line.y + lane_h * li + 4, x1 - x0, lane_h - 8, st,
               trace.names[w.name] + ": " + ms_text(w.dur) +
                   (w.bytes > 0 ? ", " + fixed(w.bytes / 1e6, 1) + " MB" : ""));
    }
  }

  // ---- legend ----
  std::vector<svg::LegendEntry> legend;
  if (kv.found) legend.push_back({"KV cast (flagged)", {hatch, "#400", 1, 1, ""}});
  if (kv.found && kv.kind == "gather")
    legend.push_back({"KV gather", {pal::kGather, "#400", 1, 1, ""}});
  const std::vector<svg::LegendEntry> rest = {
      {kv.found ? "other casts/copies" : "casts/copies", {pal::kCast, "", 1, 1, ""}},
      {"attention", {pal::kAttention, "", 1, 1, ""}},
      {"GEMM", {pal::kGemm, "", 1, 1, ""}},
      {"comm", {pal::kComm, "", 1, 1, ""}},
      {"other", {pal::kOther, "", 1, 1, ""}},
  };
  legend.insert(legend.end(), rest.begin(), rest.end());
  if (timeline.gpu) legend.push_back({"GPU idle", {pal::kIdle, "#ccc", 1, 1, ""}});
  svg::draw_legend(doc, 86, kHeight - 40, kWidth - 110, legend);
  doc.save(path);
}

}  // namespace fp8mla::audit
