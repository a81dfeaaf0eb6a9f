// AUTOMATIC1111's web UI API (modules/api/api.py), the routes its clients call: txt2img and
// img2img, progress and interrupt, and the model list and options that pick the checkpoint.
#include "server/server_impl.h"

namespace apus::server {

namespace {

// The fields txt2img and img2img share, as A1111 reads them.
struct A1111Request {
  ImageRequest r;
  std::string negative;
  int n = 1;
};

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
  a.negative = f.string("negative_prompt", "");
  if (!a.negative.empty()) a.r.negative_prompt = a.negative;
  if (f.integer("n_iter", 1, 1, 1) != 1) refuse(400, "'n_iter' must be 1", "n_iter");
  a.n = f.setting("batch_size").value_or(1);
  return a;
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
               {"batch_size", a.n},
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

std::string a1111_image(const Json& value, const std::string& what, const char* param) {
  const std::optional<std::string> bytes =
      bare_base64(value).is_string() ? unbase64(bare_base64(value).get<std::string>()) : std::nullopt;
  if (!bytes || bytes->empty()) refuse(400, "'" + what + "' must be an image file as base64", param);
  return *bytes;
}

}  // namespace

void Server::Impl::register_a1111() {
  for (const Loaded& m : models)
    if (m.model.kind() == ModelKind::image && a1111_checkpoint.empty()) a1111_checkpoint = m.id;
  // Runs an A1111 request on the checkpoint options chose, waits for it and answers.
  auto run = [this](const http::Request& req, http::Response& res, const Json& in, A1111Request& a, ImageFiles files,
                    Json extra_info) {
    std::string checkpoint;
    {
      std::lock_guard<std::mutex> lock(jobs_mutex);
      checkpoint = a1111_checkpoint;
    }
    const Loaded& m = find(Fields{Json{{"model", checkpoint}}}, ModelKind::image);
    const auto j = image_job(m, a.r, a.n, std::move(files), kA1111Fields);
    submit(j);
    {
      std::lock_guard<std::mutex> lock(jobs_mutex);
      a1111_current = j;
    }
    wait_for_client(req, *j);
    finish_sync(*j);
    res.set_content(a1111_answer(*j, a, *m.model.image(), in, std::move(extra_info)), "application/json");
  };
  auto model_of = [this]() -> const ImageModel& {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    return *find(Fields{Json{{"model", a1111_checkpoint}}}, ModelKind::image).model.image();
  };
  http->route("POST", "/sdapi/v1/txt2img", [this, run, model_of](const http::Request& req, http::Response& res) {
    const Json in = parse_body(req);
    // A1111's own defaults, for the sides its clients always send.
    A1111Request a = a1111_request(Fields{in}, model_of(), 512);
    run(req, res, in, a, {}, Json::object());
  });
  // img2img on klein is its inpainting (which the official pipeline runs with a strength): the
  // mask's white repainted (its black with inpainting_mask_invert), or without a mask the whole
  // image, from denoising_strength of the way.
  http->route("POST", "/sdapi/v1/img2img", [this, run, model_of](const http::Request& req, http::Response& res) {
    const Json in = parse_body(req);
    const Fields f{in};
    // Sides absent: the image's, at which the engine renders it.
    A1111Request a = a1111_request(f, model_of(), std::nullopt);
    if (!f.has("init_images") || !in["init_images"].is_array() || in["init_images"].empty())
      refuse(400, "'init_images' must hold the image to repaint, as base64", "init_images");
    if (in["init_images"].size() > 1)
      refuse(400, "'init_images' holds " + std::to_string(in["init_images"].size()) + " images; apus repaints one",
             "init_images");
    ImageFiles files;
    files.images.push_back(a1111_image(in["init_images"][0], "init_images[0]", "init_images"));
    if (f.has("mask")) files.mask = a1111_image(in["mask"], "mask", "mask");
    else files.repaint_whole = true;
    files.marks = f.integer("inpainting_mask_invert", 0, 0, 1) ? MaskMarks::black : MaskMarks::white;
    // A1111's default strength.
    const double strength = f.number("denoising_strength", 0.75);
    files.strength = strength;
    run(req, res, in, a, std::move(files), Json{{"denoising_strength", strength}});
  });
  http->route("GET", "/sdapi/v1/progress", [this](const http::Request&, http::Response& res) {
    std::shared_ptr<Job> j;
    {
      std::lock_guard<std::mutex> lock(jobs_mutex);
      j = a1111_current;
    }
    Json state = {{"skipped", false},     {"interrupted", false}, {"job", ""},          {"job_count", 0},
                  {"job_timestamp", "0"}, {"job_no", 0},          {"sampling_step", 0}, {"sampling_steps", 0}};
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
    res.set_content(dump(Json{{"progress", progress},
                              {"eta_relative", 0.0},
                              {"state", state},
                              {"current_image", nullptr},
                              {"textinfo", nullptr}}),
                    "application/json");
  });
  http->route("POST", "/sdapi/v1/interrupt", [this](const http::Request&, http::Response& res) {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    if (a1111_current) a1111_current->cancel = true;
    res.set_content("{}", "application/json");
  });
  http->route("GET", "/sdapi/v1/sd-models", [this](const http::Request&, http::Response& res) {
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
  });
  http->route("GET", "/sdapi/v1/options", [this](const http::Request&, http::Response& res) {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    res.set_content(dump(Json{{"sd_model_checkpoint", a1111_checkpoint}}), "application/json");
  });
  // Only the checkpoint is apus's to set; A1111 ignores option keys it does not know, and so do
  // these routes.
  http->route("POST", "/sdapi/v1/options", [this](const http::Request& req, http::Response& res) {
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
  });
}

}  // namespace apus::server
