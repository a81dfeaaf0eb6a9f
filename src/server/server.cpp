#include "server/server.h"

#include <atomic>
#include <charconv>
#include <deque>
#include <chrono>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>
#include <tuple>
#include <unistd.h>

#include "apus/apus.h"
#include "core/error.h"
#include "io/audio.h"
#include "io/image.h"
#include "io/png.h"
#include "pipeline/infotext.h"
#include "pipeline/registry.h"
#include "pipeline/stage.h"
#include "server/http.h"
#include "server/jobs.h"
#include "server/bodies.h"
#include "server/web_page.h"

namespace apus::server {

namespace {

using Json = nlohmann::json;

// The service's own bounds, on what a request sends rather than what it asks the engine to do
// (whose bounds are the engine's, ImageLimits and AudioLimits, refused with its messages).
constexpr size_t kMaxPrompt = 4000;  // characters
constexpr size_t kMaxReferences = 4;  // reference images per edit
constexpr size_t kKeptJobs = 256;  // finished jobs kept for GET /v1/jobs/{id}, oldest dropped first

// A client mistake: the status, the message and the request field it concerns.
struct HttpError {
  int status;
  std::string message, param;
};

[[noreturn]] void refuse(int status, const std::string& message, const std::string& param = "") {
  throw HttpError{status, message, param};
}

// JSON text of an answer; bytes of a client's that are not UTF-8 (echoed in a message) become U+FFFD.
std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

void send_error(http::Response& res, int status, const std::string& message, const std::string& param) {
  const char* type = status == 401 ? "authentication_error" : status == 429 ? "rate_limit_error"
                     : status >= 500 ? "server_error" : "invalid_request_error";
  Json err = {{"message", message}, {"type", type}, {"param", param.empty() ? Json() : Json(param)}};
  res.status = status;
  res.set_content(dump(Json{{"error", err}}), "application/json");
}

std::string base64(const std::vector<uint8_t>& bytes) {
  static const char* table = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const uint32_t v = uint32_t(bytes[i]) << 16 | (i + 1 < bytes.size() ? uint32_t(bytes[i + 1]) << 8 : 0) |
                       (i + 2 < bytes.size() ? uint32_t(bytes[i + 2]) : 0);
    out += table[(v >> 18) & 63];
    out += table[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? table[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? table[v & 63] : '=';
  }
  return out;
}

// Strict base64 (padding optional, no whitespace); nullopt when the text is not base64.
std::optional<std::string> unbase64(const std::string& text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  size_t n = text.size();
  while (n > 0 && text[n - 1] == '=' && text.size() - n < 2) --n;
  std::string out;
  out.reserve(n * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = value(text[i]);
    if (v < 0) return std::nullopt;
    acc = acc << 6 | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xff));
    }
  }
  if (n % 4 == 1) return std::nullopt;
  return out;
}

