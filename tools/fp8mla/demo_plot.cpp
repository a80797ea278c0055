#include "tools/fp8mla/demo_plot.h"

#include <algorithm>
#include <cstdio>

#include "tools/fp8mla/svg/chart.h"
#include "tools/fp8mla/svg/palette.h"

namespace fp8mla::cli {
namespace {

namespace pal = svg::palette;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string bytes_text(double b) {
  return b >= 1e9 ? fmt("%.2f GB", b / 1e9) : fmt("%.1f MB", b / 1e6);
}

}  // namespace

void plot_demo(const DemoPlotData& d, const std::string& path) {
  constexpr double kWidth = 960, kHeight = 640;
  const std::string title = "fp8mla demo: one decode step of " + d.model + ", three ways";
  svg::Svg doc(kWidth, kHeight, title);
  svg::TextStyle head;
  head.size = 16;
  head.bold = true;
  doc.text({24, 28}, title, head);
  svg::TextStyle sub;
  sub.size = 12;
  sub.fill = "#444";
  doc.text({24, 48},
           d.device + ", " + d.format + " pool of " + std::to_string(d.pool_tokens) +
               " tokens (page " + std::to_string(d.page_size) + "), " + std::to_string(d.batch) +
               " requests with " + std::to_string(d.active_tokens) + " active tokens (" +
               fmt("%.1f%%", 100.0 * static_cast<double>(d.active_tokens) /
                                 static_cast<double>(std::max<std::int64_t>(d.pool_tokens, 1))) +
               " of the pool)",
           sub);
  const std::string hatch = doc.hatch("cast", "#7f1010", pal::kKvCast);

  // ---- per layer: three bars a layer ----
  const std::size_t n = d.layers.size();
  const svg::Area area{80, 92, kWidth - 80 - 24, 250};
  double top = 0;
  for (const DemoLayerTimes& l : d.layers) {
    top = std::max(
        {top, l.cast_ms + l.cast_attend_ms, l.gather_ms + l.gather_attend_ms, l.native_ms});
  }
  const svg::Scale y = svg::Scale::linear(0, std::max(top, 1e-3) * 1.1, area.bottom(), area.y);
  svg::draw_axes(doc, area, nullptr, y, "", "ms a layer");
  svg::TextStyle cap;
  cap.size = 12;
  cap.bold = true;
  doc.text({area.x, area.y - 10},
           "each layer: (1) cast pool + attend, (2) gather + attend, (3) native", cap);
  const double slot = area.w / static_cast<double>(std::max<std::size_t>(n, 1));
  const double bar = std::min(14.0, slot * 0.28);
  const svg::Style attend{pal::kAttention, "", 1, 1, ""};
  for (std::size_t i = 0; i < n; ++i) {
    const DemoLayerTimes& l = d.layers[i];
    const double x0 = area.x + slot * static_cast<double>(i) + (slot - 3 * bar) / 2;
    const std::string layer = "layer " + std::to_string(i) + ": ";
    // (1)
    doc.rect(x0, y(l.cast_ms), bar, y(0) - y(l.cast_ms), {hatch, "", 1, 1, ""},
             layer + "(1) cast " + fmt("%.3f ms", l.cast_ms));
    doc.rect(x0, y(l.cast_ms + l.cast_attend_ms), bar,
             y(l.cast_ms) - y(l.cast_ms + l.cast_attend_ms), attend,
             layer + "(1) attend bf16 " + fmt("%.3f ms", l.cast_attend_ms));
    // (2)
    doc.rect(x0 + bar, y(l.gather_ms), bar, y(0) - y(l.gather_ms), {pal::kGather, "", 1, 1, ""},
             layer + "(2) gather+cast " + fmt("%.3f ms", l.gather_ms));
    doc.rect(x0 + bar, y(l.gather_ms + l.gather_attend_ms), bar,
             y(l.gather_ms) - y(l.gather_ms + l.gather_attend_ms), attend,
             layer + "(2) attend bf16 " + fmt("%.3f ms", l.gather_attend_ms));
    // (3)
    doc.rect(x0 + 2 * bar, y(l.native_ms), bar, y(0) - y(l.native_ms), {pal::kNative, "", 1, 1, ""},
             layer + "(3) native " + fmt("%.3f ms", l.native_ms));
  }
  // Layer numbers: about ten of them.
  const std::size_t every = std::max<std::size_t>(1, (n + 9) / 10);
  svg::TextStyle tick;
  tick.size = 10.5;
  tick.anchor = svg::Anchor::middle;
  tick.fill = "#444";
  for (std::size_t i = 0; i < n; i += every) {
    doc.text({area.x + slot * (static_cast<double>(i) + 0.5), area.bottom() + 15},
             std::to_string(i), tick);
  }
  svg::TextStyle xl;
  xl.size = 12;
  xl.anchor = svg::Anchor::middle;
  doc.text({area.x + area.w / 2, area.bottom() + 32}, "layer", xl);

  // ---- the step: three horizontal bars ----
  DemoLayerTimes sum;
  for (const DemoLayerTimes& l : d.layers) {
    sum.cast_ms += l.cast_ms;
    sum.cast_attend_ms += l.cast_attend_ms;
    sum.gather_ms += l.gather_ms;
    sum.gather_attend_ms += l.gather_attend_ms;
    sum.native_ms += l.native_ms;
  }
  const double step1 = sum.cast_ms + sum.cast_attend_ms,
               step2 = sum.gather_ms + sum.gather_attend_ms;
  const double step3 = sum.native_ms;
  const svg::Area steps{250, 420, kWidth - 250 - 24, 120};
  doc.text({24, steps.y - 14}, "the step (" + std::to_string(n) + " layers)", cap);
  // The longest bar ends at about 70% of the width: its label goes after it.
  const svg::Scale x =
      svg::Scale::linear(0, std::max({step1, step2, step3, 1e-3}) * 1.42, steps.x, steps.right());
  for (const double v : x.ticks(6)) {
    doc.line({x(v), steps.y}, {x(v), steps.bottom()}, {"", "#e3e3e3", 1, 1, ""});
    doc.text({x(v), steps.bottom() + 15}, svg::tick_label(v), tick);
  }
  doc.text({steps.x + steps.w / 2, steps.bottom() + 32}, "ms a step", xl);
  const double row = steps.h / 3, h = row * 0.62;
  struct Row {
    std::string name;
    double first, second;
    std::string first_fill;
    double bytes;
  };
  const Row rows[] = {
      {"(1) cast pool, attend bf16", sum.cast_ms, sum.cast_attend_ms, hatch, d.bytes_cast},
      {"(2) gather+cast, attend bf16", sum.gather_ms, sum.gather_attend_ms, pal::kGather,
       d.bytes_gather},
      {"(3) native FP8 (fp8mla)", sum.native_ms, 0, pal::kNative, d.bytes_native},
  };
  svg::TextStyle name;
  name.size = 12;
  name.anchor = svg::Anchor::end;
  svg::TextStyle value;
  value.size = 11.5;
  value.fill = "#222";
  for (int r = 0; r < 3; ++r) {
    const Row& w = rows[r];
    const double cy = steps.y + row * r + (row - h) / 2;
    doc.text({steps.x - 10, cy + h / 2 + 4}, w.name, name);
    doc.rect(x(0), cy, x(w.first) - x(0), h, {w.first_fill, "", 1, 1, ""},
             w.name + ": " + fmt("%.1f ms", w.first));
    if (w.second > 0) {
      doc.rect(x(w.first), cy, x(w.first + w.second) - x(w.first), h, attend,
               w.name + ": attention " + fmt("%.1f ms", w.second));
    }
    const double total = w.first + w.second;
    std::string label = fmt("%.1f ms", total) + ", " + bytes_text(w.bytes * static_cast<double>(n));
    if (r < 2 && step3 > 0) label += ", " + fmt("%.1fx native", total / step3);
    doc.text({x(total) + 6, cy + h / 2 + 4}, label, value);
  }
  svg::draw_legend(doc, 80, kHeight - 36, kWidth - 100,
                   {{"cast of the whole pool", {hatch, "", 1, 1, ""}},
                    {"gather + cast of the batch's pages", {pal::kGather, "", 1, 1, ""}},
                    {"attention on bf16", {pal::kAttention, "", 1, 1, ""}},
                    {"attention on FP8 (fp8mla)", {pal::kNative, "", 1, 1, ""}}});
  doc.save(path);
}

}  // namespace fp8mla::cli
