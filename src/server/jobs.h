#pragma once
// The server's unit of work: a job runs one request (or one batch) on one loaded model, on that
// model's own worker thread, one job at a time (a request uses every core). Each model has a
// bounded queue; a full queue refuses new jobs at once (the route answers 429).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace apus::server {

enum class JobState { queued, running, done, failed, cancelled };

const char* state_name(JobState s);

// One output file of a job: an image (PNG) or a clip (WAV / FLAC).
struct JobOutput {
  std::vector<uint8_t> bytes;
  std::string mime;
  uint64_t seed = 0;
};

struct Job {
  std::string id, model, kind;  // kind: "image" or "audio"
  // Runs the request, reporting each step; fills outputs or throws. Set before submitting.
  std::function<std::vector<JobOutput>(Job&)> work;

  std::atomic<bool> cancel{false};  // checked before every op of the run
  std::atomic<bool> finish{false};  // ends the sampling after its current step; the rest runs (A1111's interrupt)
  mutable std::mutex mutex;
  std::condition_variable changed;
  JobState state = JobState::queued;
  int step = 0, steps = 0;
  std::string error;
  int error_status = 0;     // the HTTP status an error maps to: 400 (the request), 500 (the engine)
  std::string error_field;  // ... and the request's field it concerns, if one
  std::vector<JobOutput> outputs;
  std::vector<std::pair<std::string, double>> stages;  // the run's stage times (name, seconds)
  bool traced = false;                                 // the request asked for its timeline (set before submitting)
  bool previews = false;                               // ... for live previews (set before submitting)
  std::string preview;                                 // the latest preview as JSON (see job_routes.cpp)
  int preview_count = 0;                               // previews kept so far
  std::string trace;                                   // ... Chrome trace-event JSON once done (GET /v1/jobs/ID/trace)
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  int64_t created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();  // Unix seconds, as OpenAI's `created`
  // The settings the request ran with, as the jobs API takes them back (set by its work when
  // done): what a kept record and the page's "reuse" read.
  nlohmann::json params;
  std::chrono::steady_clock::time_point started;  // when it began to run (its state running)
  std::string split;  // under mpirun: how the request ran over the ranks ("cfg over 2 ranks")

  // Records "step i/n" progress lines; throws to stop the run when the job is cancelled.
  void progress(const std::string& line);
  // Records it only: a request over several ranks stops where they agree (pipeline/split.h).
  void note_step(const std::string& line);
  void keep_trace(const std::string& timeline) {
    std::lock_guard<std::mutex> lock(mutex);
    trace = timeline;
  }
};

class ModelWorker {
 public:
  // `finished` sees every job as it ends (done, failed or cancelled: the state given), on the
  // worker thread, its outputs in place, before anyone waiting on the job learns of it.
  ModelWorker(size_t capacity, std::function<void(const Job&, JobState)> finished);
  ~ModelWorker();
  ModelWorker(const ModelWorker&) = delete;
  ModelWorker& operator=(const ModelWorker&) = delete;
  // Queues the job; false (and nothing queued) when `capacity` jobs already wait.
  bool submit(const std::shared_ptr<Job>& job);
  size_t waiting() const;
  // Whether a job submitted now would be refused (`capacity` jobs wait).
  bool full() const;
  // Whether a job runs or waits; whether one runs.
  bool busy() const;
  bool running() const;
  // Cancels the waiting jobs and the running one (at its next sampler step).
  void cancel_all();

 private:
  size_t capacity_;
  std::function<void(const Job&, JobState)> finished_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::shared_ptr<Job> running_;
  bool stopping_ = false;
  std::thread thread_;
  void run();
};

}  // namespace apus::server
