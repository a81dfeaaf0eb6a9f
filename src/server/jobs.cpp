#include "server/jobs.h"

#include <cstdio>
#include <new>

#include "core/error.h"
#include "dist/world.h"

namespace apus::server {

const char* state_name(JobState s) {
  switch (s) {
    case JobState::queued:
      return "queued";
    case JobState::running:
      return "running";
    case JobState::done:
      return "done";
    case JobState::failed:
      return "failed";
    case JobState::cancelled:
      return "cancelled";
  }
  return "unknown";
}

void Job::progress(const std::string& line) {
  note_step(line);
  if (cancel) throw Cancelled();
}

void Job::note_step(const std::string& line) {
  int i = 0, n = 0;
  if (std::sscanf(line.c_str(), "step %d/%d", &i, &n) == 2) {
    std::lock_guard<std::mutex> lock(mutex);
    step = i;
    steps = n;
    changed.notify_all();
  }
}

ModelWorker::ModelWorker(size_t capacity, std::function<void(const Job&, JobState)> finished)
    : capacity_(capacity), finished_(std::move(finished)), thread_([this] { run(); }) {}

ModelWorker::~ModelWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    for (const auto& job : queue_) job->cancel = true;
    if (running_) running_->cancel = true;  // it stops at its next op
  }
  wake_.notify_all();
  thread_.join();
}

bool ModelWorker::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (queue_.size() >= capacity_) return false;
    queue_.push_back(job);
  }
  wake_.notify_one();
  return true;
}

size_t ModelWorker::waiting() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

bool ModelWorker::full() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size() >= capacity_;
}

bool ModelWorker::busy() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return running_ || !queue_.empty();
}

bool ModelWorker::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return running_ != nullptr;
}

void ModelWorker::cancel_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& job : queue_) job->cancel = true;
  if (running_) running_->cancel = true;
}

void ModelWorker::run() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = queue_.front();
      queue_.pop_front();
      running_ = job;
    }
    auto finish = [&](JobState s, std::vector<JobOutput> outputs, std::string error, int status,
                      std::string field = "") {
      {
        std::lock_guard<std::mutex> lock(job->mutex);
        job->outputs = std::move(outputs);
      }
      if (finished_) finished_(*job, s);
      {
        std::lock_guard<std::mutex> lock(job->mutex);
        job->state = s;
        job->error = std::move(error);
        job->error_status = status;
        job->error_field = std::move(field);
        job->changed.notify_all();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      running_.reset();
    };
    if (job->cancel) {
      finish(JobState::cancelled, {}, "cancelled", 499);
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(job->mutex);
      job->state = JobState::running;
      job->started = std::chrono::steady_clock::now();
      job->changed.notify_all();
    }
    try {
      std::vector<JobOutput> outputs = job->work(*job);
      finish(JobState::done, std::move(outputs), "", 0);
    } catch (const dist::RanksLost& e) {
      // The other ranks are gone: this request cannot finish, and the job is ending.
      finish(JobState::failed, {}, e.what(), 503);
    } catch (const FieldError& e) {
      finish(JobState::failed, {}, e.what(), 400, e.field);
    } catch (const Error& e) {
      // The engine's errors name what the request got wrong (or that it was cancelled).
      if (job->cancel) finish(JobState::cancelled, {}, "cancelled", 499);
      else finish(JobState::failed, {}, e.what(), 400);
    } catch (const std::bad_alloc&) {
      // The engine names the sizes it allocates; this is a library's or the STL's allocation.
      finish(JobState::failed, {}, "the server ran out of memory running this request (an allocation failed)", 503);
    } catch (const std::exception& e) {
      finish(JobState::failed, {}, e.what(), 500);
    }
  }
}

}  // namespace apus::server
