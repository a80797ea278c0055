// Chart pieces on top of the SVG writer: linear and log scales with readable ticks, axes with
// grid lines, point markers and a legend. Each plot of the command composes these.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "tools/fp8mla/svg/svg.h"

namespace fp8mla::svg {

// The plotting area in pixels.
struct Area {
  double x = 0, y = 0, w = 0, h = 0;
  double right() const { return x + w; }
  double bottom() const { return y + h; }
};

// Maps data values in [lo, hi] to pixels in [p0, p1] (p1 < p0 for a y axis growing upward).
class Scale {
 public:
  static Scale linear(double lo, double hi, double p0, double p1);
  // Ticks at the whole decades inside [lo, hi].
  static Scale log10(double lo, double hi, double p0, double p1);
  double operator()(double v) const;
  // Linear: 1-2-5 steps, about `approx` of them; log: every decade.
  std::vector<double> ticks(int approx = 6) const;
  bool is_log() const { return log_; }
  double lo() const { return lo_; }
  double hi() const { return hi_; }

 private:
  double lo_ = 0, hi_ = 1, p0_ = 0, p1_ = 1;
  bool log_ = false;
};

// "0", "2.5", "40", "1.5k", "2M", "0.001" (short labels for ticks).
std::string tick_label(double v);

// Frame, ticks, grid lines and labels. `x` may be null for a categorical x axis (bars), whose
// labels the plot draws itself.
void draw_axes(Svg& svg, const Area& area, const Scale* x, const Scale& y, std::string_view x_label,
               std::string_view y_label);

enum class Marker { square, circle, triangle, diamond, cross, line };

void draw_marker(Svg& svg, Point at, Marker shape, double size, const Style& style,
                 std::string_view tooltip = {});

struct LegendEntry {
  std::string label;
  Style style;
  Marker marker = Marker::square;
};

// Entries flowed left to right from (x, y), wrapping at x + max_width; returns the height used.
double draw_legend(Svg& svg, double x, double y, double max_width,
                   const std::vector<LegendEntry>& entries);

// A rough text width for layout (DejaVu Sans: ~0.6 em a character).
double text_width(std::string_view text, double size);

}  // namespace fp8mla::svg
