#include "io/hf_cache.h"

#include <cstdlib>
#include <fstream>

#include "io/model_dir.h"

namespace apus {

std::string hf_hub_cache() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v && *v ? v : "";
  };
  if (!env("HF_HUB_CACHE").empty()) return env("HF_HUB_CACHE");
  if (!env("HF_HOME").empty()) return env("HF_HOME") + "/hub";
  if (!env("XDG_CACHE_HOME").empty()) return env("XDG_CACHE_HOME") + "/huggingface/hub";
  return env("HOME") + "/.cache/huggingface/hub";
}

bool is_repo_id(const std::string& id) {
  const size_t slash = id.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == id.size() ||
      id.find('/', slash + 1) != std::string::npos)
    return false;
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                    c == '_' || c == '.' || i == slash;
    if (!ok) return false;
  }
  // No part may be "." or ".." (or start with '.'): names stay inside the cache.
  return id[0] != '.' && id[slash + 1] != '.';
}

std::string hf_repo_dir(const std::string& repo_id) {
  std::string folder = "models--" + repo_id;
  folder.replace(folder.find('/'), 1, "--");
  return hf_hub_cache() + "/" + folder;
}

std::optional<std::string> hf_cached_snapshot(const std::string& repo_id, const std::string& revision) {
  if (!is_repo_id(repo_id)) return std::nullopt;
  const std::string repo = hf_repo_dir(repo_id);
  std::string commit = revision;
  std::ifstream ref(repo + "/refs/" + revision);
  if (ref) std::getline(ref, commit);
  if (commit.empty() || commit.find('/') != std::string::npos || commit[0] == '.') return std::nullopt;
  const std::string snapshot = repo + "/snapshots/" + commit;
  if (!is_directory(snapshot)) return std::nullopt;
  return snapshot;
}

}  // namespace apus
