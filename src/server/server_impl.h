#pragma once
// The server's state, its routes' handlers and their shared steps, which the route files (openai.cpp,
// a1111.cpp, job_routes.cpp), the route table (routes.cpp) and the lifecycle (server.cpp) define
// between them.
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "apus/apus.h"
#include "cost/chips.h"
#include "io/media/image.h"
#include "pipeline/registry.h"
#include "server/fields.h"
#include "server/history.h"
#include "server/http.h"
#include "server/jobs.h"
#include "server/metrics.h"
#include "server/server.h"

namespace apus::server {

// What keeps request `index` of job j's live previews (Job::preview, the events route).
PreviewSink preview_sink(Job& j, int index);

struct Loaded {
  std::string id;
  AnyModel model;
  std::unique_ptr<ModelWorker> worker;
};

std::string new_job_id();

// The image files of a request, as sent: decoded on the model's worker as its job starts, so a
// request waiting in the queue (or refused by it) holds compressed bytes, never pixels.
// How a request's mask marks the area to repaint: white (diffusers', A1111's), fully transparent
// (OpenAI's edits) or black (A1111's inpainting_mask_invert).
enum class MaskMarks { white, transparent, black };

struct ImageFiles {
  std::vector<std::string> images;  // to edit from; with a mask, the first is the one repainted
  std::optional<std::string> mask;
  MaskMarks marks = MaskMarks::white;       // how the mask marks what to repaint
  bool repaint_whole = false;               // no mask: the first image repainted whole (A1111's img2img)
  double strength = Inpainting{}.strength;  // with the mask
  // The repainted image and its mask resized to these sides first (A1111's img2img), or as given;
  // crop: to cover them keeping the aspect, the overhang cut (A1111's resize_mode 1), else
  // stretched to them (0).
  std::optional<std::pair<int, int>> resize_to;
  bool crop = false;
  // What the results are written as (OpenAI's output_format and output_compression).
  ImageFormat format = ImageFormat::png;
  int quality = 100;
};

struct A1111Request;  // a1111.cpp
// An A1111 image field: base64, bare or as a data URL, refused naming `param` otherwise (a1111.cpp).
std::string a1111_image(const Json& value, const std::string& what, const char* param);

struct Server::Impl {
  ServeOptions options;
  std::vector<Loaded> models;
  std::unique_ptr<http::Server> http;
  std::mutex jobs_mutex;
  std::map<std::string, std::shared_ptr<Job>> jobs;
  // Finished jobs in the order they ended, with their files' bytes: GET /v1/jobs/{id} finds them
  // until options.kept_results_bytes (or kKeptJobs) is passed, the oldest dropped first.
  std::deque<std::pair<std::string, size_t>> finished;
  size_t finished_bytes = 0;
  std::unique_ptr<History> history;  // what --output-dir keeps (keeps nothing without it)
  Metrics metrics;
  std::atomic<bool> draining{false};
  std::shared_ptr<Job> a1111_current;  // the AUTOMATIC1111 routes' latest job (progress, interrupt)
  std::string a1111_checkpoint;        // the image model they render with (options' sd_model_checkpoint)

  // Before a job is queued: the engine's own checks of the request, and whether its counted
  // activations fit in the memory left beside the resident weights; a refusal is a 400 with the
  // engine's message, naming the route's field where the engine names one.
  static void admit(const FieldNames& names, const std::function<void()>& check);
  // A counted request against options.max_request_seconds (413 past it). The machine's rate is
  // calibrated only when a request could pass the bound even at 1 GFLOP/s and 1 GB/s.
  void check_time(const PipelineCost& cost);
  std::once_flag calibrated;
  Chip ceiling;
  const Loaded& find(const Fields& f, ModelKind kind);

  // An image job from an OpenAI images request: prompt, n, size "WxH", response_format
  // b64_json; apus's seed, steps, cfg and negative_prompt; images to edit from (JSON: base64 in
  // "images"), or with a mask and strength to inpaint.
  std::shared_ptr<Job> openai_image_job(const Json& body, ImageFiles files, bool trace = false);
  // A job rendering n images of `r` on m, refused before any file is decoded where the queue is
  // full or the files' headers claim too many pixels, then where the engine refuses its settings
  // (naming the field as `names` calls it); the files are decoded on the worker as it starts.
  std::shared_ptr<Job> image_job(const Loaded& m, ImageRequest r, int n, ImageFiles files, FieldNames names);
  // A request's "loras" ([{"name", "scale"}]) as files of options.lora_dir, refused naming the
  // entry where a name is no file there; the names GET /v1/loras lists.
  std::vector<Lora> requested_loras(const Json& list) const;
  std::vector<std::string> lora_names() const;
  // The loaded models a --lora-dir file adapts: those whose count() of a small request with it
  // passes (the family reads the file and holds every factor to a weight of that model, as a
  // request naming it is checked); cached per file until its size or time changes.
  std::vector<std::string> lora_models(const std::string& name);
  std::mutex lora_fits_mutex;
  std::map<std::string, std::pair<std::string, std::vector<std::string>>> lora_fits;  // name -> (size/time, models)
  // An audio job: prompt, seconds, seed, steps, cfg, apg, negative_prompt, format (wav, wav-float,
  // flac), the input clips.
  std::shared_ptr<Job> audio_job(const Json& body, std::string& format_name, bool trace = false);

