// The jobs' bookkeeping (submitted, waited on, kept once finished) and the asynchronous routes.
#include <chrono>
#include <cstdio>
#include <random>

#include "io/files.h"
#include "io/media/png.h"
#include "server/server_impl.h"

namespace apus::server {

std::string new_job_id() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  char id[40];
  std::snprintf(id, sizeof id, "job-%08llx%06llx", static_cast<unsigned long long>(salt & 0xffffffffu),
                static_cast<unsigned long long>(++counter));
  return id;
}

namespace {
[[noreturn]] void queue_full(const Loaded& m) { refuse(429, "the queue of model '" + m.id + "' is full"); }
}  // namespace

PreviewSink preview_sink(Job& j, int index) {
  return [&j, index](const Preview& p) {
    Json out = {{"index", index}, {"step", p.step}, {"steps", p.steps}};
    if (!p.image.rgb.empty())
      out["image"] = base64(encode_png(p.image.width, p.image.height, p.image.rgb, {}, "preview"));
    if (!p.peaks.empty()) out["peaks"] = p.peaks;
    std::lock_guard<std::mutex> lock(j.mutex);
    j.preview = dump(out);
    ++j.preview_count;
    j.changed.notify_all();
  };
}

void Server::Impl::refuse_if_full(const Loaded& m) const {
  if (m.worker->full()) queue_full(m);
}

void Server::Impl::submit(const std::shared_ptr<Job>& job) {
  if (draining) throw HttpError{503, "the server is shutting down", ""};
  job->id = new_job_id();
  for (Loaded& m : models)
    if (m.id == job->model) {
      if (!m.worker->submit(job)) queue_full(m);
      std::lock_guard<std::mutex> lock(jobs_mutex);
      jobs[job->id] = job;
      return;
    }
}

void Server::Impl::run_sync(const http::Request& req, const std::shared_ptr<Job>& j) {
  submit(j);
  wait_for_client(req, *j);
  finish_sync(*j);
}

std::shared_ptr<Job> Server::Impl::held(const std::string& id) {
  std::lock_guard<std::mutex> lock(jobs_mutex);
  const auto it = jobs.find(id);
  return it == jobs.end() ? nullptr : it->second;
}

std::shared_ptr<Job> Server::Impl::job(const std::string& id) {
  std::shared_ptr<Job> j = held(id);
  if (!j) refuse(404, "no job '" + id + "'");
  return j;
}

void Server::Impl::wait_for_client(const http::Request& req, Job& j) {
  std::unique_lock<std::mutex> lock(j.mutex);
  while (!j.changed.wait_for(lock, std::chrono::milliseconds(100), [&] {
    return j.state == JobState::done || j.state == JobState::failed || j.state == JobState::cancelled;
  })) {
    lock.unlock();
    if (!j.cancel && req.client_gone()) j.cancel = true;
    lock.lock();
  }
}

void Server::Impl::drop_kept(const Job& j) {
  std::lock_guard<std::mutex> lock(jobs_mutex);
  jobs.erase(j.id);
  for (auto it = finished.begin(); it != finished.end(); ++it)
    if (it->first == j.id) {
      finished_bytes -= it->second;
      finished.erase(it);
      break;
    }
}

void Server::Impl::finish_sync(const Job& j) {
  drop_kept(j);
  fail_job(j);
}

void Server::Impl::job_finished(const Job& j) {
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(j.mutex);
    for (const JobOutput& o : j.outputs) bytes += o.bytes.size();
  }
  std::lock_guard<std::mutex> lock(jobs_mutex);
  finished.emplace_back(j.id, bytes);
  finished_bytes += bytes;
  while ((finished_bytes > options.kept_results_bytes || finished.size() > kKeptJobs) && finished.size() > 1) {
    jobs.erase(finished.front().first);
    finished_bytes -= finished.front().second;
    finished.pop_front();
  }
}

std::string Server::Impl::public_message(const std::string& message) const {
  std::string out = message;
  for (const std::string& dir : {options.lora_dir, options.output_dir}) {
    if (dir.empty()) continue;
    const std::string prefix = dir + "/";
    for (size_t at = out.find(prefix); at != std::string::npos; at = out.find(prefix, at)) out.erase(at, prefix.size());
  }
  return out;
}

void Server::Impl::fail_job(const Job& j) const {
  std::lock_guard<std::mutex> lock(j.mutex);
  if (j.state == JobState::failed) refuse(j.error_status, j.error, j.error_field);  // made public as it is sent
  if (j.state == JobState::cancelled) refuse(499, "the job was cancelled");
}

