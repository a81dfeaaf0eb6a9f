#pragma once
// `apus pull`: a Hugging Face repository into the local cache with libcurl, laid out as
// huggingface_hub lays it out (io/hf_cache.h), so Python tools and apus share the download. The
// file list and hashes come from the hub's API (/api/models/ID/revision/REV?blobs=true); every file
// goes to blobs/ under its hash (LFS: sha256, checked after download; others: the git blob id),
// partial downloads resume from a .incomplete file, and snapshots/COMMIT/PATH links to it. The
// endpoint is $HF_ENDPOINT (default https://huggingface.co); the token $HF_TOKEN, else the file
// huggingface_hub writes ($HF_TOKEN_PATH, else $HF_HOME/token, else ~/.cache/huggingface/token).
#include <functional>
#include <string>

namespace apus {

// Returns the snapshot folder; `say` gets a line per file and progress lines for large ones.
std::string hf_pull(const std::string& repo_id, const std::string& revision,
                    const std::function<void(const std::string&)>& say);

// A file's sha256 as 64 lowercase hex digits (what the hub lists for LFS files).
std::string sha256_of(const std::string& path);

}  // namespace apus
