// A small SVG writer for the command's pictures: shapes and text appended in drawing order,
// coordinates in pixels from the top-left corner, text escaped. It knows nothing of charts
// (see chart.h).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace fp8mla::svg {

struct Point {
  double x = 0, y = 0;
};

// Stroke and fill; an empty colour means none.
struct Style {
  std::string fill;
  std::string stroke;
  double stroke_width = 1;
  double opacity = 1;
  std::string dash;  // stroke-dasharray, e.g. "4 3"
};

enum class Anchor { start, middle, end };

struct TextStyle {
  double size = 12;
  Anchor anchor = Anchor::start;
  bool bold = false;
  std::string fill = "#222";
  double rotate = 0;  // degrees, about the text's anchor point
};

class Svg {
 public:
  Svg(double width, double height, std::string_view title);

  double width() const { return width_; }
  double height() const { return height_; }

  // `tooltip` becomes a <title> child: shown on hover by browsers.
  void rect(double x, double y, double w, double h, const Style& style,
            std::string_view tooltip = {});
  void line(Point a, Point b, const Style& style);
  void polyline(const std::vector<Point>& points, const Style& style);
  void polygon(const std::vector<Point>& points, const Style& style, std::string_view tooltip = {});
  void circle(Point c, double r, const Style& style, std::string_view tooltip = {});
  void text(Point at, std::string_view text, const TextStyle& style = {});
  // A diagonal-hatch pattern usable as a fill ("url(#id)").
  std::string hatch(std::string_view id, std::string_view color, std::string_view background);

  std::string str() const;
  // Writes the document to `path`; throws std::runtime_error naming the path on failure.
  void save(const std::string& path) const;

 private:
  double width_, height_;
  std::string title_;
  std::string defs_;
  std::string body_;
};

// "&amp;" etc.: text safe inside an element or an attribute.
std::string escape(std::string_view text);
// A number for a coordinate: at most 2 decimals, no trailing zeros.
std::string num(double v);

}  // namespace fp8mla::svg
