// Every route the server answers, in one table (method, path pattern, handler), and the
// transport's hooks around them. A pattern is matched against the whole path; its groups are the
// handler's Request::matches. The handlers live with their API: the service's own in server.cpp,
// the jobs in job_routes.cpp, OpenAI's in openai.cpp, AUTOMATIC1111's in a1111.cpp.
#include "server/server_impl.h"

namespace apus::server {

const Server::Impl::Route Server::Impl::kRoutes[] = {
    {"GET", "/metrics", &Server::Impl::metrics_text},
    {"GET", "/", &Server::Impl::page},
    {"GET", "/health", &Server::Impl::health},
    {"GET", "/v1/models", &Server::Impl::list_models},
    {"GET", "/v1/loras", &Server::Impl::list_loras},
    {"GET", R"(/v1/jobs/([A-Za-z0-9-]+)/events)", &Server::Impl::job_events},
    {"POST", "/v1/jobs", &Server::Impl::submit_job},
    {"GET", "/v1/jobs", &Server::Impl::list_jobs},
    {"GET", R"(/v1/jobs/([A-Za-z0-9-]+))", &Server::Impl::job_status},
    {"GET", R"(/v1/jobs/([A-Za-z0-9-]+)/files/([0-9]{1,4}))", &Server::Impl::job_file},
    {"GET", R"(/v1/jobs/([A-Za-z0-9-]+)/trace)", &Server::Impl::job_trace},
    {"DELETE", R"(/v1/jobs/([A-Za-z0-9-]+))", &Server::Impl::cancel_job},
    {"POST", "/sdapi/v1/txt2img", &Server::Impl::a1111_txt2img},
    {"POST", "/sdapi/v1/img2img", &Server::Impl::a1111_img2img},
    {"GET", "/sdapi/v1/progress", &Server::Impl::a1111_progress},
    {"POST", "/sdapi/v1/interrupt", &Server::Impl::a1111_interrupt},
    {"GET", "/sdapi/v1/sd-models", &Server::Impl::a1111_sd_models},
    {"GET", "/sdapi/v1/options", &Server::Impl::a1111_options},
    {"POST", "/sdapi/v1/options", &Server::Impl::a1111_set_options},
    {"GET", "/sdapi/v1/samplers", &Server::Impl::a1111_samplers},
    {"GET", "/sdapi/v1/schedulers", &Server::Impl::a1111_schedulers},
    {"GET", "/sdapi/v1/upscalers", &Server::Impl::a1111_upscalers},
    {"GET", "/sdapi/v1/loras", &Server::Impl::a1111_loras},
    {"POST", "/sdapi/v1/refresh-loras", &Server::Impl::a1111_refresh_loras},
    {"POST", "/sdapi/v1/refresh-checkpoints", &Server::Impl::a1111_refresh_checkpoints},
    {"GET", "/sdapi/v1/cmd-flags", &Server::Impl::a1111_cmd_flags},
    {"GET", "/sdapi/v1/scripts", &Server::Impl::a1111_scripts},
    {"GET", "/sdapi/v1/embeddings", &Server::Impl::a1111_embeddings},
    {"GET", "/sdapi/v1/sd-vae", &Server::Impl::a1111_none},
    {"GET", "/sdapi/v1/hypernetworks", &Server::Impl::a1111_none},
    {"GET", "/sdapi/v1/face-restorers", &Server::Impl::a1111_none},
    {"GET", "/sdapi/v1/realesrgan-models", &Server::Impl::a1111_none},
    {"GET", "/sdapi/v1/prompt-styles", &Server::Impl::a1111_none},
    {"GET", "/sdapi/v1/latent-upscale-modes", &Server::Impl::a1111_none},
    {"GET", "/sdapi/v1/memory", &Server::Impl::a1111_memory},
    {"POST", "/sdapi/v1/png-info", &Server::Impl::a1111_png_info},
    {"POST", "/sdapi/v1/extra-single-image", &Server::Impl::a1111_extra_single},
    {"POST", "/sdapi/v1/extra-batch-images", &Server::Impl::a1111_extra_batch},
    {"POST", "/v1/images/edits", &Server::Impl::image_edits},
    {"POST", "/v1/images/generations", &Server::Impl::image_generations},
    {"POST", "/v1/audio/generations", &Server::Impl::audio_generations},
    {"POST", "/v1/audio/speech", &Server::Impl::audio_speech},
};

std::vector<std::pair<std::string, std::string>> Server::route_list() {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Impl::Route& r : Impl::kRoutes) out.emplace_back(r.method, r.pattern);
  return out;
}

void Server::Impl::routes() {
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
  // Every refusal as a client sees it (public_message: no server folders in the paths).
  http->exception = [this](http::Response& res, std::exception_ptr ep) {
    try {
      std::rethrow_exception(ep);
    } catch (const HttpError& e) {
      send_error(res, e.status, public_message(e.message), e.param);
      if (e.status == 429) res.set_header("Retry-After", "5");
    } catch (const FieldError& e) {
      send_error(res, 400, public_message(e.what()), e.field);
    } catch (const std::bad_alloc&) {
      send_error(res, 503, "the server has not the memory to take this request now (an allocation failed)", "");
    } catch (const std::exception& e) {
      send_error(res, 500, public_message(e.what()), "");
    }
  };
  http->refusal = [](http::Response& res, int status, const std::string& message) {
    send_error(res, status, message, "");
  };
  http->log = [this](const http::Request& req, const std::string& pattern, int status) {
    metrics.request(route_name(req, pattern), status);
  };
  for (const Route& r : kRoutes)
    http->route(r.method, r.pattern, [this, handler = r.handler](const http::Request& req, http::Response& res) {
      (this->*handler)(req, res);
    });
}

}  // namespace apus::server
