#include "chart.h"

#include <algorithm>
#include <cstdio>

namespace apus {

namespace {

// Text as XML character data.
std::string escaped(const std::string& s) {
  std::string out;
  for (char c : s) {
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
      default:
        out += c;
    }
  }
  return out;
}

std::string format(const char* f, double a, double b = 0, double c = 0, double d = 0) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, a, b, c, d);
  return buf;
}

}  // namespace

std::string stacked_bars_svg(const std::string& title, const std::vector<Bar>& bars) {
  // Colour-blind-safe palette (Okabe-Ito), in order of first appearance of a stage.
  static const char* const palette[] = {"#0072B2", "#E69F00", "#009E73", "#CC79A7",
                                        "#56B4E9", "#D55E00", "#F0E442", "#999999"};
  std::vector<std::string> stages;
  double longest = 0;
  for (const Bar& b : bars) {
    double total = 0;
    for (const auto& [stage, seconds] : b.segments) {
      if (std::find(stages.begin(), stages.end(), stage) == stages.end()) stages.push_back(stage);
      total += seconds;
    }
    longest = std::max(longest, total);
  }
  const double left = 220, width = 560, bar_h = 26, gap = 12, top = 44;
  const double height = top + double(bars.size()) * (bar_h + gap) + 24 + 20 * double((stages.size() + 3) / 4);
  const double scale = longest > 0 ? width / longest : 0;
  auto colour = [&](const std::string& stage) {
    const size_t i = size_t(std::find(stages.begin(), stages.end(), stage) - stages.begin());
    return std::string(palette[i % (sizeof palette / sizeof *palette)]);
  };
  std::string svg =
      format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" ", left + width + 100, height) +
      "font-family=\"sans-serif\" font-size=\"12\">\n";
  svg += "<title>" + escaped(title) + "</title>\n";
  svg += "<text x=\"10\" y=\"22\" font-size=\"15\" font-weight=\"bold\">" + escaped(title) + "</text>\n";
  for (size_t i = 0; i < bars.size(); ++i) {
    const double y = top + double(i) * (bar_h + gap);
    svg += format("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">", left - 8, y + bar_h * 0.65) +
           escaped(bars[i].label) + "</text>\n";
    double x = left, total = 0;
    for (const auto& [stage, seconds] : bars[i].segments) {
      const double w = seconds * scale;
      svg += format("<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" ", x, y, w, bar_h) + "fill=\"" +
             colour(stage) + "\"><title>" + escaped(stage) + format(": %.4g s</title></rect>\n", seconds);
      x += w;
      total += seconds;
    }
    svg += format("<text x=\"%.1f\" y=\"%.1f\">", x + 6, y + bar_h * 0.65) + format("%.3g s", total) + "</text>\n";
  }
  const double legend = top + double(bars.size()) * (bar_h + gap) + 12;
  for (size_t i = 0; i < stages.size(); ++i) {
    const double x = 10 + double(i % 4) * 200, y = legend + double(i / 4) * 20;
    svg += format("<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" ", x, y) + "fill=\"" + colour(stages[i]) +
           "\"/>" + format("<text x=\"%.0f\" y=\"%.0f\">", x + 18, y + 10) + escaped(stages[i]) + "</text>\n";
  }
  return svg + "</svg>\n";
}

}  // namespace apus
