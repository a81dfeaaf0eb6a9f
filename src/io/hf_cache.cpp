#include "io/hf_cache.h"
#include "core/error.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "io/model_dir.h"
#include "io/weights/synth.h"

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

std::string resolve_model_dir(const std::string& model, Weights weights) {
  if (is_directory(model)) return model;
  APUS_CHECK(!path_exists(model), model, ": is a file, expected a model directory");
  // A repository id as Hugging Face users name models: its snapshot of main in the local cache.
  if (const std::optional<std::string> snapshot = hf_cached_snapshot(model)) return *snapshot;
  APUS_CHECK(!is_repo_id(model), model, ": not a directory, and not in the Hugging Face cache ", hf_repo_dir(model),
             " (download it with `apus pull ", model, "` or huggingface-cli download)");
  // Counting may name a published model whose configs ship in data/ ("flux2-klein-4b",
  // "stable-audio-3-medium").
  const bool plain_name = !model.empty() && model.find('/') == std::string::npos && model[0] != '.';
  const std::string published = plain_name ? published_layout_dir(model) : "";
  std::string names;
  for (const std::string& name : kPublishedModels) names += (names.empty() ? "" : ", ") + name;
  APUS_CHECK(weights == Weights::none && plain_name &&
                 (path_exists(published + "/model_index.json") || path_exists(published + "/model_config.json")),
             model, ": model directory does not exist",
             weights == Weights::none ? " (nor is it a published name: " + names + ")" : "");
  return published;
}

std::string model_label(const std::string& dir) {
  const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  for (const auto& part : p) {
    const std::string s = part.string();
    if (s.rfind("models--", 0) == 0) {
      std::string id = s.substr(8);
      const size_t sep = id.find("--");
      if (sep != std::string::npos) id.replace(sep, 2, "/");
      return id;
    }
  }
  const std::string name = (p.has_filename() ? p : p.parent_path()).filename().string();
  return name.empty() ? dir : name;
}

}  // namespace apus