Json Server::Impl::job_json(const Job& j, bool with_results) {
  std::lock_guard<std::mutex> lock(j.mutex);
  Json out = {{"id", j.id},
              {"created", j.created},
              {"model", j.model},
              {"kind", j.kind},
              {"state", state_name(j.state)},
              {"step", j.step},
              {"steps", j.steps},
              {"progress", j.state == JobState::done ? 1.0
                           : j.steps                 ? double(j.step) / j.steps
                                                     : 0.0}};
  if (!j.error.empty()) out["error"] = public_message(j.error);
  if (j.traced) out["trace"] = "/v1/jobs/" + j.id + "/trace";
  if (!j.preview.empty()) out["preview"] = Json::parse(j.preview);
  if (!j.params.is_null()) out["params"] = j.params;
  if (!j.split.empty()) out["split"] = j.split;
  if (j.state == JobState::done) {
    Json files = Json::array(), seeds = Json::array();
    for (size_t n = 0; n < j.outputs.size(); ++n) {
      files.push_back("/v1/jobs/" + j.id + "/files/" + std::to_string(n));
      seeds.push_back(j.outputs[n].seed);
    }
    out["files"] = files;
    out["seeds"] = seeds;
  }
  if (j.state == JobState::done && with_results) {
    Json results = Json::array();
    for (const JobOutput& o : j.outputs)
      results.push_back({{"b64", base64(o.bytes)}, {"mime", o.mime}, {"seed", o.seed}});
    out["results"] = results;
  }
  return out;
}

// Server-sent events: a "preview" event with each preview a job asked for (its JSON: index,
// step, steps and a base64 PNG or the waveform's peaks), a "progress" event whenever the step
// or state changes, then "done" with the job's final state (its files included) and the stream
// ends. A client that goes away cancels the job.
void Server::Impl::job_events(const http::Request& req, http::Response& res) {
  const auto j = job(req.matches[1]);
  struct Sent {
    int state = -1, step = -1, previews = 0;
    std::chrono::steady_clock::time_point at = std::chrono::steady_clock::now();
  };
  auto sent = std::make_shared<Sent>();
  auto over = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.content_type = "text/event-stream";
  res.stream = http::Stream{
      [this, j, sent, over]() -> std::optional<std::string> {
        if (*over) return std::nullopt;
        JobState state;
        int step;
        std::string events;
        {
          std::lock_guard<std::mutex> lock(j->mutex);
          state = j->state;
          step = j->step;
          // A slow reader gets the latest preview, not a backlog.
          if (j->preview_count != sent->previews) events = "event: preview\ndata: " + j->preview + "\n\n";
          sent->previews = j->preview_count;
        }
        *over = state == JobState::done || state == JobState::failed || state == JobState::cancelled;
        const auto now = std::chrono::steady_clock::now();
        if (int(state) == sent->state && step == sent->step && !*over) {
          if (!events.empty()) return events;
          if (now - sent->at < std::chrono::seconds(15)) return std::string();  // nothing yet
          sent->at = now;
          return std::string(": waiting\n\n");  // a comment every 15 s keeps it open
        }
        sent->at = now;
        sent->state = int(state);
        sent->step = step;
        return events + "event: " + (*over ? "done" : "progress") + "\ndata: " + dump(job_json(*j, *over)) + "\n\n";
      },
      [j] { j->cancel = true; }};
}

void Server::Impl::submit_job(const http::Request& req, http::Response& res) {
  Json body = parse_body(req);
  const Fields f{body};
  const std::string kind = f.string("kind", "");
  if (kind != "image" && kind != "audio") refuse(400, "'kind' must be \"image\" or \"audio\"", "kind");
  const bool trace = f.boolean("trace", false), previews = f.boolean("preview", false);
  body.erase("kind");
  body.erase("trace");
  body.erase("preview");
  std::string format;
  const auto j = kind == "image" ? openai_image_job(body, {}, trace) : audio_job(body, format, trace);
  j->previews = previews;
  submit(j);
  res.status = 202;
  res.set_content(dump(job_json(*j)), "application/json");
}