// Typed field access with errors naming the field.
struct Fields {
  const Json& j;
  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  std::string string(const char* k, const std::string& fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_string()) refuse(400, std::string("'") + k + "' must be a string", k);
    return j[k].get<std::string>();
  }
  int64_t integer(const char* k, int64_t fallback, int64_t lo, int64_t hi) const {
    if (!has(k)) return fallback;
    if (!j[k].is_number_integer()) refuse(400, std::string("'") + k + "' must be an integer", k);
    const int64_t v = j[k].get<int64_t>();
    if (v < lo || v > hi)
      refuse(400, std::string("'") + k + "' is " + std::to_string(v) + ", expected " + std::to_string(lo) +
                      ".." + std::to_string(hi), k);
    return v;
  }
  double number(const char* k, double fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_number()) refuse(400, std::string("'") + k + "' must be a number", k);
    return j[k].get<double>();
  }
  bool boolean(const char* k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_boolean()) refuse(400, std::string("'") + k + "' must be true or false", k);
    return j[k].get<bool>();
  }
  // An integer the engine bounds (absent: the model's default); only what an int cannot hold is
  // refused here.
  std::optional<int> setting(const char* k) const {
    if (!has(k)) return std::nullopt;
    return int(integer(k, 0, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  }
  std::optional<uint64_t> seed() const {
    if (!has("seed")) return std::nullopt;
    return uint64_t(integer("seed", 0, 0, (int64_t(1) << 53)));
  }
  std::string prompt() const {
    const std::string p = string("prompt", "");
    if (p.empty()) refuse(400, "'prompt' is required and must not be empty", "prompt");
    if (p.size() > kMaxPrompt) refuse(400, "'prompt' is longer than " + std::to_string(kMaxPrompt) + " characters", "prompt");
    return p;
  }
  // OpenAI answers an argument it does not know with 400; so does apus, naming it.
  void only(const std::set<std::string>& known) const {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (!known.count(it.key())) refuse(400, "unrecognized request argument: '" + it.key() + "'", it.key());
  }
};

// A route's names for the engine's request fields where its body calls them otherwise (the
// engine's "batch" is OpenAI's n).
using FieldNames = std::map<std::string, std::string>;
const FieldNames kOpenAiImageFields = {{"width", "size"}, {"height", "size"}, {"batch", "n"}};
const FieldNames kA1111Fields = {{"batch", "batch_size"}, {"cfg", "cfg_scale"}};
const FieldNames kAudioFields = {};  // the audio route calls every field as the engine does

// Runs engine code, its refusal of a field renamed to the route's name for that field.
template <typename F>
auto as_route(const FieldNames& names, F&& f) {
  try {
    return f();
  } catch (const FieldError& e) {
    const auto it = names.find(e.field);
    if (it == names.end()) throw;
    throw FieldError(e.what(), it->second);
  }
}

Json parse_body(const http::Request& req) {
  try {
    return parse_json_object(req.body);
  } catch (const Error& e) {
    refuse(400, e.what());
  }
}

struct Loaded {
  std::string id, dir;
  AnyModel model;
  std::unique_ptr<ModelWorker> worker;
};

// Prometheus text exposition of what the server has done: requests and failures by route,
// the queues, each model's request and stage latencies as histograms, resident memory.
class Metrics {
 public:
  void request(const std::string& route, int status) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++requests_[route];
    if (status >= 400) ++failures_[{route, status}];
  }
  void job(const Job& j, JobState final_state) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++jobs_[{j.model, state_name(final_state)}];
    if (final_state != JobState::done) return;
    observe(latency_[j.model], std::chrono::duration<double>(std::chrono::steady_clock::now() - j.submitted).count());
    for (const auto& [stage, seconds] : j.stages) observe(stages_[{j.model, stage}], seconds);
  }
  // queues: per model, the jobs waiting and whether one runs.
  std::string text(const std::vector<std::tuple<std::string, size_t, bool>>& queues) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::string out;
    auto line = [&](const std::string& l) { out += l + "\n"; };
    line("# HELP apus_requests_total HTTP requests by route.");
    line("# TYPE apus_requests_total counter");
    for (const auto& [route, n] : requests_) line("apus_requests_total{route=\"" + route + "\"} " + std::to_string(n));
    line("# HELP apus_request_failures_total HTTP requests answered with an error, by route and status.");
    line("# TYPE apus_request_failures_total counter");
    for (const auto& [key, n] : failures_)
      line("apus_request_failures_total{route=\"" + key.first + "\",status=\"" + std::to_string(key.second) + "\"} " +
           std::to_string(n));
    line("# HELP apus_jobs_total Jobs ended, by model and state.");
    line("# TYPE apus_jobs_total counter");
    for (const auto& [key, n] : jobs_)
      line("apus_jobs_total{model=\"" + key.first + "\",state=\"" + key.second + "\"} " + std::to_string(n));
    line("# HELP apus_queue_depth Jobs waiting per model (the running one not counted).");
    line("# TYPE apus_queue_depth gauge");
    for (const auto& [model, n, running] : queues) line("apus_queue_depth{model=\"" + model + "\"} " + std::to_string(n));
    line("# HELP apus_jobs_running Jobs running per model (0 or 1).");
    line("# TYPE apus_jobs_running gauge");
    for (const auto& [model, n, running] : queues)
      line("apus_jobs_running{model=\"" + model + "\"} " + std::string(running ? "1" : "0"));
    histogram(out, "apus_request_seconds", "Submission to result, per model.", latency_,
              [](const std::string& m) { return "model=\"" + m + "\""; });
    histogram(out, "apus_stage_seconds", "Each stage's run (each sampler step on its own), per model.", stages_,
              [](const std::pair<std::string, std::string>& k) {
                return "model=\"" + k.first + "\",stage=\"" + k.second + "\"";
              });
    line("# HELP apus_resident_memory_bytes Resident memory of the server process.");
    line("# TYPE apus_resident_memory_bytes gauge");
    line("apus_resident_memory_bytes " + std::to_string(resident_bytes()));
    return out;
  }

 private:
  struct Histogram {
    std::vector<uint64_t> counts = std::vector<uint64_t>(kBounds.size(), 0);
    double sum = 0;
    uint64_t n = 0;
  };
  static inline const std::vector<double> kBounds = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
  static void observe(Histogram& h, double v) {
    for (size_t i = 0; i < kBounds.size(); ++i)
      if (v <= kBounds[i]) ++h.counts[i];
    h.sum += v;
    ++h.n;
  }
  template <typename Map, typename Labels>
  static void histogram(std::string& out, const std::string& name, const std::string& help, const Map& m, Labels labels) {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    for (const auto& [key, h] : m) {
      const std::string l = labels(key);
      for (size_t i = 0; i < kBounds.size(); ++i) {
        char le[32];
        std::snprintf(le, sizeof le, "%g", kBounds[i]);
        out += name + "_bucket{" + l + ",le=\"" + le + "\"} " + std::to_string(h.counts[i]) + "\n";
      }
      out += name + "_bucket{" + l + ",le=\"+Inf\"} " + std::to_string(h.n) + "\n";
      char sum[32];
      std::snprintf(sum, sizeof sum, "%.6f", h.sum);
      out += name + "_sum{" + l + "} " + sum + "\n" + name + "_count{" + l + "} " + std::to_string(h.n) + "\n";
    }
  }
  static uint64_t resident_bytes() {
    long pages = 0, resident = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
      std::fclose(f);
    }
    return uint64_t(resident) * uint64_t(sysconf(_SC_PAGESIZE));
  }
  mutable std::mutex mutex_;
  std::map<std::string, uint64_t> requests_;
  std::map<std::pair<std::string, int>, uint64_t> failures_;
  std::map<std::pair<std::string, std::string>, uint64_t> jobs_;
  std::map<std::string, Histogram> latency_;
  std::map<std::pair<std::string, std::string>, Histogram> stages_;
};

// A route's name for the metrics: job ids folded into one; requests no route took counted
// together (their paths are the client's to choose).
std::string route_name(const http::Request& req, const std::string& pattern) {
  if (pattern.empty()) return "unrouted";
  std::string path = req.path;
  if (path.rfind("/v1/jobs/", 0) == 0) {
    const size_t end = path.find('/', 9);
    path = "/v1/jobs/{id}" + (end == std::string::npos ? "" : path.substr(end));
  }
  return req.method + " " + path;
}

