#include "tools/fp8mla/svg/chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace fp8mla::svg {

Scale Scale::linear(double lo, double hi, double p0, double p1) {
  Scale s;
  if (!(hi > lo)) hi = lo + 1;
  s.lo_ = lo;
  s.hi_ = hi;
  s.p0_ = p0;
  s.p1_ = p1;
  return s;
}

Scale Scale::log10(double lo, double hi, double p0, double p1) {
  Scale s;
  lo = std::max(lo, 1e-12);
  hi = std::max(hi, lo * 10);
  s.lo_ = lo;
  s.hi_ = hi;
  s.p0_ = p0;
  s.p1_ = p1;
  s.log_ = true;
  return s;
}

double Scale::operator()(double v) const {
  double t;
  if (log_) {
    v = std::max(v, lo_ * 1e-3);
    t = (std::log10(v) - std::log10(lo_)) / (std::log10(hi_) - std::log10(lo_));
  } else {
    t = (v - lo_) / (hi_ - lo_);
  }
  return p0_ + t * (p1_ - p0_);
}

std::vector<double> Scale::ticks(int approx) const {
  std::vector<double> out;
  if (log_) {
    for (double v = std::pow(10.0, std::ceil(std::log10(lo_) - 1e-9)); v <= hi_ * 1.0001; v *= 10)
      out.push_back(v);
    return out;
  }
  const double raw = (hi_ - lo_) / std::max(approx, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (const double m : {1.0, 2.0, 2.5, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  for (double v = std::ceil(lo_ / step - 1e-9) * step; v <= hi_ + step * 1e-9; v += step) {
    out.push_back(std::abs(v) < step * 1e-9 ? 0.0 : v);
  }
  return out;
}

std::string tick_label(double v) {
  char buf[32];
  const double a = std::abs(v);
  auto trim = [](std::string s) {
    if (s.find('.') != std::string::npos) {
      while (s.back() == '0') s.pop_back();
      if (s.back() == '.') s.pop_back();
    }
    return s;
  };
  if (a == 0) return "0";
  if (a >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f", v / 1e6);
    return trim(buf) + "M";
  }
  if (a >= 1e4) {
    std::snprintf(buf, sizeof buf, "%.1f", v / 1e3);
    return trim(buf) + "k";
  }
  if (a >= 1) {
    std::snprintf(buf, sizeof buf, "%.2f", v);
    return trim(buf);
  }
  if (a >= 1e-3) {
    std::snprintf(buf, sizeof buf, "%.4f", v);
    return trim(buf);
  }
  std::snprintf(buf, sizeof buf, "%.0e", v);
  return buf;
}

double text_width(std::string_view text, double size) {
  return 0.6 * size * static_cast<double>(text.size());
}

void draw_axes(Svg& svg, const Area& area, const Scale* x, const Scale& y, std::string_view x_label,
               std::string_view y_label) {
  const Style grid{"", "#e3e3e3", 1, 1, ""};
  const Style axis{"", "#555", 1, 1, ""};
  TextStyle tick;
  tick.size = 11;
  tick.fill = "#444";
  tick.anchor = Anchor::end;
  for (const double v : y.ticks()) {
    const double py = y(v);
    if (py < area.y - 0.5 || py > area.bottom() + 0.5) continue;
    svg.line({area.x, py}, {area.right(), py}, grid);
    svg.text({area.x - 6, py + 4}, tick_label(v), tick);
  }
  if (x != nullptr) {
    tick.anchor = Anchor::middle;
    for (const double v : x->ticks()) {
      const double px = (*x)(v);
      if (px < area.x - 0.5 || px > area.right() + 0.5) continue;
      svg.line({px, area.y}, {px, area.bottom()}, grid);
      svg.text({px, area.bottom() + 16}, tick_label(v), tick);
    }
  }
  svg.line({area.x, area.y}, {area.x, area.bottom()}, axis);
  svg.line({area.x, area.bottom()}, {area.right(), area.bottom()}, axis);
  TextStyle label;
  label.size = 12;
  label.fill = "#222";
  label.anchor = Anchor::middle;
  if (!x_label.empty()) svg.text({area.x + area.w / 2, area.bottom() + 36}, x_label, label);
  if (!y_label.empty()) {
    label.rotate = -90;
    svg.text({area.x - 48, area.y + area.h / 2}, y_label, label);
  }
}

void draw_marker(Svg& svg, Point at, Marker shape, double size, const Style& style,
                 std::string_view tooltip) {
  const double r = size / 2;
  switch (shape) {
    case Marker::square:
      svg.rect(at.x - r, at.y - r, size, size, style, tooltip);
      break;
    case Marker::circle:
      svg.circle(at, r, style, tooltip);
      break;
    case Marker::triangle:
      svg.polygon({{at.x, at.y - r * 1.15},
                   {at.x + r * 1.1, at.y + r * 0.8},
                   {at.x - r * 1.1, at.y + r * 0.8}},
                  style, tooltip);
      break;
    case Marker::diamond:
      svg.polygon(
          {{at.x, at.y - r * 1.3}, {at.x + r, at.y}, {at.x, at.y + r * 1.3}, {at.x - r, at.y}},
          style, tooltip);
      break;
    case Marker::cross: {
      Style s = style;
      if (s.stroke.empty()) s.stroke = s.fill;
      s.stroke_width = std::max(2.0, s.stroke_width);
      svg.line({at.x - r, at.y - r}, {at.x + r, at.y + r}, s);
      svg.line({at.x - r, at.y + r}, {at.x + r, at.y - r}, s);
      break;
    }
    case Marker::line: {
      Style s = style;
      if (s.stroke.empty()) s.stroke = s.fill;
      s.fill.clear();
      s.stroke_width = std::max(2.0, s.stroke_width);
      svg.line({at.x - size, at.y}, {at.x + size, at.y}, s);
      break;
    }
  }
}

double draw_legend(Svg& svg, double x, double y, double max_width,
                   const std::vector<LegendEntry>& entries) {
  constexpr double kSize = 11, kRow = 18;
  TextStyle t;
  t.size = 11.5;
  t.fill = "#222";
  double cx = x, cy = y;
  for (const LegendEntry& e : entries) {
    const double w = kSize + 6 + text_width(e.label, t.size) + 16;
    if (cx > x && cx + w > x + max_width) {
      cx = x;
      cy += kRow;
    }
    draw_marker(svg, {cx + kSize / 2 + (e.marker == Marker::line ? 4 : 0), cy}, e.marker,
                e.marker == Marker::line ? 8 : kSize, e.style);
    svg.text({cx + kSize + 6 + (e.marker == Marker::line ? 6 : 0), cy + 4}, e.label, t);
    cx += w + (e.marker == Marker::line ? 6 : 0);
  }
  return cy - y + kRow;
}

}  // namespace fp8mla::svg
