#pragma once
// What `apus serve --output-dir DIR` keeps of the jobs that finished: each done job's files
// (ID-N.png, .jpg, .webp, .wav, .flac) and its record, ID.json (the job as GET /v1/jobs/ID shows
// it: the settings it ran with, when it was made, and its files' names, types and seeds), each
// written whole under a temporary name and renamed, the record last. The records are read back
// when the server starts, so the job list, the files and deletion outlast a restart.
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "server/fields.h"
#include "server/jobs.h"

namespace apus::server {

class History {
 public:
  // dir empty: keeps nothing. A record that is not one apus wrote (unreadable, no id, a file
  // missing) is skipped, named on stderr.
  explicit History(std::string dir);
  bool keeps() const { return !dir_.empty(); }
  // A done job (`job`: its JSON) and its files; a file that cannot be written is reported on
  // stderr and the job is not kept.
  void keep(const Json& job, const std::vector<JobOutput>& outputs);
  // The kept jobs' JSON, by id.
  std::map<std::string, Json> records() const;
  std::optional<Json> record(const std::string& id) const;
  // A kept job's n-th file, read from the folder; nullopt when the job or the file is not kept.
  std::optional<JobOutput> file(const std::string& id, size_t n) const;
  // Deletes a kept job's files and record; false when it is not kept.
  bool remove(const std::string& id);

 private:
  std::string dir_;
  mutable std::mutex mutex_;
  std::map<std::string, Json> records_;  // each with "stored": [{"file", "mime", "seed"}]
};

}  // namespace apus::server
