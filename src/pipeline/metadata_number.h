#pragma once
// A setting's value as the files' metadata writes it: printf's %g (4, 0.8, 3.5).
#include <cstdio>
#include <string>

namespace apus {

inline std::string metadata_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

}  // namespace apus