// Every job the server holds (queued, running, and the finished ones it keeps) and every job
// --output-dir kept, by when each was made, their files by url; paged as OpenAI's lists are:
// ?order=asc|desc (asc), ?limit=N (1-1000; all by default), ?after=ID (those after that one).
void Server::Impl::list_jobs(const http::Request& req, http::Response& res) {
  std::map<std::string, Json> all = history->records();
  for (auto& [id, r] : all) r.erase("stored");
  std::vector<std::shared_ptr<Job>> held;
  {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    for (const auto& [id, j] : jobs) held.push_back(j);
  }
  for (const auto& j : held) all[j->id] = job_json(*j, false);
  std::vector<Json> list;
  for (auto& [id, r] : all) list.push_back(std::move(r));
  const std::string order = req.query("order").value_or("asc");
  if (order != "asc" && order != "desc") refuse(400, "'order' is \"" + order + "\", expected asc or desc", "order");
  std::stable_sort(list.begin(), list.end(), [&](const Json& a, const Json& b) {
    const auto ka = std::pair{a.value("created", int64_t{0}), a["id"].get<std::string>()};
    const auto kb = std::pair{b.value("created", int64_t{0}), b["id"].get<std::string>()};
    return order == "asc" ? ka < kb : kb < ka;
  });
  if (const std::optional<std::string> after = req.query("after")) {
    const auto at = std::find_if(list.begin(), list.end(), [&](const Json& r) { return r["id"] == *after; });
    if (at == list.end()) refuse(404, "'after' names no job: '" + *after + "'", "after");
    list.erase(list.begin(), at + 1);
  }
  size_t limit = list.size();
  if (const std::optional<std::string> text = req.query("limit")) {
    const Json n = Json::parse(*text, nullptr, false);
    if (!n.is_number_integer() || n.get<int64_t>() < 1 || n.get<int64_t>() > 1000)
      refuse(400, "'limit' is \"" + *text + "\", expected a whole number 1-1000", "limit");
    limit = std::min(limit, size_t(n.get<int64_t>()));
  }
  const bool more = list.size() > limit;
  list.resize(limit);
  Json data = Json::array();
  for (Json& r : list) data.push_back(std::move(r));
  Json out = {{"object", "list"}, {"data", data}, {"has_more", more}};
  out["first_id"] = data.empty() ? Json(nullptr) : data.front()["id"];
  out["last_id"] = data.empty() ? Json(nullptr) : data.back()["id"];
  res.set_content(dump(out), "application/json");
}

Json Server::Impl::kept_job_json(const std::string& id) {
  std::optional<Json> r = history->record(id);
  if (!r) refuse(404, "no job '" + id + "'");
  r->erase("stored");
  return *r;
}

// A job the server holds (its results inline once done), or one --output-dir kept (its files by url).
void Server::Impl::job_status(const http::Request& req, http::Response& res) {
  const std::shared_ptr<Job> j = held(req.matches[1]);
  res.set_content(dump(j ? job_json(*j) : kept_job_json(req.matches[1])), "application/json");
}

// A finished job's n-th result file as it was made (what an OpenAI url response names), while
// the job is kept in memory or by --output-dir.
void Server::Impl::job_file(const http::Request& req, http::Response& res) {
  const std::string id = req.matches[1];
  const size_t n = std::stoul(req.matches[2]);
  const std::shared_ptr<Job> j = held(id);
  if (!j) {
    const Json kept = kept_job_json(id);  // 404 when neither holds it
    const std::optional<JobOutput> o = history->file(id, n);
    if (!o)
      refuse(
          404,
          "job " + id + " made " + std::to_string(kept["files"].size()) + " file(s), not a file " + std::to_string(n),
          "files");
    return res.set_content(std::string(o->bytes.begin(), o->bytes.end()), o->mime);
  }
  std::lock_guard<std::mutex> lock(j->mutex);
  if (j->state != JobState::done)
    refuse(409, "job " + j->id + " is " + state_name(j->state) + ": its files come when it is done", "files");
  if (n >= j->outputs.size())
    refuse(404,
           "job " + j->id + " made " + std::to_string(j->outputs.size()) + " file(s), not a file " + std::to_string(n),
           "files");
  const JobOutput& o = j->outputs[n];
  res.set_content(std::string(o.bytes.begin(), o.bytes.end()), o.mime);
}

// A traced job's timeline, for ui.perfetto.dev (docs/BENCH.md describes it).
void Server::Impl::job_trace(const http::Request& req, http::Response& res) {
  const auto j = job(req.matches[1]);
  if (!j->traced) refuse(404, "job " + j->id + " was not traced (submit it with \"trace\": true)", "trace");
  std::lock_guard<std::mutex> lock(j->mutex);
  if (j->state != JobState::done)
    refuse(409, "job " + j->id + " is " + state_name(j->state) + ": its trace comes when it is done", "trace");
  res.set_content(j->trace, "application/json");
}

// A queued or running job is cancelled (answered with its JSON); a finished one is deleted, from
// the server's memory and from --output-dir's history, files and record.
void Server::Impl::cancel_job(const http::Request& req, http::Response& res) {
  const std::string id = req.matches[1];
  const std::shared_ptr<Job> j = held(id);
  if (j) {
    bool active;
    {
      std::lock_guard<std::mutex> lock(j->mutex);
      active = j->state == JobState::queued || j->state == JobState::running;
    }
    if (active) {
      j->cancel = true;
      return res.set_content(dump(job_json(*j)), "application/json");
    }
    drop_kept(*j);
  }
  if (!history->remove(id) && !j) refuse(404, "no job '" + id + "'");
  res.set_content(dump(Json{{"id", id}, {"object", "job"}, {"deleted", true}}), "application/json");
}

}  // namespace apus::server
