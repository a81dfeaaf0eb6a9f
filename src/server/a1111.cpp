#include "server/server_impl.h"

namespace apus::server {

void Server::Impl::register_a1111() {
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
    const Json info = {{"prompt", r.prompt},
                       {"all_prompts", Json::array({r.prompt})},
                       {"negative_prompt", negative},
                       {"cfg_scale", r.cfg.value_or(model.default_cfg())},
                       {"seed", seeds[0]},
                       {"all_seeds", seeds},
                       {"width", *r.width},
                       {"height", *r.height},
                       {"steps", r.steps.value_or(model.default_steps())},
                       {"batch_size", n},
                       {"sd_model_name", j->model}};
    res.set_content(dump(Json{{"images", images}, {"parameters", in}, {"info", dump(info)}}), "application/json");
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
}

}  // namespace apus::server
