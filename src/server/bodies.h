#pragma once
// Request bodies as clients send them: JSON objects, and multipart/form-data (RFC 7578) as
// OpenAI's images/edits sends it, each part a form field (name) or a file (name and filename) in
// the order the client sent them.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace apus::server {

// `body` as a JSON object; refused (apus::Error) saying what is wrong and where, without echoing
// the client's bytes.
nlohmann::json parse_json_object(const std::string& body);

struct FormPart {
  std::string name, filename, content_type, content;
};

// The parts of `body` sent with `content_type` (which names the boundary); a malformed body is
// refused (apus::Error) saying what is wrong and where.
std::vector<FormPart> parse_multipart(const std::string& content_type, const std::string& body);

// Whether `content_type` is multipart/form-data.
bool is_multipart(const std::string& content_type);

// The first value of parameter `name` in a request target's query ("/v1/jobs?limit=5&after=x"),
// percent-decoded with '+' as a space (a '%' not followed by two hex digits stays as it is);
// nullopt when absent.
std::optional<std::string> query_value(std::string_view target, std::string_view name);

}  // namespace apus::server
