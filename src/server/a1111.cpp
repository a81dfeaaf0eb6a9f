// AUTOMATIC1111's web UI API (modules/api/api.py), the routes its clients call: txt2img and
// img2img, progress and interrupt, the model list and options that pick the checkpoint, and the
// lists and tools clients read at start (samplers, schedulers, upscalers, LoRAs, memory, png-info);
// its extras routes are in a1111_extras.cpp.
#include <unistd.h>

#include <regex>

#include "io/media/png.h"
#include "io/media/resize.h"
#include "server/server_impl.h"

namespace apus::server {

// The fields txt2img and img2img share, as A1111 reads them.
struct A1111Request {
  ImageRequest r;
  std::string negative;
  int n = 1, batch_size = 1, iterations = 1;
  std::string checkpoint;  // override_settings.sd_model_checkpoint, else empty: the options' one
};

namespace {

// The sampler and scheduler apus runs: the model's own (klein's official FlowMatchEulerDiscreteScheduler
// on its shifted schedule), under the names A1111's lists give them.
constexpr const char* kSampler = "Euler";
constexpr const char* kScheduler = "Automatic";

// A1111's fields that ask for what apus does not do, refused naming the field when set to anything
// but the value that changes nothing (the values clients send by default pass): never ignored.
void refuse_what_apus_does_not_do(const Fields& f) {
  auto off = [&](const char* k, const std::string& why) {
    if (f.boolean(k, false)) refuse(400, "'" + std::string(k) + "' is true: " + why, k);
  };
  off("enable_hr", "apus has no hires fix (a second pass at a larger size); ask for the size you want");
  off("restore_faces", "apus has no face restoration");
  off("tiling", "apus does not render tileable images");
  for (const char* k : {"sampler_name", "sampler_index"}) {
    const std::string name = f.string(k, "");
    if (!name.empty() && name != kSampler)
      refuse(400,
             "'" + std::string(k) + "' is '" + name + "': apus runs the model's own sampler, '" + kSampler +
                 "' (the official flow-matching Euler; GET /sdapi/v1/samplers). webuiapi: WebUIApi(sampler='Euler')",
             k);
  }
  const std::string scheduler = f.string("scheduler", "");
  if (!scheduler.empty() && scheduler != kScheduler && scheduler != "automatic")
    refuse(400,
           "'scheduler' is '" + scheduler + "': apus runs the model's own schedule, '" + kScheduler +
               "' (GET /sdapi/v1/schedulers)",
           "scheduler");
  if (f.number("subseed_strength", 0.0) != 0.0)
    refuse(400, "'subseed_strength' is not 0: apus has no variation seeds", "subseed_strength");
  for (const char* k : {"seed_resize_from_w", "seed_resize_from_h"})
    if (const int64_t v = f.integer(k, -1, std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
        v > 0)
      refuse(400, "'" + std::string(k) + "' is " + std::to_string(v) + ": apus draws each size's own noise", k);
  if (f.number("s_churn", 0.0) != 0.0) refuse(400, "'s_churn' is not 0: apus's sampler adds no noise", "s_churn");
  if (f.number("initial_noise_multiplier", 1.0) != 1.0)
    refuse(400, "'initial_noise_multiplier' is not 1: apus starts from the official noise", "initial_noise_multiplier");
  if (f.has("styles") && !(f.j["styles"].is_array() && f.j["styles"].empty()))
    refuse(400, "'styles': apus has no saved styles; put them in the prompt", "styles");
  if (!f.string("script_name", "").empty()) refuse(400, "'script_name': apus runs no scripts", "script_name");
  if (f.has("alwayson_scripts") && !(f.j["alwayson_scripts"].is_object() && f.j["alwayson_scripts"].empty()))
    refuse(400, "'alwayson_scripts': apus runs no scripts (ControlNet, ADetailer, ...)", "alwayson_scripts");
}

A1111Request a1111_request(const Fields& f, const ImageModel& model, std::optional<int> default_side) {
  A1111Request a;
  a.r.prompt = f.prompt();
  a.r.width = f.setting("width");
  a.r.height = f.setting("height");
  if (!a.r.width) a.r.width = default_side;
  if (!a.r.height) a.r.height = default_side;
  a.r.steps = f.setting("steps");
  const int64_t seed = f.integer("seed", -1, -1, int64_t(1) << 53);
  if (seed >= 0) a.r.seed = uint64_t(seed);
  // A1111 clients always send a guidance scale (7 by default): the -base models take it, the
  // distilled ones have none to take; a negative prompt the engine refuses for them.
  if (model.takes_guidance() && f.has("cfg_scale")) a.r.cfg = float(f.number("cfg_scale", 0.0));
  // The negative prompt likewise: guidance's unconditional branch, which only the -base models run
  // (A1111 and Forge run none for a distilled model either); the info echoes it as given.
  a.negative = f.string("negative_prompt", "");
  if (!a.negative.empty() && model.takes_guidance()) a.r.negative_prompt = a.negative;
  refuse_what_apus_does_not_do(f);
  // n_iter batches of batch_size, seeds seed, seed + 1, ... as A1111 numbers them: one batch here,
  // each image the bits it would have alone.
  a.batch_size = f.setting("batch_size").value_or(1);
  a.iterations = int(f.integer("n_iter", 1, 1, ImageLimits::max_batch));
  a.n = a.batch_size * a.iterations;
  if (a.iterations > 1 && a.n > ImageLimits::max_batch)
    refuse(400,
           "'batch_size' x 'n_iter' is " + std::to_string(a.n) + ", over the " +
               std::to_string(ImageLimits::max_batch) + " images apus renders a request",
           "n_iter");
  if (f.has("override_settings")) {
    const Json& o = f.j["override_settings"];
    if (!o.is_object()) refuse(400, "'override_settings' must be an object", "override_settings");
    // The checkpoint is apus's to honour per request; other keys are A1111's options, which the
    // options route ignores too.
    a.checkpoint = Fields{o}.string("sd_model_checkpoint", "");
  }
  return a;
}

// A1111's LoRA syntax, <lora:NAME:WEIGHT> in the prompt (WEIGHT 1 when absent): taken out of the
// prompt and applied as the file NAME.safetensors of --lora-dir, before any "loras" of apus's own.
std::vector<Json> prompt_loras(std::string& prompt) {
  static const std::regex tag(R"(<lora:([^:>]+)(?::([^>]*))?>)");
  std::vector<Json> loras;
  std::smatch m;
  std::string rest = prompt, kept;
  while (std::regex_search(rest, m, tag)) {
    kept += m.prefix().str();
    const std::string weight = m[2].matched ? m[2].str() : "1";
    char* end = nullptr;
    const double scale = std::strtod(weight.c_str(), &end);
    if (weight.empty() || end != weight.c_str() + weight.size())
      refuse(400, "'prompt': " + m.str() + " has the weight '" + weight + "', expected a number", "prompt");
    std::string name = m[1].str();
    if (!name.ends_with(".safetensors")) name += ".safetensors";
    loras.push_back({{"name", name}, {"scale", scale}});
    rest = m.suffix().str();
  }
  prompt = kept + rest;
  return loras;
}

// A1111's answer: the images as base64 PNGs, the request echoed, and `info` as a JSON string.
std::string a1111_answer(const Job& j, const A1111Request& a, const ImageModel& model, const Json& in,
                         Json extra_info) {
  Json images = Json::array(), seeds = Json::array();
  for (const JobOutput& o : j.outputs) {
    images.push_back(base64(o.bytes));
    seeds.push_back(o.seed);
  }
  Json info = {{"prompt", a.r.prompt},
               {"all_prompts", Json::array({a.r.prompt})},
               {"negative_prompt", a.negative},
               {"cfg_scale", a.r.cfg.value_or(model.default_cfg())},
               {"seed", seeds[0]},
               {"all_seeds", seeds},
               {"steps", a.r.steps.value_or(model.default_steps())},
               {"sampler_name", kSampler},
               {"scheduler", kScheduler},
               {"batch_size", a.batch_size},
               {"n_iter", a.iterations},
               {"sd_model_name", j.model}};
  if (a.r.width) info["width"] = *a.r.width;
  if (a.r.height) info["height"] = *a.r.height;
  info.update(extra_info);
  return dump(Json{{"images", images}, {"parameters", in}, {"info", dump(info)}});
}

// A1111 sends an image as base64, bare or as a data URL.
Json bare_base64(const Json& value) {
  if (!value.is_string()) return value;
  const std::string text = value.get<std::string>();
  const size_t comma = text.find(',');
  return text.starts_with("data:") && comma != std::string::npos ? Json(text.substr(comma + 1)) : value;
}

// A1111's infotext ("parameters") as its parse_generation_parameters gives it: the prompt, the
// negative prompt, then "Key: value" pairs from the last line.
Json parse_infotext(const std::string& text) {
  Json out = Json::object();
  std::vector<std::string> lines;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = text.find('\n', at);
    lines.push_back(text.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  std::string settings;
  if (!lines.empty() && lines.back().find("Steps: ") != std::string::npos) {
    settings = lines.back();
    lines.pop_back();
  }
  std::string prompt, negative;
  bool in_negative = false;
  for (const std::string& l : lines) {
    if (l.rfind("Negative prompt: ", 0) == 0) {
      in_negative = true;
      negative = l.substr(17);
    } else {
      std::string& into = in_negative ? negative : prompt;
      into += (into.empty() ? "" : "\n") + l;
    }
  }
  out["Prompt"] = prompt;
  out["Negative prompt"] = negative;
  // A "Key: value" pair of the settings line, the value quoted (with escapes) or up to a comma.
  static const std::regex pair("\\s*([\\w ]+):\\s*(\"(?:\\\\.|[^\\\\\"])+\"|[^,]*)(?:,|$)");
  for (std::sregex_iterator it(settings.begin(), settings.end(), pair), end; it != end; ++it)
    out[(*it)[1].str()] = (*it)[2].str();
  return out;
}

}  // namespace

std::string a1111_image(const Json& value, const std::string& what, const char* param) {
  const std::optional<std::string> bytes =
      bare_base64(value).is_string() ? unbase64(bare_base64(value).get<std::string>()) : std::nullopt;
  if (!bytes || bytes->empty()) refuse(400, "'" + what + "' must be an image file as base64", param);
  return *bytes;
}

// Runs an A1111 request on the checkpoint options chose, waits for it and answers.
void Server::Impl::a1111_run(const http::Request& req, http::Response& res, const Json& in, A1111Request& a,
                             ImageFiles files, Json extra_info) {
  std::string checkpoint = a.checkpoint;
  if (checkpoint.empty()) {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    checkpoint = a1111_checkpoint;
  }
  const Loaded& m = [&]() -> const Loaded& {
    try {
      return find(Fields{Json{{"model", checkpoint}}}, ModelKind::image);
    } catch (const HttpError& e) {
      refuse(400, e.message + " (GET /sdapi/v1/sd-models lists them)", "override_settings");
    }
  }();
  // LoRAs from the prompt's <lora:NAME:WEIGHT> tags, then apus's "loras" field.
  Json loras = Json::array();
  for (Json& l : prompt_loras(a.r.prompt)) loras.push_back(std::move(l));
  if (in.contains("loras") && in["loras"].is_array())
    for (const Json& l : in["loras"]) loras.push_back(l);
  else if (in.contains("loras") && !in["loras"].is_null())
    refuse(400, "'loras' must be a list of {\"name\", \"scale\"}", "loras");
  try {
    a.r.loras = requested_loras(loras);
  } catch (const HttpError& e) {
    refuse(400, e.message + " (GET /sdapi/v1/loras lists them; in the prompt as <lora:NAME:WEIGHT>)", "loras");
  }
  const auto j = image_job(m, a.r, a.n, std::move(files), kA1111Fields);
  j->previews = true;  // progress's current_image
  submit(j);
  {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    a1111_current = j;
  }
  wait_for_client(req, *j);
  finish_sync(*j);
  res.set_content(a1111_answer(*j, a, *m.model.image(), in, std::move(extra_info)), "application/json");
}

const ImageModel& Server::Impl::a1111_model() {
  std::lock_guard<std::mutex> lock(jobs_mutex);
  return *find(Fields{Json{{"model", a1111_checkpoint}}}, ModelKind::image).model.image();
}

void Server::Impl::a1111_txt2img(const http::Request& req, http::Response& res) {
  const Json in = parse_body(req);
  // A1111's own defaults, for the sides its clients always send.
  A1111Request a = a1111_request(Fields{in}, a1111_model(), 512);
  a1111_run(req, res, in, a, {}, Json::object());
}

// img2img on klein is its inpainting (which the official pipeline runs with a strength): the
// mask's white repainted (its black with inpainting_mask_invert), or without a mask the whole
// image, from denoising_strength of the way.
void Server::Impl::a1111_img2img(const http::Request& req, http::Response& res) {
  const Json in = parse_body(req);
  const Fields f{in};
  // Sides absent: the image's, at which the engine renders it.
  A1111Request a = a1111_request(f, a1111_model(), std::nullopt);
  // A1111 renders img2img at the size asked, the image resized to it first: resize_mode 0, "just
  // resize" (what its clients send; webuiapi always asks 512x512), or 1, "crop and resize". 2
  // (resize and fill: the borders stretched from the image's edges) and 3 (a latent upscale) are
  // refused.
  const int64_t resize_mode = f.integer("resize_mode", 0, 0, 3);
  if (resize_mode > 1)
    refuse(400,
           "'resize_mode' is " + std::to_string(resize_mode) +
               ": apus resizes the image to the size asked (0, just resize) or crops it to it (1, crop and resize)",
           "resize_mode");
  if (!f.has("init_images") || !in["init_images"].is_array() || in["init_images"].empty())
    refuse(400, "'init_images' must hold the image to repaint, as base64", "init_images");
  if (in["init_images"].size() > 1)
    refuse(400, "'init_images' holds " + std::to_string(in["init_images"].size()) + " images; apus repaints one",
           "init_images");
  ImageFiles files;
  files.images.push_back(a1111_image(in["init_images"][0], "init_images[0]", "init_images"));
  if (f.has("mask")) files.mask = a1111_image(in["mask"], "mask", "mask");
  else files.repaint_whole = true;
  // "Only masked" (a crop around the mask, repainted at the size asked and pasted back); A1111
  // reads it only with a mask, as here.
  if (files.mask && f.boolean("inpaint_full_res", false))
    refuse(400, "'inpaint_full_res' is true: apus repaints the whole image at its size (send false)",
           "inpaint_full_res");
  files.marks = f.integer("inpainting_mask_invert", 0, 0, 1) ? MaskMarks::black : MaskMarks::white;
  if (a.r.width && a.r.height) files.resize_to = std::pair{*a.r.width, *a.r.height};
  files.crop = resize_mode == 1;
  // A1111's default strength.
  const double strength = f.number("denoising_strength", 0.75);
  files.strength = strength;
  a1111_run(req, res, in, a, std::move(files), Json{{"denoising_strength", strength}});
}

// A1111's progress: its own route's current job, or else any image job running on the server
// (the page's, the jobs API's, OpenAI's), with the time left at the rate of the steps so far and
// the latest live preview as current_image.
void Server::Impl::a1111_progress(const http::Request&, http::Response& res) {
  std::shared_ptr<Job> j;
  int active_jobs = 0;
  {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    j = a1111_current;
    for (const auto& [id, job] : jobs) {
      std::lock_guard<std::mutex> job_lock(job->mutex);
      if (job->kind != "image" || (job->state != JobState::queued && job->state != JobState::running)) continue;
      ++active_jobs;
      if (job->state == JobState::running && (!j || j->state != JobState::running)) j = job;
    }
  }
  Json state = {{"skipped", false},     {"interrupted", false}, {"job", ""},          {"job_count", active_jobs},
                {"job_timestamp", "0"}, {"job_no", 0},          {"sampling_step", 0}, {"sampling_steps", 0}};
  double progress = 0, eta = 0;
  Json current_image = nullptr;
  if (j) {
    std::lock_guard<std::mutex> lock(j->mutex);
    const bool active = j->state == JobState::queued || j->state == JobState::running;
    state["interrupted"] = j->state == JobState::cancelled || j->finish;
    state["job"] = active ? j->id : "";
    state["sampling_step"] = j->step;
    state["sampling_steps"] = j->steps;
    progress = active && j->steps ? double(j->step) / j->steps : 0.0;
    if (j->state == JobState::running && progress > 0) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - j->started).count();
      eta = elapsed / progress - elapsed;
    }
    if (active && !j->preview.empty()) {
      const Json p = Json::parse(j->preview, nullptr, false);
      if (p.is_object() && p.contains("image")) current_image = p["image"];
    }
  }
  res.set_content(dump(Json{{"progress", progress},
                            {"eta_relative", eta},
                            {"state", state},
                            {"current_image", current_image},
                            {"textinfo", nullptr}}),
                  "application/json");
}

// As A1111's interrupt: the sampling ends after its current step and the call answers with the
// image decoded from where it got.
void Server::Impl::a1111_interrupt(const http::Request&, http::Response& res) {
  std::lock_guard<std::mutex> lock(jobs_mutex);
  if (a1111_current) a1111_current->finish = true;
  res.set_content("{}", "application/json");
}

void Server::Impl::a1111_sd_models(const http::Request&, http::Response& res) {
  Json list = Json::array();
  for (const Loaded& m : models)
    if (m.model.kind() == ModelKind::image)
      list.push_back({{"title", m.id},
                      {"model_name", m.id},
                      {"hash", nullptr},
                      {"sha256", nullptr},
                      {"filename", m.id},
                      {"config", nullptr}});
  res.set_content(dump(list), "application/json");
}

void Server::Impl::a1111_options(const http::Request&, http::Response& res) {
  std::lock_guard<std::mutex> lock(jobs_mutex);
  res.set_content(dump(Json{{"sd_model_checkpoint", a1111_checkpoint}}), "application/json");
}

// Only the checkpoint is apus's to set; A1111 ignores option keys it does not know, and so do
// these routes.
void Server::Impl::a1111_set_options(const http::Request& req, http::Response& res) {
  const Json in = parse_body(req);
  const Fields f{in};
  if (f.has("sd_model_checkpoint")) {
    const std::string name = f.string("sd_model_checkpoint", "");
    const Loaded& m = [&]() -> const Loaded& {
      try {
        return find(Fields{Json{{"model", name}}}, ModelKind::image);
      } catch (const HttpError& e) {
        refuse(400, e.message + " (GET /sdapi/v1/sd-models lists them)", "sd_model_checkpoint");
      }
    }();
    std::lock_guard<std::mutex> lock(jobs_mutex);
    a1111_checkpoint = m.id;
  }
  res.set_content("null", "application/json");
}

// What A1111 clients list at start. The one sampler and schedule are the model's own.
void Server::Impl::a1111_samplers(const http::Request&, http::Response& res) {
  res.set_content(
      dump(Json::array({{{"name", kSampler}, {"aliases", Json::array({"k_euler"})}, {"options", Json::object()}}})),
      "application/json");
}

void Server::Impl::a1111_schedulers(const http::Request&, http::Response& res) {
  res.set_content(dump(Json::array({{{"name", "automatic"},
                                     {"label", kScheduler},
                                     {"aliases", nullptr},
                                     {"default_rho", -1},
                                     {"need_inner_model", false}}})),
                  "application/json");
}

void Server::Impl::a1111_upscalers(const http::Request&, http::Response& res) {
  // A1111's own three that need no model file (a1111_extras.cpp runs them), as it lists them.
  Json list = Json::array();
  for (const char* name : {"None", "Lanczos", "Nearest"})
    list.push_back(
        {{"name", name}, {"model_name", nullptr}, {"model_path", nullptr}, {"model_url", nullptr}, {"scale", 4}});
  res.set_content(dump(list), "application/json");
}

// --lora-dir's files, named as <lora:NAME:WEIGHT> names them (the path: the file's name only).
void Server::Impl::a1111_loras(const http::Request&, http::Response& res) {
  Json list = Json::array();
  for (const std::string& file : lora_names()) {
    const std::string name = file.substr(0, file.size() - std::string(".safetensors").size());
    list.push_back({{"name", name}, {"alias", name}, {"path", file}, {"metadata", Json::object()}});
  }
  res.set_content(dump(list), "application/json");
}

void Server::Impl::a1111_refresh_loras(const http::Request&, http::Response& res) {
  res.set_content("null", "application/json");  // listed from the folder at every call
}

// The models are the ones `apus serve` opened: nothing to rescan.
void Server::Impl::a1111_refresh_checkpoints(const http::Request&, http::Response& res) {
  res.set_content("null", "application/json");
}

// A1111's scripts, textual-inversion embeddings, VAE files, hypernetworks, face restorers,
// Real-ESRGAN models, prompt styles and hires-fix latent upscalers: apus has none (its models
// carry their own VAE; face restoration, model upscalers and hires fix are refused where a request
// asks for them), and answers as A1111 does when it has none.
void Server::Impl::a1111_scripts(const http::Request&, http::Response& res) {
  res.set_content(dump(Json{{"txt2img", Json::array()}, {"img2img", Json::array()}}), "application/json");
}

void Server::Impl::a1111_embeddings(const http::Request&, http::Response& res) {
  res.set_content(dump(Json{{"loaded", Json::object()}, {"skipped", Json::object()}}), "application/json");
}

void Server::Impl::a1111_none(const http::Request&, http::Response& res) { res.set_content("[]", "application/json"); }

void Server::Impl::a1111_cmd_flags(const http::Request&, http::Response& res) {
  res.set_content(dump(Json{{"api", true},
                            {"nowebui", false},
                            {"device", options.device},
                            {"lora_dir", options.lora_dir.empty() ? Json(nullptr) : Json("(set)")},
                            {"server_name", "apus"}}),
                  "application/json");
}

void Server::Impl::a1111_memory(const http::Request&, http::Response& res) {
  const double page = double(sysconf(_SC_PAGESIZE)), total = double(sysconf(_SC_PHYS_PAGES)) * page,
               free = double(sysconf(_SC_AVPHYS_PAGES)) * page;
  res.set_content(dump(Json{{"ram", {{"free", free}, {"used", total - free}, {"total", total}}},
                            {"cuda", {{"error", "apus serve reports device memory at GET /metrics"}}}}),
                  "application/json");
}

// The parameters an image carries (A1111's, or apus's, which writes them the same way).
void Server::Impl::a1111_png_info(const http::Request& req, http::Response& res) {
  const Json in = parse_body(req);
  const Fields f{in};
  if (!f.has("image")) refuse(400, "'image' must hold a PNG as base64", "image");
  const std::string bytes = a1111_image(in["image"], "image", "image");
  const PngImage png = [&] {
    try {
      return decode_png(bytes, "image");
    } catch (const Error& e) {
      refuse(400, e.what(), "image");
    }
  }();
  std::string info;
  Json items = Json::object();
  for (const auto& [key, value] : png.text) {
    if (key == "parameters") info = value;
    else items[key] = value;
  }
  res.set_content(dump(Json{{"info", info}, {"items", items}, {"parameters", parse_infotext(info)}}),
                  "application/json");
}

}  // namespace apus::server
