#pragma once
// `apus bench --chart`: horizontal stacked bars in SVG, one bar per measured request type, A/B arm
// or floor, one segment per stage, so a result reads at a glance in a browser.
#include <string>
#include <utility>
#include <vector>

namespace apus {

struct Bar {
  std::string label;
  std::vector<std::pair<std::string, double>> segments;  // (stage, seconds), drawn in order
};

// Segments of one stage name share a colour across bars; the legend lists the stages once.
std::string stacked_bars_svg(const std::string& title, const std::vector<Bar>& bars);

}  // namespace apus
