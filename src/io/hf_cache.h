#pragma once
// Hugging Face's local cache, as huggingface_hub lays it out: $HF_HUB_CACHE, else $HF_HOME/hub,
// else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; a repository
// ORG/NAME under models--ORG--NAME/ with blobs/ (files by hash), snapshots/REV/ (the tree at a
// commit, links into blobs/) and refs/BRANCH (the commit a branch was at when downloaded).
#include <optional>
#include <string>

#include "apus/apus.h"

namespace apus {

std::string hf_hub_cache();
// Whether `id` has the shape of a repository id (ORG/NAME of letters, digits, '-', '_', '.').
bool is_repo_id(const std::string& id);
// The repository's folder in the cache (it may not exist).
std::string hf_repo_dir(const std::string& repo_id);
// The snapshot folder of `revision` (a branch named in refs/, or a commit hash) if downloaded.
std::optional<std::string> hf_cached_snapshot(const std::string& repo_id, const std::string& revision = "main");

// What --model names as a directory: itself, a repository id's snapshot of main in the cache, or
// for counting a published name whose layout (configs, no weights) ships in data/ ("flux2-klein-4b").
std::string resolve_model_dir(const std::string& model, Weights weights);

// "org/name" for a cache snapshot (models--org--name/snapshots/<rev>), else the folder's own name:
// what a PNG's metadata calls the model.
std::string model_label(const std::string& dir);

}  // namespace apus
