#include "server/server.h"
#include "io/files.h"
#include "io/hf_cache.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "core/error.h"
#include "cost/ceiling.h"
#include "cost/roofline.h"
#include "ops/backend.h"
#include "server/server_impl.h"
#include "server/web_page.h"

namespace apus::server {

void Server::Impl::admit(const FieldNames& names, const std::function<void()>& check) {
  try {
    as_route(names, check);
  } catch (const FieldError& e) {
    refuse(400, e.what(), e.field);
  } catch (const Error& e) {
    refuse(400, e.what());
  }
}

void Server::Impl::check_time(const PipelineCost& cost) {
  const double bound = options.max_request_seconds;
  if (bound <= 0) return;
  auto floor_at = [&](const Chip& chip) {
    return roofline_json(cost, Roofline{chip, 1})["total"]["floor_s"].get<double>();
  };
  if (floor_at(Chip{"slow", 1e9, 0, 0, 1e9, 1e9, ""}) <= bound) return;
  std::call_once(calibrated, [&] {
    Backend* backend = backend_for(options.device);
    Arena arena(size_t(64) << 20, false, backend ? static_cast<Allocator&>(*backend) : host_allocator());
    Context ctx{&arena};
    ctx.backend = backend;
    ceiling = calibrated_ceiling(ctx);
  });
  const double floor = floor_at(ceiling);
  if (floor > bound) {
    char text[256];
    std::snprintf(text, sizeof text,
                  "this request would take at least %.0f s here (its floor at this machine's calibrated %.0f GFLOP/s "
                  "and %.1f GB/s), beyond the server's --max-request-seconds %.0f",
                  floor, ceiling.bf16_flops / 1e9, ceiling.memory_bps / 1e9, bound);
    refuse(413, text);
  }
}

const Loaded& Server::Impl::find(const Fields& f, ModelKind kind) {
  std::string name = f.string("model", "");
  // A name no loaded model has: an alias, or one of OpenAI's (the server's model of that kind).
  static const std::set<std::string> kOpenAiImageModels = {"gpt-image-1", "gpt-image-1-mini", "gpt-image-1.5",
                                                           "dall-e-2", "dall-e-3"};
  static const std::set<std::string> kOpenAiAudioModels = {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"};
  if (std::none_of(models.begin(), models.end(), [&](const Loaded& m) { return m.id == name; })) {
    if (const auto alias = options.aliases.find(name); alias != options.aliases.end()) name = alias->second;
    else if ((kind == ModelKind::image ? kOpenAiImageModels : kOpenAiAudioModels).count(name)) name.clear();
  }
  for (const Loaded& m : models)
    if ((name.empty() && m.model.kind() == kind) || (!name.empty() && m.id == name)) {
      if (m.model.kind() != kind)
        refuse(400, "model '" + name + "' makes " + kind_name(m.model.kind()) + ", not " + kind_name(kind), "model");
      return m;
    }
  if (name.empty()) refuse(404, std::string("no ") + kind_name(kind) + " model is loaded", "model");
  refuse(404, "model '" + name + "' is not loaded (GET /v1/models lists them)", "model");
}

void Server::Impl::metrics_text(const http::Request&, http::Response& res) {
  std::vector<std::tuple<std::string, size_t, bool>> queues;
  for (const Loaded& m : models) queues.emplace_back(m.id, m.worker->waiting(), m.worker->running());
  res.set_content(metrics.text(queues), "text/plain; version=0.0.4");
}

void Server::Impl::page(const http::Request&, http::Response& res) { res.set_content(web_page(), "text/html"); }

void Server::Impl::health(const http::Request&, http::Response& res) {
  res.set_content(dump(Json{{"status", "ok"}, {"version", version()}}), "application/json");
}

void Server::Impl::list_models(const http::Request&, http::Response& res) {
  Json data = Json::array();
  for (const Loaded& m : models)
    data.push_back({{"id", m.id},
                    {"object", "model"},
                    {"owned_by", "apus"},
                    {"kind", kind_name(m.model.kind())},
                    {"queue", m.worker->waiting()}});
  res.set_content(dump(Json{{"object", "list"}, {"data", data}}), "application/json");
}

void Server::Impl::list_loras(const http::Request&, http::Response& res) {
  Json data = Json::array();
  for (const std::string& name : lora_names())
    data.push_back({{"id", name}, {"object", "lora"}, {"models", lora_models(name)}});
  res.set_content(dump(Json{{"object", "list"}, {"data", data}}), "application/json");
}

std::vector<std::string> Server::Impl::lora_models(const std::string& name) {
  const std::string path = options.lora_dir + "/" + name;
  std::error_code ec;
  const std::string key = std::to_string(std::filesystem::file_size(path, ec)) + "/" +
                          std::to_string(std::filesystem::last_write_time(path, ec).time_since_epoch().count());
  {
    std::lock_guard<std::mutex> lock(lora_fits_mutex);
    const auto it = lora_fits.find(name);
    if (it != lora_fits.end() && it->second.first == key) return it->second.second;
  }
  std::vector<std::string> fits;
  for (const Loaded& m : models) {
    try {
      if (m.model.kind() == ModelKind::image)
        m.model.image()->count({.prompt = "x", .width = 64, .height = 64, .steps = 1, .loras = {{path, 1}}});
      else m.model.audio()->count({.prompt = "x", .seconds = 1, .steps = 1, .loras = {{path, 1}}});
      fits.push_back(m.id);
    } catch (const std::exception&) {
      // Not this model's: its family refuses the file, or a factor fits none of its weights.
    }
  }
  std::lock_guard<std::mutex> lock(lora_fits_mutex);
  lora_fits[name] = {key, fits};
  return fits;
}

Server::Server(ServeOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  APUS_CHECK(!impl_->options.models.empty(), "serve: no --model given");
  APUS_CHECK(impl_->options.lora_dir.empty() || std::filesystem::is_directory(impl_->options.lora_dir),
             "serve: --lora-dir ", impl_->options.lora_dir, ": not a folder");
  if (!impl_->options.output_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(impl_->options.output_dir, ec);
    APUS_CHECK(std::filesystem::is_directory(impl_->options.output_dir), "serve: --output-dir ",
               impl_->options.output_dir, ": not a folder and cannot be made one");
    check_writable(impl_->options.output_dir + "/.apus-write-test");
  }
  impl_->history = std::make_unique<History>(impl_->options.output_dir);
  APUS_CHECK(impl_->options.queue >= 1 && impl_->options.queue <= 1024, "serve: --queue ", impl_->options.queue,
             " outside 1..1024");
  for (const ModelParts& parts : impl_->options.models) {
    Loaded m;
    m.model = AnyModel::open(parts, Weights::resident, impl_->options.device);
    m.id = model_label(parts.model);
    for (const Loaded& other : impl_->models)
      APUS_CHECK(other.id != m.id, parts.model, ": a second model named '", m.id, "'");
    Impl* impl = impl_.get();
    m.worker = std::make_unique<ModelWorker>(impl_->options.queue, [impl](const Job& j, JobState s) {
      impl->metrics.job(j, s);
      if (s == JobState::done) impl->history->keep(impl->job_json(j, false), j.outputs);
      impl->job_finished(j);
    });
    impl_->models.push_back(std::move(m));
  }
  for (const auto& alias : impl_->options.aliases)  // not a structured binding: clang 14 cannot capture one
    APUS_CHECK(
        std::any_of(impl_->models.begin(), impl_->models.end(), [&](const Loaded& m) { return m.id == alias.second; }),
        "serve: --alias ", alias.first, "=", alias.second, ": no model '", alias.second, "' is loaded");
  // The image model the AUTOMATIC1111 routes render with until options name another.
  for (const Loaded& m : impl_->models)
    if (m.model.kind() == ModelKind::image && impl_->a1111_checkpoint.empty()) impl_->a1111_checkpoint = m.id;
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
  while (busy() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  for (const Loaded& m : s.models) m.worker->cancel_all();
  // A cancelled run stops at its next sampler step (or after its decoder).
  while (busy()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop();
}

}  // namespace apus::server
