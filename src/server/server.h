#pragma once
// `apus serve`: the loaded models behind an HTTP API. Each model is loaded once (resident) and
// has its own worker and bounded queue (server/jobs.h). The routes (OpenAI's images and audio,
// the jobs, AUTOMATIC1111's, the service's own) are one table in routes.cpp, listed by
// route_list() and in docs/USAGE.md. Errors are JSON {"error": {"message", "type", "param"}}:
// 400 bad request, 401 no or wrong key, 404 unknown model or job, 413 body too large or a
// request beyond --max-request-seconds, 429 queue full (with Retry-After).
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "apus/apus.h"

namespace apus::server {

class Ranks;

struct ServeOptions {
  std::vector<ModelParts> models;  // model directories, or single files with their parts
  std::string host = "127.0.0.1";
  int port = 8080;                     // 0: any free port
  size_t queue = 4;                    // jobs that may wait per model beside the running one
  std::string api_key;                 // empty: no key asked (GET /health never asks)
  std::string cors;                    // an origin allowed to call from a browser; empty: no CORS
  size_t max_body = size_t(32) << 20;  // bytes; audio inputs arrive as base64 in the body
  std::string device = "cpu";          // where every model runs: cpu, or cuda[:N]
  // A client must send its request line and headers within this (a kept-alive connection's wait
  // for its next request included), and a body at 64 KiB/s after it.
  double header_seconds = 10;
  size_t max_connections = 512, max_connections_per_address = 64;
  // Finished jobs' files kept for GET /v1/jobs/{id}, in bytes: the oldest are dropped beyond it
  // (the newest is kept whatever its size).
  size_t kept_results_bytes = size_t(256) << 20;
  // The LoRAs clients may name ("loras": [{"name", "scale"}]): the safetensors files directly in
  // this folder, by file name. Empty: requests take none. Clients never name paths.
  std::string lora_dir;
  // A request whose floor (the cost model's count at this machine's calibrated rate: a time no
  // run can beat) passes this many seconds is refused with 413 naming the estimate, so one
  // request cannot hold a model's worker for longer unasked. 0: no bound.
  double max_request_seconds = 900;
  // The kept history: every finished job's files (ID-N.png, .jpg, .webp, .wav, .flac) and record
  // (ID.json), read back at start (server/history.h). Empty: nothing kept beyond memory.
  std::string output_dir;
  // Model names clients send, answered by a loaded model (--alias NAME=MODEL): a name an app
  // hard-codes. OpenAI's own (gpt-image-1, dall-e-3, tts-1, ...) answer with the server's model of
  // their kind unless an alias or a loaded model takes the name.
  std::map<std::string, std::string> aliases;
  // Under mpirun or srun, on rank 0: every request runs over the ranks (server/ranks.h). Null:
  // this process alone.
  Ranks* ranks = nullptr;
};

class Server {
 public:
  // Loads every model (bf16, resident); refuses a directory that holds no model apus serves.
  explicit Server(ServeOptions options);
  ~Server();
  // Binds and serves on a background thread; returns the bound port.
  int start();
  void stop();
  // Graceful shutdown: new jobs are refused (503), running and waiting ones may finish for up to
  // `drain_seconds`, the rest are cancelled, then the server stops.
  void shutdown(double drain_seconds);
  // Every route the server answers, method and path pattern, in the route table's order
  // (routes.cpp; the CORS preflight, on with --cors only, is not among them).
  static std::vector<std::pair<std::string, std::string>> route_list();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace apus::server
