#include "tools/fp8mla/roofline_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tools/fp8mla/svg/chart.h"
#include "tools/fp8mla/svg/palette.h"

namespace fp8mla::cli {
namespace {

namespace pal = svg::palette;

struct SeriesStyle {
  std::string color;
  svg::Marker marker;
};

// A series is "STRATEGY WHAT" (WHAT: a format or a kernel family): the marker tells the
// strategy (native a circle, gather then cast a triangle, the pool cast a cross), the colour
// what it reads, in order of first appearance.
SeriesStyle style_for(const std::string& series, std::vector<std::string>& seen) {
  const std::size_t space = series.find(' ');
  const std::string strategy = series.substr(0, space);
  const std::string what = space == std::string::npos ? "" : series.substr(space + 1);
  static const char* colors[] = {pal::kNative, "#ff7f0e", pal::kAttention, pal::kGemm,
                                 pal::kComm,   "#8c564b", "#bcbd22",       "#7f7f7f"};
  auto it = std::find(seen.begin(), seen.end(), what);
  if (it == seen.end()) it = seen.insert(seen.end(), what);
  const std::size_t index = static_cast<std::size_t>(it - seen.begin());
  const svg::Marker marker = strategy == "native"        ? svg::Marker::circle
                             : strategy == "gather_cast" ? svg::Marker::triangle
                             : strategy == "cast_pool"   ? svg::Marker::cross
                                                         : svg::Marker::diamond;
  return {colors[index % std::size(colors)], marker};
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

void plot_roofline(const RooflineData& data, const std::string& path) {
  constexpr double kWidth = 960, kHeight = 620;
  svg::Svg doc(kWidth, kHeight, data.title);
  svg::TextStyle head;
  head.size = 16;
  head.bold = true;
  doc.text({24, 28}, data.title, head);
  svg::TextStyle sub;
  sub.size = 12;
  sub.fill = "#444";
  std::string ceilings = data.device.empty() ? "" : data.device + ": ";
  ceilings += data.read_gbs > 0 ? "streaming read " + fmt("%.0f", data.read_gbs) + " GB/s"
                                : "read bandwidth not measured";
  if (data.copy_gbs > 0) ceilings += ", device copy " + fmt("%.0f", data.copy_gbs) + " GB/s";
  ceilings += data.matmul_tfs > 0 ? ", bf16 matmul " + fmt("%.0f", data.matmul_tfs) + " TF/s"
                                  : ", compute ceiling not measured";
  doc.text({24, 48}, "measured ceilings: " + ceilings, sub);
  if (!data.note.empty()) doc.text({24, 66}, data.note, sub);

  // Ranges: every point, the ridge and a little room.
  double x_lo = 1e30, x_hi = 0, y_lo = 1e30, y_hi = 0;
  for (const RooflinePoint& p : data.points) {
    if (p.flops_per_byte <= 0 || p.tflops <= 0) continue;
    x_lo = std::min(x_lo, p.flops_per_byte);
    x_hi = std::max(x_hi, p.flops_per_byte);
    y_lo = std::min(y_lo, p.tflops);
    y_hi = std::max(y_hi, p.tflops);
  }
  if (x_hi <= 0) {
    x_lo = 1;
    x_hi = 100;
    y_lo = 0.1;
    y_hi = 10;
  }
  const double ridge =
      data.read_gbs > 0 && data.matmul_tfs > 0 ? data.matmul_tfs * 1e3 / data.read_gbs : 0;
  if (ridge > 0) x_hi = std::max(x_hi, ridge * 2);
  if (data.matmul_tfs > 0) y_hi = std::max(y_hi, data.matmul_tfs * 1.5);
  if (data.read_gbs > 0) y_hi = std::max(y_hi, data.read_gbs * x_lo / 1e3);
  const svg::Area area{90, 90, kWidth - 90 - 250, kHeight - 90 - 70};
  const svg::Scale x = svg::Scale::log10(x_lo / 2, x_hi * 2, area.x, area.right());
  const svg::Scale y = svg::Scale::log10(y_lo / 2, y_hi * 1.2, area.bottom(), area.y);
  svg::draw_axes(doc, area, &x, y, "arithmetic intensity (attention flops per KV byte moved)",
                 "achieved TF/s");

  // Roofs: a bandwidth roof is the line TF/s = GB/s x flop/byte / 1000, clipped at the top.
  auto roof = [&](double gbs, const std::string& dash, const std::string& label, double along,
                  double below) {
    if (gbs <= 0) return;
    const double top = data.matmul_tfs > 0 ? data.matmul_tfs : y.hi();
    const double x_end = std::min(x.hi(), top * 1e3 / gbs);
    const double x_start = std::max(x.lo(), y.lo() * 1e3 / gbs);
    if (x_start >= x_end) return;
    doc.line({x(x_start), y(gbs * x_start / 1e3)}, {x(x_end), y(gbs * x_end / 1e3)},
             {"", pal::kCeiling, 2, 1, dash});
    svg::TextStyle t;
    t.size = 11;
    t.fill = pal::kCeiling;
    const double lx = std::max(x.lo() * 1.2, std::min(x_end / along, x.hi()));
    const double angle =
        std::atan2(y(gbs * x_end / 1e3) - y(gbs * x_start / 1e3), x(x_end) - x(x_start)) * 180 /
        3.14159265358979;
    t.rotate = angle;
    doc.text({x(lx) + 4 - below * 0.3, y(gbs * lx / 1e3) - 6 + below}, label, t);
  };
  roof(data.read_gbs, "", "streaming read " + fmt("%.0f", data.read_gbs) + " GB/s", 12, 0);
  roof(data.copy_gbs, "6 4", "device copy " + fmt("%.0f", data.copy_gbs) + " GB/s", 3, 22);
  if (data.matmul_tfs > 0) {
    const double x_start = ridge > 0 ? ridge : x.lo();
    doc.line({x(x_start), y(data.matmul_tfs)}, {area.right(), y(data.matmul_tfs)},
             {"", pal::kCeiling, 2, 1, ""});
    svg::TextStyle t;
    t.size = 11;
    t.fill = pal::kCeiling;
    t.anchor = svg::Anchor::end;
    doc.text({area.right() - 4, y(data.matmul_tfs) - 6},
             "bf16 matmul " + fmt("%.0f", data.matmul_tfs) + " TF/s", t);
  }

  // Points, one series at a time (first-seen order), and the legend on the right.
  std::vector<std::string> series;
  for (const RooflinePoint& p : data.points)
    if (std::find(series.begin(), series.end(), p.series) == series.end())
      series.push_back(p.series);
  std::vector<svg::LegendEntry> legend;
  std::vector<std::string> seen;
  for (std::size_t i = 0; i < series.size(); ++i) {
    const SeriesStyle st = style_for(series[i], seen);
    const svg::Style mark{st.color, st.marker == svg::Marker::cross ? st.color : "#222", 0.6, 0.85,
                          ""};
    int n = 0;
    for (const RooflinePoint& p : data.points) {
      if (p.series != series[i] || p.flops_per_byte <= 0 || p.tflops <= 0) continue;
      svg::draw_marker(doc, {x(p.flops_per_byte), y(p.tflops)}, st.marker, 8, mark,
                       p.series + ": " + p.label);
      ++n;
    }
    legend.push_back({series[i] + " (" + std::to_string(n) + ")",
                      {st.color, st.marker == svg::Marker::cross ? st.color : "#222", 0.6, 1, ""},
                      st.marker});
  }
  svg::TextStyle lt;
  lt.size = 12;
  lt.bold = true;
  doc.text({area.right() + 24, area.y + 4}, "series (cases)", lt);
  double ly = area.y + 24;
  for (const svg::LegendEntry& e : legend) {
    ly += svg::draw_legend(doc, area.right() + 24, ly, 220, {e});
  }
  doc.save(path);
}

}  // namespace fp8mla::cli