  // A full queue refuses before anything of the request is decoded (429), as submit() would.
  void refuse_if_full(const Loaded& m) const;
  void submit(const std::shared_ptr<Job>& job);
  // A synchronous route's run: submitted, waited for (cancelled if the client leaves), finished.
  void run_sync(const http::Request& req, const std::shared_ptr<Job>& j);
  // A job the server holds: null (held) or 404 (job) when it holds none by that id.
  std::shared_ptr<Job> held(const std::string& id);
  std::shared_ptr<Job> job(const std::string& id);
  // A synchronous route's wait: the job cancelled if its client goes away meanwhile.
  static void wait_for_client(const http::Request& req, Job& j);
  // Runs an image job for a synchronous route and answers OpenAI's ImagesResponse.
  // The finished job's images as OpenAI answers them: base64, or urls of GET /v1/jobs/{id}/files/{n}.
  void respond_images(const http::Request& req, http::Response& res, const std::shared_ptr<Job>& j, bool urls);
  // OpenAI's streamed generation (stream: true): server-sent events, the live previews as up to
  // `partials` "image_generation.partial_image" events spread over the steps (at the image's size
  // and in its format and quality), then "image_generation.completed" with the image (or "error").
  void stream_image(http::Response& res, const std::shared_ptr<Job>& j, int partials, const std::string& format,
                    const std::string& size, int quality);
  // The finished job's clip as the answer's body (its seed in X-Seed).
  void respond_audio(const http::Request& req, http::Response& res, const std::shared_ptr<Job>& j);
  // Forgets a finished job a synchronous route answered (it is not kept for GET /v1/jobs/{id}).
  void drop_kept(const Job& j);
  // A synchronous route's job, once finished: forgotten (nobody polls it), its error raised.
  void finish_sync(const Job& j);
  // On the model's worker, as a job ends (its files in place, before its waiters learn of it).
  void job_finished(const Job& j);
  void fail_job(const Job& j) const;
  // An engine message as a client sees it: the server's own folders (--lora-dir, --output-dir)
  // taken out of the paths it names, which are the server's business.
  std::string public_message(const std::string& message) const;
  Json job_json(const Job& j, bool with_results = true);
  // A job --output-dir kept: its JSON as GET /v1/jobs/ID shows it; 404 when there is none.
  Json kept_job_json(const std::string& id);

  // The transport's hooks and the route table (routes.cpp).
  void routes();
  struct Route {
    const char* method;
    const char* pattern;  // matched against the whole path; its groups are Request::matches
    void (Impl::*handler)(const http::Request&, http::Response&);
  };
  static const Route kRoutes[];
  // The routes' handlers, each named in routes.cpp's table with its method and path.
  // The service's own (server.cpp).
  void metrics_text(const http::Request& req, http::Response& res);
  void page(const http::Request& req, http::Response& res);
  void health(const http::Request& req, http::Response& res);
  void list_models(const http::Request& req, http::Response& res);
  void list_loras(const http::Request& req, http::Response& res);
  // The asynchronous jobs: submit, poll, files, trace, cancel, and their event stream (job_routes.cpp).
  void job_events(const http::Request& req, http::Response& res);
  void submit_job(const http::Request& req, http::Response& res);
  void list_jobs(const http::Request& req, http::Response& res);
  void job_status(const http::Request& req, http::Response& res);
  void job_file(const http::Request& req, http::Response& res);
  void job_trace(const http::Request& req, http::Response& res);
  void cancel_job(const http::Request& req, http::Response& res);
  // OpenAI's images (generations, edits) and audio (apus's generations, its SDK's speech) (openai.cpp).
  void image_edits(const http::Request& req, http::Response& res);
  void image_generations(const http::Request& req, http::Response& res);
  void audio_generations(const http::Request& req, http::Response& res);
  void audio_speech(const http::Request& req, http::Response& res);
  // The AUTOMATIC1111 routes front ends call (a1111.cpp).
  void a1111_txt2img(const http::Request& req, http::Response& res);
  void a1111_img2img(const http::Request& req, http::Response& res);
  void a1111_progress(const http::Request& req, http::Response& res);
  void a1111_interrupt(const http::Request& req, http::Response& res);
  void a1111_sd_models(const http::Request& req, http::Response& res);
  void a1111_options(const http::Request& req, http::Response& res);
  void a1111_set_options(const http::Request& req, http::Response& res);
  void a1111_samplers(const http::Request& req, http::Response& res);
  void a1111_schedulers(const http::Request& req, http::Response& res);
  void a1111_upscalers(const http::Request& req, http::Response& res);
  void a1111_loras(const http::Request& req, http::Response& res);
  void a1111_refresh_loras(const http::Request& req, http::Response& res);
  void a1111_refresh_checkpoints(const http::Request& req, http::Response& res);
  void a1111_scripts(const http::Request& req, http::Response& res);
  void a1111_embeddings(const http::Request& req, http::Response& res);
  void a1111_none(const http::Request& req, http::Response& res);
  void a1111_cmd_flags(const http::Request& req, http::Response& res);
  void a1111_memory(const http::Request& req, http::Response& res);
  void a1111_png_info(const http::Request& req, http::Response& res);
  void a1111_extra_single(const http::Request& req, http::Response& res);  // a1111_extras.cpp
  void a1111_extra_batch(const http::Request& req, http::Response& res);
  // An A1111 image request run on the checkpoint the options chose (or its override), waited for and
  // answered; the checkpoint's model.
  void a1111_run(const http::Request& req, http::Response& res, const Json& in, A1111Request& a, ImageFiles files,
                 Json extra_info);
  const ImageModel& a1111_model();
};

}  // namespace apus::server
