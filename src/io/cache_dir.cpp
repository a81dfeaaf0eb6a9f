#include "io/cache_dir.h"

#include <cstdlib>

namespace apus {

std::string apus_cache_dir() {
  auto env = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value && *value ? value : "";
  };
  if (const std::string dir = env("APUS_CACHE_DIR"); !dir.empty()) return dir;
  if (const std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty()) return xdg + "/apus";
  return env("HOME") + "/.cache/apus";
}

}  // namespace apus
