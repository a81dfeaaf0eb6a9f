#pragma once
// A setting's value as the files' metadata writes it: printf's %g (4, 0.8, 3.5).
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "apus/apus.h"

namespace apus {

inline std::string metadata_number(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

// A request's adapters as the metadata lists them: ", Lora: detail.safetensors:0.8" each.
inline std::string metadata_loras(const std::vector<Lora>& loras) {
  std::string s;
  for (const Lora& lora : loras)
    s += ", Lora: " + std::filesystem::path(lora.file).filename().string() + ":" + metadata_number(lora.scale);
  return s;
}

}  // namespace apus
