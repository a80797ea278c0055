#include "tools/fp8mla/svg/svg.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace fp8mla::svg {
namespace {

std::string style_attrs(const Style& s) {
  std::string a;
  a += " fill=\"" + (s.fill.empty() ? std::string("none") : escape(s.fill)) + "\"";
  if (!s.stroke.empty()) {
    a += " stroke=\"" + escape(s.stroke) + "\" stroke-width=\"" + num(s.stroke_width) + "\"";
    if (!s.dash.empty()) a += " stroke-dasharray=\"" + escape(s.dash) + "\"";
  }
  if (s.opacity < 1) a += " opacity=\"" + num(s.opacity) + "\"";
  return a;
}

// An element, wrapped in a group with a <title> (a hover tooltip) when there is one.
void emit(std::string& body, const std::string& element, std::string_view tooltip) {
  if (tooltip.empty()) {
    body.append(element).append("/>\n");
    return;
  }
  body.append("<g>").append(element).append("/><title>");
  body.append(escape(tooltip)).append("</title></g>\n");
}

// "x,y x,y ...".
std::string points_text(const std::vector<Point>& points) {
  std::string p;
  for (const Point& q : points) {
    if (!p.empty()) p.push_back(' ');
    p.append(num(q.x)).push_back(',');
    p.append(num(q.y));
  }
  return p;
}

}  // namespace

std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        // Control characters are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\n' || c == '\t') out += c;
        break;
    }
  }
  return out;
}

std::string num(double v) {
  if (!std::isfinite(v)) return "0";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  std::string s = buf;
  while (!s.empty() && s.back() == '0') s.pop_back();
  if (!s.empty() && s.back() == '.') s.pop_back();
  if (s == "-0") s = "0";
  return s;
}

Svg::Svg(double width, double height, std::string_view title)
    : width_(width), height_(height), title_(title) {}

void Svg::rect(double x, double y, double w, double h, const Style& style,
               std::string_view tooltip) {
  if (w < 0) {
    x += w;
    w = -w;
  }
  if (h < 0) {
    y += h;
    h = -h;
  }
  const std::string shape = "<rect x=\"" + num(x) + "\" y=\"" + num(y) + "\" width=\"" + num(w) +
                            "\" height=\"" + num(h) + "\"" + style_attrs(style);
  emit(body_, shape, tooltip);
}

void Svg::line(Point a, Point b, const Style& style) {
  body_ += "<line x1=\"" + num(a.x) + "\" y1=\"" + num(a.y) + "\" x2=\"" + num(b.x) + "\" y2=\"" +
           num(b.y) + "\"" + style_attrs(style) + "/>\n";
}

void Svg::polyline(const std::vector<Point>& points, const Style& style) {
  emit(body_, "<polyline points=\"" + points_text(points) + "\"" + style_attrs(style), {});
}

void Svg::polygon(const std::vector<Point>& points, const Style& style, std::string_view tooltip) {
  emit(body_, "<polygon points=\"" + points_text(points) + "\"" + style_attrs(style), tooltip);
}

void Svg::circle(Point c, double r, const Style& style, std::string_view tooltip) {
  const std::string shape = "<circle cx=\"" + num(c.x) + "\" cy=\"" + num(c.y) + "\" r=\"" +
                            num(r) + "\"" + style_attrs(style);
  emit(body_, shape, tooltip);
}

void Svg::text(Point at, std::string_view text, const TextStyle& style) {
  const char* anchor = style.anchor == Anchor::middle ? "middle"
                       : style.anchor == Anchor::end  ? "end"
                                                      : "start";
  body_ += "<text x=\"" + num(at.x) + "\" y=\"" + num(at.y) + "\" font-size=\"" + num(style.size) +
           "\" text-anchor=\"" + anchor + "\" fill=\"" + escape(style.fill) + "\"";
  if (style.bold) body_ += " font-weight=\"bold\"";
  if (style.rotate != 0) {
    body_ += " transform=\"rotate(" + num(style.rotate) + " " + num(at.x) + " " + num(at.y) + ")\"";
  }
  body_.append(">").append(escape(text)).append("</text>\n");
}

std::string Svg::hatch(std::string_view id, std::string_view color, std::string_view background) {
  defs_ += "<pattern id=\"" + escape(id) +
           "\" patternUnits=\"userSpaceOnUse\" width=\"6\" height=\"6\" "
           "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"" +
           escape(background) + "\"/><line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"" +
           escape(color) + "\" stroke-width=\"3\"/></pattern>\n";
  return "url(#" + std::string(id) + ")";
}

std::string Svg::str() const {
  std::string out =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
      num(width_) + "\" height=\"" + num(height_) + "\" viewBox=\"0 0 " + num(width_) + " " +
      num(height_) + "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n";
  out += "<title>" + escape(title_) + "</title>\n";
  if (!defs_.empty()) out += "<defs>\n" + defs_ + "</defs>\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += body_;
  out += "</svg>\n";
  return out;
}

void Svg::save(const std::string& path) const {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  f << str();
  if (!f) throw std::runtime_error("error writing " + path);
}

}  // namespace fp8mla::svg