std::string new_job_id() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  char id[40];
  std::snprintf(id, sizeof id, "job-%08llx%06llx", static_cast<unsigned long long>(salt & 0xffffffffu),
                static_cast<unsigned long long>(++counter));
  return id;
}

}  // namespace

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
  Metrics metrics;
  std::atomic<bool> draining{false};
  std::shared_ptr<Job> a1111_current;  // the AUTOMATIC1111 routes' latest job (progress, interrupt)

  // Before a job is queued: the engine's own checks of the request, and whether its counted
  // activations fit in the memory left beside the resident weights; a refusal is a 400 with the
  // engine's message, naming the route's field where the engine names one.
  static void admit(const FieldNames& names, const std::function<void()>& check) {
    try {
      as_route(names, check);
    } catch (const FieldError& e) {
      refuse(400, e.what(), e.field);
    } catch (const Error& e) {
      refuse(400, e.what());
    }
  }

  const Loaded& find(const Fields& f, ModelKind kind) {
    const std::string name = f.string("model", "");
    for (const Loaded& m : models)
      if ((name.empty() && m.model.kind() == kind) || (!name.empty() && m.id == name)) {
        if (m.model.kind() != kind)
          refuse(400, "model '" + name + "' makes " + kind_name(m.model.kind()) + ", not " + kind_name(kind), "model");
        return m;
      }
    if (name.empty()) refuse(404, std::string("no ") + kind_name(kind) + " model is loaded", "model");
    refuse(404, "model '" + name + "' is not loaded (GET /v1/models lists them)", "model");
  }

  // The bytes of a file sent as base64 in a JSON field (`what` names it in errors).
  static std::string base64_file(const Json& value, const std::string& what, const char* param, const char* kind) {
    const std::optional<std::string> bytes = value.is_string() ? unbase64(value.get<std::string>()) : std::nullopt;
    if (!bytes || bytes->empty()) refuse(400, "'" + what + "' must be " + kind + " file as base64", param);
    return *bytes;
  }

  // A request's file decoded as its job runs; a refusal names the field it came in.
  template <typename Decode>
  static auto decoded(const std::string& bytes, const std::string& what, const std::string& field, Decode decode) {
    try {
      return decode(bytes, what);
    } catch (const Error& e) {
      throw FieldError(e.what(), field);
    }
  }

  // OpenAI's edits mask: a PNG whose fully transparent pixels mark the area to edit, as the
  // white of a diffusers mask.
  static Rgb8Image openai_mask(const std::string& bytes, const std::string& what) {
    PngImage png;
    try {
      png = decode_png(bytes, what, /*with_alpha=*/true);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (OpenAI's mask is a PNG with transparency)");
    }
    Rgb8Image white{png.width, png.height, std::vector<uint8_t>(png.rgb.size())};
    bool any = false;
    for (size_t i = 0; i < png.alpha.size(); ++i) {
      const uint8_t v = png.alpha[i] == 0 ? 255 : 0;
      any |= v != 0;
      std::memset(&white.rgb[3 * i], v, 3);
    }
    APUS_CHECK(any, "'mask' has no fully transparent pixel: OpenAI's mask marks the area to edit with alpha 0");
    return white;
  }

  // The image files of a request, as sent: decoded on the model's worker as its job starts, so a
  // request waiting in the queue (or refused by it) holds compressed bytes, never pixels.
  struct ImageFiles {
    std::vector<std::string> images;  // to edit from; with a mask, the first is the one repainted
    std::optional<std::string> mask;
    bool alpha_mask = false;  // OpenAI's edits mask (alpha 0 repaints), else white repaints
    double strength = Inpainting{}.strength;  // with the mask
  };

  // Files refused from their headers alone, before anything is decoded: what does not open, and
  // more pixels or frames than the decoders take.
  static void check_image_headers(const ImageFiles& files) {
    auto check = [](const std::string& bytes, const std::string& what, const char* field) {
      try {
        probe_image(bytes, what);
      } catch (const Error& e) {
        refuse(400, e.what(), field);
      }
    };
    for (size_t i = 0; i < files.images.size(); ++i) check(files.images[i], "images[" + std::to_string(i) + "]", "images");
    if (files.mask) check(*files.mask, "mask", "mask");
  }
  static void check_audio_header(const std::string& bytes, const char* field, double max_seconds) {
    try {
      probe_audio(bytes, field, max_seconds);
    } catch (const Error& e) {
      refuse(400, e.what(), field);
    }
  }

  // An image job from an OpenAI images request: prompt, n, size "WxH", response_format
  // b64_json; apus's seed, steps, cfg and negative_prompt; images to edit from (JSON: base64 in
  // "images"), or with a mask and strength to inpaint.
  std::shared_ptr<Job> openai_image_job(const Json& body, ImageFiles files, bool trace = false) {
    const Fields f{body};
    f.only({"model", "prompt", "n", "size", "response_format", "seed", "steps", "cfg", "negative_prompt", "images",
            "mask", "strength",
            "user", "quality", "style", "output_format", "output_compression", "background", "moderation"});
    const Loaded& m = find(f, ModelKind::image);
    ImageRequest r;
    r.prompt = f.prompt();
    const int n = f.setting("n").value_or(1);
    if (f.has("images")) {
      const Json& images = body["images"];
      if (!images.is_array() || images.empty() || images.size() > kMaxReferences)
        refuse(400, "'images' must be a list of 1 to " + std::to_string(kMaxReferences) + " base64 images", "images");
      for (size_t i = 0; i < images.size(); ++i)
        files.images.push_back(base64_file(images[i], "images[" + std::to_string(i) + "]", "images", "an image"));
    }
    if (f.has("mask")) files.mask = base64_file(body["mask"], "mask", "mask", "an image");
    if (files.images.size() > kMaxReferences)
      refuse(400, "at most " + std::to_string(kMaxReferences) + " images, not " + std::to_string(files.images.size()), "images");
    // Inpainting: the mask (white repaints, as diffusers' mask_image) applies to the first image,
    // as OpenAI's edits apply theirs; a second image is the reference for the repainted area.
    if (files.mask) {
      if (files.images.empty()) refuse(400, "'mask' repaints the first of 'images', and there are none", "mask");
      if (files.images.size() > 2)
        refuse(400, "with 'mask', 'images' holds the image to repaint and at most one reference", "images");
      files.strength = f.number("strength", files.strength);
    } else if (f.has("strength")) {
      refuse(400, "'strength' is for inpainting, with 'mask'", "strength");
    }
    const bool sized_by_image = !files.images.empty();
    const std::string size = f.string("size", sized_by_image ? "auto" : "1024x1024");
    if (size != "auto") {
      // Two whole numbers; what they may be is the engine's to say.
      const size_t x = size.find('x');
      auto whole = [](std::string_view text, int& v) {
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        return !text.empty() && ec == std::errc() && end == text.data() + text.size();
      };
      int w = 0, h = 0;
      if (x == std::string::npos || !whole(std::string_view(size).substr(0, x), w) ||
          !whole(std::string_view(size).substr(x + 1), h))
        refuse(400, "'size' is \"" + size + "\", expected WxH (or auto: the first image's)", "size");
      r.width = w;
      r.height = h;
    } else if (!sized_by_image) {
      refuse(400, "'size' auto takes the first of 'images', and there are none", "size");
    }
    r.steps = f.setting("steps");
    r.seed = f.seed();
    if (f.has("cfg")) r.cfg = float(f.number("cfg", 0.0));
    if (f.has("negative_prompt")) r.negative_prompt = f.string("negative_prompt", "");
    r.trace = trace;
    const std::string format = f.string("response_format", "b64_json");
    if (format != "b64_json") refuse(400, "'response_format' \"" + format + "\" is not supported (b64_json)", "response_format");
    if (f.string("output_format", "png") != "png") refuse(400, "'output_format' must be png", "output_format");
    // OpenAI's other image fields: accepted where apus has nothing to change (quality, style,
    // moderation, a PNG's compression), refused where it would change the image.
    if (f.string("background", "auto") != "auto" && f.string("background", "auto") != "opaque")
      refuse(400, "'background' transparent is not supported (the models render opaque images)", "background");
    return image_job(m, std::move(r), n, std::move(files), kOpenAiImageFields);
  }

  // A job rendering n images of `r` on m, refused before any file is decoded where the queue is
  // full or the files' headers claim too many pixels, then where the engine refuses its settings
  // (naming the field as `names` calls it); the files are decoded on the worker as it starts.
  std::shared_ptr<Job> image_job(const Loaded& m, ImageRequest r, int n, ImageFiles files, const FieldNames& names) {
    if (m.worker->full()) refuse(429, "the queue of model '" + m.id + "' is full");
    check_image_headers(files);
    // With image files, whose sizes decide what the request needs, the memory admission runs as
    // the job starts, once they are decoded.
    admit(names, [&] {
      const PipelineCost cost = m.model.image()->count(r, n);
      if (files.images.empty()) check_memory(cost, true, "this request");
    });
    auto job = std::make_shared<Job>();
    job->model = m.id;
    job->kind = "image";
    job->traced = r.trace;
    const ImageModel* model = m.model.image();
    job->work = [model, r, n, files = std::move(files), names = &names](Job& j) mutable {
      for (size_t i = 0; i < files.images.size(); ++i)
        r.references.push_back(decoded(files.images[i], "images[" + std::to_string(i) + "]", "images", decode_image));
      files.images.clear();
      if (files.mask) {
        Rgb8Image mask = decoded(*files.mask, "mask", "mask", files.alpha_mask ? openai_mask : decode_image);
        r.inpaint = Inpainting{std::move(r.references.front()), std::move(mask), files.strength};
        r.references.erase(r.references.begin());
      }
      const std::vector<ImageRequest> batch = batch_of(r, n);
      std::vector<JobOutput> out;
      const std::vector<ImageResult> results = as_route(*names, [&] {
        return model->generate_batch(batch, [&](const std::string& l) { j.progress(l); });
      });
      for (const StageTime& t : results.front().stages) j.stages.emplace_back(t.stage.empty() ? t.name : t.stage, t.seconds);
      j.keep_trace(results.front().trace);
      for (size_t i = 0; i < results.size(); ++i) {
        const ImageResult& res = results[i];
        out.push_back({encode_png(res.width, res.height, res.rgb, {{"parameters", infotext(batch[i], res, *model)}}, "image"),
                       "image/png", res.seed});
      }
      return out;
    };
    return job;
  }

  // An audio job: prompt, seconds, seed, steps, cfg, apg, negative_prompt, format (wav, wav-float,
  // flac), the input clips.
  std::shared_ptr<Job> audio_job(const Json& body, std::string& format_name, bool trace = false) {
    const Fields f{body};
    f.only({"model", "prompt", "seconds", "seed", "steps", "format", "negative_prompt", "cfg", "apg", "init_audio",
            "init_noise_level", "inpaint_audio", "inpaint_regions"});
    const Loaded& m = find(f, ModelKind::audio);
    AudioRequest r;
    r.prompt = f.prompt();
    r.seconds = f.number("seconds", r.seconds);
    r.steps = f.setting("steps").value_or(r.steps);
    r.seed = f.seed();
    r.cfg = float(f.number("cfg", r.cfg));
    r.apg = float(f.number("apg", r.apg));
    r.trace = trace;
    if (f.has("negative_prompt")) r.negative_prompt = f.string("negative_prompt", "");
    // Audio-to-audio and inpainting: the clips as base64 files (any rate libsndfile reads),
    // decoded on the model's worker as the job starts.
    std::optional<std::string> init_file, inpaint_file;
    if (f.has("init_audio")) init_file = base64_file(body["init_audio"], "init_audio", "init_audio", "an audio");
    if (f.has("init_noise_level")) r.init_noise_level = f.number("init_noise_level", 0.0);
    if (f.has("inpaint_audio")) inpaint_file = base64_file(body["inpaint_audio"], "inpaint_audio", "inpaint_audio", "an audio");
    if (f.has("inpaint_regions")) {
      const Json& regions = body["inpaint_regions"];
      if (!regions.is_array()) refuse(400, "'inpaint_regions' must be a list of [start, end] seconds", "inpaint_regions");
      for (const Json& region : regions) {
        if (!region.is_array() || region.size() != 2 || !region[0].is_number() || !region[1].is_number())
          refuse(400, "'inpaint_regions' must be a list of [start, end] seconds", "inpaint_regions");
        r.inpaint_regions.emplace_back(region[0].get<double>(), region[1].get<double>());
      }
    }
    format_name = f.string("format", "wav");
    AudioFormat format;
    try {
      format = parse_audio_format(format_name);
    } catch (const Error& e) {
      refuse(400, e.what(), "format");
    }
    if (m.worker->full()) refuse(429, "the queue of model '" + m.id + "' is full");
    for (const auto& [file, name] : {std::pair{&init_file, "init_audio"}, std::pair{&inpaint_file, "inpaint_audio"}})
      if (*file) check_audio_header(**file, name, m.model.audio()->max_seconds());
    // The clips' samples change nothing the engine checks or counts: empty ones stand in for the
    // files, decoded as the job starts.
    AudioRequest counted = r;
    if (init_file) counted.init_audio = AudioClip{};
    if (inpaint_file) counted.inpaint_audio = AudioClip{};
    admit(kAudioFields, [&] { check_memory(m.model.audio()->count(counted), true, "this request"); });
    auto job = std::make_shared<Job>();
    job->model = m.id;
    job->kind = "audio";
    job->traced = trace;
    const AudioModel* model = m.model.audio();
    job->work = [model, r, format, init_file, inpaint_file](Job& j) mutable {
      auto clip = [model](const std::string& bytes, const char* name) {
        Audio a = decoded(bytes, name, name, [&](const std::string& b, const std::string& what) {
          return decode_audio(b, what, model->max_seconds());
        });
        return AudioClip{a.rate, a.channels, std::move(a.samples)};
      };
      if (init_file) r.init_audio = clip(*init_file, "init_audio");
      if (inpaint_file) r.inpaint_audio = clip(*inpaint_file, "inpaint_audio");
      const AudioResult res = model->generate(r, [&](const std::string& l) { j.progress(l); });
      for (const StageTime& t : res.stages) j.stages.emplace_back(t.stage.empty() ? t.name : t.stage, t.seconds);
      j.keep_trace(res.trace);
      const Audio a{res.sample_rate, res.channels, res.samples};
      const std::string comment = audio_comment(r, res, *model, {"init_audio", "inpaint_audio"});
      return std::vector<JobOutput>{{encode_audio(a, format, {r.prompt, comment, "apus"}, "clip"),
                                     audio_mime_type(format), res.seed}};
    };
    return job;
  }

  void submit(const std::shared_ptr<Job>& job) {
    if (draining) throw HttpError{503, "the server is shutting down", ""};
    job->id = new_job_id();
    for (Loaded& m : models)
      if (m.id == job->model) {
        if (!m.worker->submit(job)) throw HttpError{429, "the queue of model '" + m.id + "' is full", ""};
        std::lock_guard<std::mutex> lock(jobs_mutex);
        jobs[job->id] = job;
        return;
      }
  }

  std::shared_ptr<Job> job(const std::string& id) {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    const auto it = jobs.find(id);
    if (it == jobs.end()) refuse(404, "no job '" + id + "'");
    return it->second;
  }

  // A synchronous route's wait: the job cancelled if its client goes away meanwhile.
  static void wait_for_client(const http::Request& req, Job& j) {
    std::unique_lock<std::mutex> lock(j.mutex);
    while (!j.changed.wait_for(lock, std::chrono::milliseconds(100), [&] {
      return j.state == JobState::done || j.state == JobState::failed || j.state == JobState::cancelled;
    })) {
      lock.unlock();
      if (!j.cancel && req.client_gone()) j.cancel = true;
      lock.lock();
    }
  }

  // A synchronous route's job, once finished: forgotten (nobody polls it), its error raised.
  // Runs an image job for a synchronous route and answers OpenAI's ImagesResponse.
  void respond_images(const http::Request& req, http::Response& res, const std::shared_ptr<Job>& j) {
    submit(j);
    wait_for_client(req, *j);
    finish_sync(*j);
    Json data = Json::array();
    for (const JobOutput& o : j->outputs) data.push_back({{"b64_json", base64(o.bytes)}, {"seed", o.seed}});
    res.set_content(dump(Json{{"created", int64_t(std::time(nullptr))}, {"data", data}}), "application/json");
  }

  void finish_sync(const Job& j) {
    {
      std::lock_guard<std::mutex> lock(jobs_mutex);
      jobs.erase(j.id);
      for (auto it = finished.begin(); it != finished.end(); ++it)
        if (it->first == j.id) {
          finished_bytes -= it->second;
          finished.erase(it);
          break;
        }
    }
    fail_job(j);
  }

  // On the model's worker, as a job ends (its files in place, before its waiters learn of it).
  void job_finished(const Job& j) {
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

  static void fail_job(const Job& j) {
    std::lock_guard<std::mutex> lock(j.mutex);
    if (j.state == JobState::failed) refuse(j.error_status, j.error, j.error_field);
    if (j.state == JobState::cancelled) refuse(499, "the job was cancelled");
  }

  Json job_json(const Job& j, bool with_results = true) {
    std::lock_guard<std::mutex> lock(j.mutex);
    Json out = {{"id", j.id}, {"model", j.model}, {"kind", j.kind}, {"state", state_name(j.state)},
                {"step", j.step}, {"steps", j.steps},
                {"progress", j.state == JobState::done ? 1.0 : j.steps ? double(j.step) / j.steps : 0.0}};
    if (!j.error.empty()) out["error"] = j.error;
    if (j.traced) out["trace"] = "/v1/jobs/" + j.id + "/trace";
    if (j.state == JobState::done && with_results) {
      Json results = Json::array();
      for (const JobOutput& o : j.outputs) results.push_back({{"b64", base64(o.bytes)}, {"mime", o.mime}, {"seed", o.seed}});
      out["results"] = results;
    }
    return out;
  }

  // The AUTOMATIC1111 routes front ends call: txt2img (its field names; fields apus does not know
  // are ignored, as A1111 ignores them), progress of the latest txt2img, interrupt.
  void registerA1111() {
    http->route("POST", "/sdapi/v1/txt2img", [this](const http::Request& req, http::Response& res) {
      const Json in = parse_body(req);
      const Fields f{in};
      const Loaded& m = find(Fields{Json::object()}, ModelKind::image);
      const ImageModel& model = *m.model.image();
      ImageRequest r;
      r.prompt = f.prompt();
      // A1111's own defaults, for the sides its clients always send.
      r.width = f.setting("width").value_or(512);
      r.height = f.setting("height").value_or(512);
      r.steps = f.setting("steps");
      const int64_t seed = f.integer("seed", -1, -1, int64_t(1) << 53);
      if (seed >= 0) r.seed = uint64_t(seed);
      // A1111 clients always send a guidance scale (7 by default): the -base models take it, the
      // distilled ones have none to take; a negative prompt the engine refuses for them.
      if (model.takes_guidance() && f.has("cfg_scale")) r.cfg = float(f.number("cfg_scale", 0.0));
      const std::string negative = f.string("negative_prompt", "");
      if (!negative.empty()) r.negative_prompt = negative;
      if (f.integer("n_iter", 1, 1, 1) != 1) refuse(400, "'n_iter' must be 1", "n_iter");
      const int n = f.setting("batch_size").value_or(1);
      const auto j = image_job(m, r, n, {}, kA1111Fields);
      submit(j);
      {
        std::lock_guard<std::mutex> lock(jobs_mutex);
        a1111_current = j;
      }
      wait_for_client(req, *j);
      finish_sync(*j);
      Json images = Json::array(), seeds = Json::array();
      for (const JobOutput& o : j->outputs) {
        images.push_back(base64(o.bytes));
        seeds.push_back(o.seed);
      }
      const Json info = {{"prompt", r.prompt}, {"all_prompts", Json::array({r.prompt})}, {"negative_prompt", negative},
                         {"cfg_scale", r.cfg.value_or(model.default_cfg())}, {"seed", seeds[0]}, {"all_seeds", seeds},
                         {"width", *r.width}, {"height", *r.height}, {"steps", r.steps.value_or(model.default_steps())},
                         {"batch_size", n}, {"sd_model_name", j->model}};
      res.set_content(dump(Json{{"images", images}, {"parameters", in}, {"info", dump(info)}}), "application/json");
    });
    http->route("GET", "/sdapi/v1/progress", [this](const http::Request&, http::Response& res) {
      std::shared_ptr<Job> j;
      {
        std::lock_guard<std::mutex> lock(jobs_mutex);
        j = a1111_current;
      }
      Json state = {{"skipped", false}, {"interrupted", false}, {"job", ""}, {"job_count", 0},
                    {"job_timestamp", "0"}, {"job_no", 0}, {"sampling_step", 0}, {"sampling_steps", 0}};
      double progress = 0;
      if (j) {
        std::lock_guard<std::mutex> lock(j->mutex);
        const bool active = j->state == JobState::queued || j->state == JobState::running;
        state["interrupted"] = j->state == JobState::cancelled;
        state["job"] = active ? j->id : "";
        state["job_count"] = active ? 1 : 0;
        state["sampling_step"] = j->step;
        state["sampling_steps"] = j->steps;
        progress = active && j->steps ? double(j->step) / j->steps : 0.0;
      }
      res.set_content(dump(Json{{"progress", progress}, {"eta_relative", 0.0}, {"state", state},
                                {"current_image", nullptr}, {"textinfo", nullptr}}),
                      "application/json");
    });
    http->route("POST", "/sdapi/v1/interrupt", [this](const http::Request&, http::Response& res) {
      std::lock_guard<std::mutex> lock(jobs_mutex);
      if (a1111_current) a1111_current->cancel = true;
      res.set_content("{}", "application/json");
    });
  }

  void routes() {
    http::Limits limits;
    limits.max_body = options.max_body;
    limits.header_seconds = options.header_seconds;
    limits.max_connections = options.max_connections;
    limits.max_connections_per_address = options.max_connections_per_address;
    // A synchronous request holds a handler thread while its job waits and runs: enough for
    // every model's full queue plus the quick routes and event streams beside them.
    limits.threads = 16 + models.size() * (options.queue + 1);
    http = std::make_unique<http::Server>(limits);
    if (!options.cors.empty()) {
      // The one allowed origin on every answer, and the browser's preflight answered without a key.
      http->after = [this](const http::Request&, http::Response& res) {
        res.set_header("Access-Control-Allow-Origin", options.cors);
        res.set_header("Vary", "Origin");
      };
      http->route("OPTIONS", R"(/.*)", [](const http::Request&, http::Response& res) {
        res.status = 204;
        res.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
        res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type");
        res.set_header("Access-Control-Max-Age", "600");
      });
    }
    http->before = [this](const http::Request& req, http::Response& res) {
      // The health check and the page itself (static, it holds no data) need no key; the page
      // sends the key the user types with its API calls.
      if (options.api_key.empty() || req.path == "/health" || req.path == "/" || req.method == "OPTIONS") return false;
      if (req.header("Authorization") == "Bearer " + options.api_key) return false;
      send_error(res, 401, "missing or wrong API key (Authorization: Bearer KEY)", "");
      return true;
    };
    http->exception = [](http::Response& res, std::exception_ptr ep) {
      try {
        std::rethrow_exception(ep);
      } catch (const HttpError& e) {
        send_error(res, e.status, e.message, e.param);
        if (e.status == 429) res.set_header("Retry-After", "5");
      } catch (const std::bad_alloc&) {
        send_error(res, 503, "the server has not the memory to take this request now (an allocation failed)", "");
      } catch (const std::exception& e) {
        send_error(res, 500, e.what(), "");
      }
    };
    http->refusal = [](http::Response& res, int status, const std::string& message) { send_error(res, status, message, ""); };
    http->log = [this](const http::Request& req, const std::string& pattern, int status) {
      metrics.request(route_name(req, pattern), status);
    };
    http->route("GET", "/metrics", [this](const http::Request&, http::Response& res) {
      std::vector<std::tuple<std::string, size_t, bool>> queues;
      for (const Loaded& m : models) queues.emplace_back(m.id, m.worker->waiting(), m.worker->running());
      res.set_content(metrics.text(queues), "text/plain; version=0.0.4");
    });
    // Server-sent events: a "progress" event whenever the step or state changes, then "done"
    // with the job's final state (its files included) and the stream ends. A client that goes
    // away cancels the job.
    http->route("GET", R"(/v1/jobs/([A-Za-z0-9-]+)/events)", [this](const http::Request& req, http::Response& res) {
      const auto j = job(req.matches[1]);
      auto sent = std::make_shared<std::pair<int, int>>(-1, -1);  // the (state, step) last sent
      auto over = std::make_shared<bool>(false);
      res.set_header("Cache-Control", "no-cache");
      res.content_type = "text/event-stream";
      res.stream = http::Stream{[this, j, sent, over]() -> std::optional<std::string> {
                                  if (*over) return std::nullopt;
                                  JobState state;
                                  int step;
                                  {
                                    std::unique_lock<std::mutex> lock(j->mutex);
                                    j->changed.wait_for(lock, std::chrono::seconds(15), [&] {
                                      return int(j->state) != sent->first || j->step != sent->second;
                                    });
                                    state = j->state;
                                    step = j->step;
                                  }
                                  *over = state == JobState::done || state == JobState::failed ||
                                          state == JobState::cancelled;
                                  *sent = {int(state), step};
                                  return std::string("event: ") + (*over ? "done" : "progress") + "\ndata: " +
                                         dump(job_json(*j, *over)) + "\n\n";
                                },
                                [j] { j->cancel = true; }};
    });
    registerA1111();
    http->route("GET", "/", [](const http::Request&, http::Response& res) { res.set_content(web_page(), "text/html"); });
    http->route("GET", "/health", [](const http::Request&, http::Response& res) {
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    http->route("GET", "/v1/models", [this](const http::Request&, http::Response& res) {
      Json data = Json::array();
      for (const Loaded& m : models)
        data.push_back({{"id", m.id}, {"object", "model"}, {"owned_by", "apus"}, {"kind", kind_name(m.model.kind())},
                        {"queue", m.worker->waiting()}});
      res.set_content(dump(Json{{"object", "list"}, {"data", data}}), "application/json");
    });
    // OpenAI's edits take a multipart form: the fields as text, the images as files (image or
    // image[], repeatable) in the order sent, the mask a PNG whose transparent pixels repaint.
    http->route("POST", "/v1/images/edits", [this](const http::Request& req, http::Response& res) {
      if (!is_multipart(req.header("Content-Type")))
        refuse(400, "expected a multipart/form-data body (OpenAI's images/edits), not Content-Type '" +
                        req.header("Content-Type") + "'");
      std::vector<FormPart> parts;
      try {
        parts = parse_multipart(req.header("Content-Type"), req.body);
      } catch (const Error& e) {
        refuse(400, e.what());
      }
      Json body = Json::object();
      ImageFiles files;
      for (const FormPart& file : parts) {
        const std::string& name = file.name;
        if (name == "image" || name == "image[]") {
          files.images.push_back(file.content);
        } else if (name == "n" || name == "seed" || name == "steps") {
          int64_t v = 0;
          const auto [end, ec] = std::from_chars(file.content.data(), file.content.data() + file.content.size(), v);
          if (ec != std::errc() || end != file.content.data() + file.content.size())
            refuse(400, "'" + name + "' must be an integer", name);
          body[name] = v;
        } else if (name == "cfg" || name == "strength") {
          char* end = nullptr;
          const double v = std::strtod(file.content.c_str(), &end);
          if (file.content.empty() || end != file.content.c_str() + file.content.size())
            refuse(400, "'" + name + "' must be a number", name);
          body[name] = v;
        } else if (name == "mask") {
          files.mask = file.content;
          files.alpha_mask = true;
        } else if (name == "images") {
          refuse(400, "the edits form sends its images as 'image' files", "images");
        } else {
          body[name] = file.content;
        }
      }
      if (files.images.empty()) refuse(400, "'image' is required: the image(s) to edit", "image");
      respond_images(req, res, openai_image_job(body, std::move(files)));
    });
    http->route("POST", "/v1/images/generations", [this](const http::Request& req, http::Response& res) {
      respond_images(req, res, openai_image_job(parse_body(req), {}));
    });
    http->route("POST", "/v1/audio/generations", [this](const http::Request& req, http::Response& res) {
      std::string format;
      const auto j = audio_job(parse_body(req), format);
      submit(j);
      wait_for_client(req, *j);
      finish_sync(*j);
      const JobOutput& o = j->outputs.front();
      res.set_header("X-Seed", std::to_string(o.seed));
      res.set_content(std::string(o.bytes.begin(), o.bytes.end()), o.mime);
    });
    http->route("POST", "/v1/jobs", [this](const http::Request& req, http::Response& res) {
      Json body = parse_body(req);
      const Fields f{body};
      const std::string kind = f.string("kind", "");
      if (kind != "image" && kind != "audio") refuse(400, "'kind' must be \"image\" or \"audio\"", "kind");
      const bool trace = f.boolean("trace", false);
      body.erase("kind");
      body.erase("trace");
      std::string format;
      const auto j = kind == "image" ? openai_image_job(body, {}, trace) : audio_job(body, format, trace);
      submit(j);
      res.status = 202;
      res.set_content(dump(job_json(*j)), "application/json");
    });
    http->route("GET", R"(/v1/jobs/([A-Za-z0-9-]+))", [this](const http::Request& req, http::Response& res) {
      res.set_content(dump(job_json(*job(req.matches[1]))), "application/json");
    });
    // A traced job's timeline, for ui.perfetto.dev (docs/BENCH.md describes it).
    http->route("GET", R"(/v1/jobs/([A-Za-z0-9-]+)/trace)", [this](const http::Request& req, http::Response& res) {
      const auto j = job(req.matches[1]);
      if (!j->traced) refuse(404, "job " + j->id + " was not traced (submit it with \"trace\": true)", "trace");
      std::lock_guard<std::mutex> lock(j->mutex);
      if (j->state != JobState::done)
        refuse(409, "job " + j->id + " is " + state_name(j->state) + ": its trace comes when it is done", "trace");
      res.set_content(j->trace, "application/json");
    });
    http->route("DELETE", R"(/v1/jobs/([A-Za-z0-9-]+))", [this](const http::Request& req, http::Response& res) {
      const auto j = job(req.matches[1]);
      j->cancel = true;
      res.set_content(dump(job_json(*j)), "application/json");
    });
  }
};

Server::Server(ServeOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  APUS_CHECK(!impl_->options.models.empty(), "serve: no --model given");
  APUS_CHECK(impl_->options.queue >= 1 && impl_->options.queue <= 1024, "serve: --queue ", impl_->options.queue,
             " outside 1..1024");
  for (const std::string& dir : impl_->options.models) {
    Loaded m;
    m.dir = dir;
    m.model = AnyModel::open(dir, Weights::resident, impl_->options.device);
    m.id = model_label(dir);
    for (const Loaded& other : impl_->models)
      APUS_CHECK(other.id != m.id, dir, ": a second model named '", m.id, "'");
    Impl* impl = impl_.get();
    m.worker = std::make_unique<ModelWorker>(impl_->options.queue, [impl](const Job& j, JobState s) {
      impl->metrics.job(j, s);
      impl->job_finished(j);
    });
    impl_->models.push_back(std::move(m));
  }
  impl_->routes();
}

Server::~Server() {
  stop();
  // The workers first: a job still finishing (one cancelled as the server stops) reports to the
  // metrics and the kept jobs, which must outlive it.
  for (Loaded& m : impl_->models) m.worker.reset();
}

int Server::start() {
  Impl& s = *impl_;
  const int port = s.http->listen(s.options.host, s.options.port);
  APUS_CHECK(port > 0, "serve: cannot listen on ", s.options.host, ":", s.options.port);
  return port;
}

void Server::stop() {
  if (impl_) impl_->http->stop();
}

void Server::shutdown(double drain_seconds) {
  Impl& s = *impl_;
  s.draining = true;
  auto busy = [&] {
    for (const Loaded& m : s.models)
      if (m.worker->busy()) return true;
    return false;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(drain_seconds);
  while (busy() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (const Loaded& m : s.models) m.worker->cancel_all();
  // A cancelled run stops at its next sampler step (or after its decoder).
  while (busy()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop();
}

}  // namespace apus::server
