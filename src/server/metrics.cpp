#include "server/metrics.h"

namespace apus::server {

std::string route_name(const http::Request& req, const std::string& pattern) {
  if (pattern.empty()) return "unrouted";
  std::string path = req.path;
  if (path.rfind("/v1/jobs/", 0) == 0) {
    const size_t end = path.find('/', 9);
    path = "/v1/jobs/{id}" + (end == std::string::npos ? "" : path.substr(end));
  }
  return req.method + " " + path;
}

}  // namespace apus::server
