#include "server/history.h"

#include <cstdio>
#include <filesystem>

#include "io/files.h"

namespace apus::server {

namespace fs = std::filesystem;

namespace {

std::string extension_of_type(const std::string& mime) {
  return mime == "image/png"    ? ".png"
         : mime == "image/jpeg" ? ".jpg"
         : mime == "image/webp" ? ".webp"
         : mime == "audio/flac" ? ".flac"
                                : ".wav";
}

// A record apus wrote: an object with a job id, its files each a plain name in the folder.
bool well_formed(const Json& r, const std::string& dir) {
  if (!r.is_object() || !r.contains("id") || !r["id"].is_string() || !r.contains("stored") || !r["stored"].is_array())
    return false;
  for (const Json& s : r["stored"]) {
    if (!s.is_object() || !s.contains("file") || !s["file"].is_string() || !s.contains("mime") ||
        !s["mime"].is_string())
      return false;
    const std::string name = s["file"].get<std::string>();
    if (name.find('/') != std::string::npos || name.starts_with(".") || !fs::is_regular_file(dir + "/" + name))
      return false;
  }
  return true;
}

}  // namespace

History::History(std::string dir) : dir_(std::move(dir)) {
  if (dir_.empty()) return;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_, ec)) {
    const std::string path = e.path().string();
    if (e.path().extension() != ".json" || !e.is_regular_file()) continue;
    Json r = Json::parse(read_file(path), nullptr, false);
    if (!well_formed(r, dir_) || r["id"].get<std::string>() + ".json" != e.path().filename().string()) {
      std::fprintf(stderr, "serve: %s is no job record of apus's (skipped)\n", path.c_str());
      continue;
    }
    const std::string id = r["id"].get<std::string>();
    records_[id] = std::move(r);
  }
}

void History::keep(const Json& job, const std::vector<JobOutput>& outputs) {
  if (dir_.empty()) return;
  const std::string id = job["id"].get<std::string>();
  // The job as GET /v1/jobs/ID shows it once done (the worker reports it before its state says
  // so), without its last preview.
  Json record = job;
  record["state"] = "done";
  record["progress"] = 1.0;
  record.erase("preview");
  record["files"] = Json::array();
  for (size_t n = 0; n < outputs.size(); ++n)
    record["files"].push_back("/v1/jobs/" + id + "/files/" + std::to_string(n));
  record["stored"] = Json::array();
  try {
    for (size_t n = 0; n < outputs.size(); ++n) {
      const JobOutput& o = outputs[n];
      const std::string name = id + "-" + std::to_string(n) + extension_of_type(o.mime);
      write_whole_file(dir_ + "/" + name, o.bytes.data(), o.bytes.size());
      record["stored"].push_back({{"file", name}, {"mime", o.mime}, {"seed", o.seed}});
    }
    const std::string text = dump(record);
    write_whole_file(dir_ + "/" + id + ".json", text.data(), text.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve: job %s was not kept in %s: %s\n", id.c_str(), dir_.c_str(), e.what());
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  records_[id] = std::move(record);
}

std::map<std::string, Json> History::records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return records_;
}

std::optional<Json> History::record(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = records_.find(id);
  if (it == records_.end()) return std::nullopt;
  return it->second;
}

std::optional<JobOutput> History::file(const std::string& id, size_t n) const {
  const std::optional<Json> r = record(id);
  if (!r || n >= (*r)["stored"].size()) return std::nullopt;
  const Json& s = (*r)["stored"][n];
  const std::string bytes = read_file(dir_ + "/" + s["file"].get<std::string>());
  return JobOutput{std::vector<uint8_t>(bytes.begin(), bytes.end()), s["mime"].get<std::string>(),
                   s.value("seed", uint64_t{0})};
}

bool History::remove(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = records_.find(id);
  if (it == records_.end()) return false;
  std::error_code ec;
  // The record first: a file left by a failure is an orphan, never a record without its file.
  fs::remove(dir_ + "/" + id + ".json", ec);
  for (const Json& s : it->second["stored"]) fs::remove(dir_ + "/" + s["file"].get<std::string>(), ec);
  records_.erase(it);
  return true;
}

}  // namespace apus::server
